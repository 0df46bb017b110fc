"""Every file the README and docs/ name exists: a path (`services/router/costs.py`) where it says,
a partial one (`engine/dtypes.py`) or a bare file name (`costs.py`) somewhere in the repository. Files the running stack writes (its
data directory's) are named in RUNTIME."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# written by the running stack or the user, not shipped: stack.json, a checkpoint's tokenizer, ...
RUNTIME = {"stack.json", "prometheus.yml", "tokenizer.json", "tokenizer_config.json", "config.json",
           "generation_config.json", "auth.conf", "cluster.conf", "nats.conf", "api_keys"}
NAMED = re.compile(r"`([A-Za-z0-9_./-]+\.(?:py|md|yml|yaml|sql|sh|json|png|toml|conf))`|\]\(([^)#\s]+)\)")


def repository_files() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def named(doc: Path):
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for m in NAMED.finditer(line):
            ref = m.group(1) or m.group(2)
            if not ref.startswith(("http:", "https:", "mailto:")):
                yield n, ref


def test_every_file_the_docs_name_exists():
    files = repository_files()
    basenames = {f.rsplit("/", 1)[-1] for f in files}
    missing = []
    for doc in DOCS:
        for n, ref in named(doc):
            name = ref.rsplit("/", 1)[-1]
            if name in RUNTIME or ref.startswith(".talaria/") or name.startswith("x."):
                continue
            here = (doc.parent / ref).resolve()
            if here.is_relative_to(ROOT) and here.relative_to(ROOT).as_posix() in files | {""}:
                continue
            if (ROOT / ref).exists() or (here.exists() and here.is_dir()):
                continue
            if "/" not in ref and name in basenames or any(f.endswith("/" + ref) for f in files):
                continue  # a bare name, or a path inside a package (`engine/dtypes.py`)
            missing.append(f"{doc.relative_to(ROOT)}:{n}: {ref}")
    assert not missing, "named in the docs but not in the repository:\n" + "\n".join(missing)
