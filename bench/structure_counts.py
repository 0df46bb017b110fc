"""Structure counts of the tree (issue 22): the same code gives the before and after figures.

    python bench/structure_counts.py [--json] [--no-duplicates]

What each count is (all read statically from the source, nothing is imported):

- call_shapes: classes of the instance agent (services/instance_agent, memory/ aside) that
  hold one call: a `call_id` field or property, or a field typed as another such class or as
  `CallRouted`. The scheduler's events and notes (the `SchedulerEvent` union) and one
  token (`StepToken`) are not a call.
- call_id_maps: distinct attributes of the agent indexed by a call id anywhere
  (`x.name[call_id]`, `x.name.get(call_id`, `.pop(call_id`, `call_id in x.name`, ...).
- import_cycles: strongly connected components (more than one module) of the graph of every
  `talaria.*` import, module-level, function-level and under TYPE_CHECKING alike; a package
  import counts as an edge to its `__init__`; `cycle_modules` is how many modules are in one.
- function_imports: import statements inside a function body (all, and those of talaria modules).
- type_checking_blocks: `if TYPE_CHECKING:` blocks.
- settings_fields: fields of each settings dataclass (a class named *Settings or *Config).
- module_constants: module-level UPPER_CASE names assigned in non-test code.
- duplicates: the pair count of the `duplicates` tool over the tree.
- design_words: `wc -w docs/design.md`.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# On-disk folder -> the package it installs as (pyproject's package-dir).
PACKAGE_DIRS = {"talaria": "talaria", "shared": "talaria.shared", "services": "talaria.services",
                "migrations": "talaria.migrations", "ops": "talaria.ops"}
AGENT = ROOT / "services" / "instance_agent"


def source_files() -> list[Path]:
    return sorted(p for top in PACKAGE_DIRS for p in (ROOT / top).rglob("*.py"))


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    parts[0] = PACKAGE_DIRS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


# ---- imports ------------------------------------------------------------------------------

def _imported(node: ast.AST, current: str, is_pkg: bool, known: set[str]) -> list[str]:
    """The talaria modules one import statement reaches."""
    targets: list[str] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            targets.append(alias.name)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = current.split(".") if is_pkg else current.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            targets.append(sub if sub in known else base)
    out = []
    for t in targets:
        while t and t not in known:  # `import a.b.c` of a name inside a module: its module
            t = t.rpartition(".")[0]
        if t.startswith("talaria"):
            out.append(t)
    return out


def import_graph(files: list[Path]) -> tuple[dict[str, set[str]], dict[str, int], int]:
    known = {module_name(p) for p in files}
    graph: dict[str, set[str]] = {m: set() for m in known}
    function_imports = {"all": 0, "talaria": 0}
    type_checking = 0
    for path in files:
        mod, tree = module_name(path), parse(path)
        is_pkg = path.name == "__init__.py"
        in_function: set[int] = set()  # ids of import nodes inside a function body
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                type_checking += 1
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = _imported(node, mod, is_pkg, known)
                graph[mod].update(t for t in targets if t != mod)
                if id(node) in in_function:
                    function_imports["all"] += 1
                    function_imports["talaria"] += bool(targets)
    return graph, function_imports, type_checking


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


# ---- the agent's call shapes and call-id maps -----------------------------------------------

def _annotation_names(node: ast.expr | None) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} if node is not None else set()


def _held(annotation: ast.expr) -> set[str]:
    """The class a field holds one of (`X`, `X | None`), not a collection of them (a batch)."""
    if isinstance(annotation, ast.Name):
        return {annotation.id}
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _held(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.BinOp):
        return _held(annotation.left) | _held(annotation.right)
    return set()


def call_shapes() -> list[str]:
    classes: dict[str, tuple[set[str], set[str]]] = {}  # name -> (field names, annotation names)
    events: set[str] = {"StepToken"}
    for path in AGENT.rglob("*.py"):
        if "memory" in path.parts:
            continue
        tree = parse(path)
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                if isinstance(target, ast.Name) and target.id == "SchedulerEvent":
                    events |= _annotation_names(node.value)
            if not isinstance(node, ast.ClassDef):
                continue
            names, types = set(), set()
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                    types |= _held(item.annotation)
                elif isinstance(item, ast.FunctionDef) and any(
                        isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
                    names.add(item.name)
            classes[node.name] = (names, types)
    shapes = {c for c, (names, _) in classes.items() if "call_id" in names} - events
    grew = True
    while grew:
        wrap = {c for c, (_, types) in classes.items() if types & (shapes | {"CallRouted"})}
        grew = not wrap <= shapes
        shapes |= wrap
    return sorted(shapes)


_ID = r"(?:call_id|cid|c)"  # the names the agent gives a call id
_KEYED = re.compile(rf"\b(?:self|[a-z_]+)\.((?:[a-z_]+\.)*[a-z_]+)(?:\[\s*{_ID}\s*\]|\.(?:get|pop|setdefault)\(\s*{_ID}\b)")
_MEMBER = re.compile(rf"(?<!for )\b{_ID}\s+(?:not\s+)?in\s+(?:self|[a-z_]+)\.((?:[a-z_]+\.)*[a-z_]+)\b(?!\()")


def call_id_maps() -> list[str]:
    found: set[str] = set()
    for path in AGENT.rglob("*.py"):
        if "memory" in path.parts:
            continue
        text = path.read_text()
        for m in (*_KEYED.finditer(text), *_MEMBER.finditer(text)):
            found.add(m.group(1).rpartition(".")[2])
    return sorted(found)


# ---- settings and constants -----------------------------------------------------------------

def settings_fields(files: list[Path]) -> dict[str, int]:
    out = {}
    for path in files:
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Settings", "Config")) and any(
                    (isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass")
                    or getattr(d, "id", "") == "dataclass" for d in node.decorator_list):
                n = sum(isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)
                        and not _is_classvar(i.annotation) for i in node.body)
                out[f"{module_name(path).removeprefix('talaria.')}.{node.name}"] = n
    return dict(sorted(out.items()))


def _is_classvar(annotation: ast.expr) -> bool:
    return "ClassVar" in _annotation_names(annotation)


def module_constants(files: list[Path]) -> int:
    n = 0
    for path in files:
        for node in parse(path).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) and node.value is not None else []
            for t in targets:
                for name in ([t] if isinstance(t, ast.Name) else getattr(t, "elts", [])):
                    if isinstance(name, ast.Name) and re.fullmatch(r"_?[A-Z][A-Z0-9_]+", name.id):
                        n += 1
    return n


def duplicate_pairs() -> int | None:
    try:
        out = subprocess.run(["duplicates", "--seconds", "120"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"(\d+) pairs?", out)
    return int(m.group(1)) if m else (0 if "no duplicates" in out else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-duplicates", action="store_true", help="skip the (slow) duplicates tool")
    ap.add_argument("--cycles", action="store_true", help="list the modules of each import cycle")
    args = ap.parse_args()
    files = source_files()
    graph, function_imports, type_checking = import_graph(files)
    comps = cycles(graph)
    shapes, maps = call_shapes(), call_id_maps()
    fields = settings_fields(files)
    counts = {
        "call_shapes": len(shapes), "call_shape_names": shapes,
        "call_id_maps": len(maps), "call_id_map_names": maps,
        "import_cycles": len(comps), "cycle_modules": sum(map(len, comps)),
        "function_imports": function_imports, "type_checking_blocks": type_checking,
        "settings_fields": fields,
        "module_constants": module_constants(files),
        "duplicates": None if args.no_duplicates else duplicate_pairs(),
        "design_words": len((ROOT / "docs" / "design.md").read_text().split()),
    }
    if args.cycles:
        counts["cycles"] = comps
    if args.json:
        print(json.dumps(counts, indent=1))
        return
    for key, value in counts.items():
        print(f"{key:22} {value}")


if __name__ == "__main__":
    main()
