"""The sglang engine (engine/sglang_engine.py, sglang_hicache.py) has never run: no machine
here can run SGLang. This checks it against SGLang's real source instead: the wheel of the
version it was written for is downloaded without dependencies (cached under the gitignored
.cache/sglang-wheel/), its Python files are parsed with `ast` (never imported), and every class,
method, keyword, server argument, sampling field and output key the adapter uses must exist
there. A change on either side that breaks a call fails here.

Bump SGLANG_VERSION to check the adapter against a newer SGLang.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SGLANG_VERSION = "0.5.23"
CACHE = ROOT / ".cache" / "sglang-wheel"
ENGINE = ROOT / "services" / "instance_agent" / "engine" / "sglang_engine.py"
HICACHE = ROOT / "services" / "instance_agent" / "engine" / "sglang_hicache.py"


@cache
def wheel() -> zipfile.ZipFile:
    found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "-d", str(CACHE), f"sglang=={SGLANG_VERSION}"], capture_output=True, text=True)
        found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if not found:
            pytest.fail(f"could not download sglang=={SGLANG_VERSION}: {done.stderr[-2000:]}")
    return zipfile.ZipFile(found[0])


@cache
def source(module: str) -> ast.Module:
    """A module of the wheel, parsed (`sglang.srt.entrypoints.engine` or a package)."""
    z, path = wheel(), module.replace(".", "/")
    for name in (f"{path}.py", f"{path}/__init__.py"):
        if name in z.namelist():
            return ast.parse(z.read(name).decode())
    raise AssertionError(f"SGLang {SGLANG_VERSION} has no module {module}")


def cls(module: str, name: str) -> ast.ClassDef:
    for node in source(module).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"SGLang {SGLANG_VERSION}: no class {name} in {module}")


def methods(c: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def params(fn) -> tuple[set[str], bool]:
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    return names, a.kwarg is not None


def fields(c: ast.ClassDef) -> set[str]:
    return {n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def strings(module: str) -> set[str]:
    return {n.value for n in ast.walk(source(module)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def ours(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def dict_keys(fn: ast.FunctionDef) -> set[str]:
    """Keys of every dict literal and `x["key"] = ...` in a function of ours."""
    keys = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Dict):
            keys |= {k.value for k in n.keys if isinstance(k, ast.Constant)}
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant):
                    keys.add(t.slice.value)
    return keys


ENGINE_MODULE = "sglang.srt.entrypoints.engine"
TOKENIZER_MANAGER = ("sglang.srt.managers.tokenizer_manager", "TokenizerManager")


def receiver(call: ast.Call) -> str | None:
    """What a call of ours is made on: 'engine' (an sglang.Engine), 'tokenizer_manager', or None."""
    f = call.func
    if not isinstance(f, ast.Attribute):
        return None
    v = f.value
    if isinstance(v, ast.Attribute) and v.attr == "tokenizer_manager":
        return "tokenizer_manager"
    if isinstance(v, ast.Name) and v.id == "engine":
        return "engine"
    if isinstance(v, ast.Subscript) and isinstance(v.value, ast.Attribute) and v.value.attr == "_engines":
        return "engine"
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "_engine":
        return "engine"
    if isinstance(v, ast.Attribute) and v.attr == "loop":
        return "loop"
    return None


def test_the_package_exposes_engine():
    assert "Engine" in strings("sglang")  # sglang.Engine = LazyImport(".../engine", "Engine")
    cls(ENGINE_MODULE, "Engine")


def test_every_engine_and_tokenizer_manager_call_exists_with_its_keywords():
    engine = methods(cls(ENGINE_MODULE, "Engine"))
    manager = methods(cls(*TOKENIZER_MANAGER))
    init_attrs = {t.attr for n in ast.walk(engine["__init__"]) if isinstance(n, ast.Assign)
                  for t in n.targets if isinstance(t, ast.Attribute)}
    assert {"loop", "tokenizer_manager"} <= init_attrs  # what the adapter reaches through
    checked = set()
    for call in (n for n in ast.walk(ours(ENGINE)) if isinstance(n, ast.Call)):
        kind = receiver(call)
        if kind not in ("engine", "tokenizer_manager"):
            continue
        table = engine if kind == "engine" else manager
        name = call.func.attr
        assert name in table, f"SGLang {SGLANG_VERSION}: {kind}.{name} does not exist"
        names, open_kw = params(table[name])
        for kw in call.keywords:
            assert kw.arg in names or open_kw, f"{kind}.{name}() has no keyword {kw.arg!r}"
        checked.add(name)
    assert {"async_generate", "release_memory_occupation", "resume_memory_occupation",
            "update_weights_from_disk", "abort_request", "flush_cache", "shutdown"} <= checked


def test_every_engine_argument_is_a_server_argument():
    z = wheel()
    known = set()
    for name in z.namelist():
        if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
            tree = ast.parse(z.read(name).decode())
            for c in (n for n in tree.body if isinstance(n, ast.ClassDef)):
                known |= fields(c)
    ours_keys = dict_keys(function(ours(ENGINE), "engine_kwargs"))
    assert ours_keys and not ours_keys - known - {"backend_name", "module_path", "class_name", "model",
                                                  "host_pages"}, ours_keys - known
    policies = strings("sglang.srt.arg_groups.fields.memory")
    assert {"write_through", "dynamic"} <= policies


def test_every_sampling_parameter_is_a_sampling_params_field():
    known = fields(cls("sglang.srt.sampling.sampling_params", "SamplingParams"))
    used = dict_keys(function(ours(ENGINE), "sampling_params"))
    assert used and used <= known, used - known


def test_the_output_keys_read_are_the_ones_sglang_writes():
    written = strings("sglang.srt.managers.tokenizer_manager")
    assert {"output_ids", "meta_info", "cached_tokens", "finish_reason", "output_token_logprobs",
            "output_top_logprobs"} <= written


def test_the_memory_tags_are_sglangs():
    constants = {n.targets[0].id: n.value.value for n in source("sglang.srt.constants").body
                 if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)}
    import talaria.services.instance_agent.engine.sglang_engine as adapter

    assert set(adapter.RELEASE_TAGS) | set(adapter.RESUME_TAGS) <= {
        constants["GPU_MEMORY_TYPE_KV_CACHE"], constants["GPU_MEMORY_TYPE_WEIGHTS"]}


def test_hkvr_fits_the_hicache_storage_interface_and_the_dynamic_factory():
    base = methods(cls("sglang.srt.mem_cache.hicache_storage", "HiCacheStorage"))
    abstract = {n for n, f in base.items() if any(isinstance(d, ast.Name) and d.id == "abstractmethod"
                                                   for d in f.decorator_list)}
    tree = ours(HICACHE)
    mine = methods(next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TalariaHiCacheStorage"))
    assert abstract <= set(mine), abstract - set(mine)
    for name, fn in mine.items():
        if name in base:
            assert params(fn)[0] == params(base[name])[0], f"HiCacheStorage.{name} takes {params(base[name])[0]}"
    for imp in (n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module.startswith("sglang")):
        defined = {getattr(n, "name", None) for n in source(imp.module).body}
        assert {a.name for a in imp.names} <= defined, imp.module
    factory = source("sglang.srt.mem_cache.storage.backend_factory")
    assert {"backend_name", "module_path", "class_name"} <= strings("sglang.srt.mem_cache.storage.backend_factory")
    ctor = [c for c in ast.walk(factory) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
            and c.func.id == "backend_class"]
    assert any(len(c.args) == 2 for c in ctor)  # backend_class(storage_config, kwargs): our __init__
    init_names, _ = params(mine["__init__"])
    assert {"storage_config", "kwargs"} <= init_names
