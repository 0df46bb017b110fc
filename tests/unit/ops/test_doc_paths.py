"""Every file the README, docs/ and the results index name exists: a path (`services/router/costs.py`)
where it says, a partial one (`engine/dtypes.py`) or a bare file name (`costs.py`) somewhere in the
repository; and every `#anchor` a link names is a heading of its target. Files the running stack
writes (its data directory's) are named in RUNTIME. Decision records (docs/decisions/) may name what
is gone: they are history."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "README.md"]
# written by the running stack or the user, not shipped: stack.json, a checkpoint's tokenizer, ...
RUNTIME = {"stack.json", "prometheus.yml", "tokenizer.json", "tokenizer_config.json", "config.json",
           "generation_config.json", "auth.conf", "cluster.conf", "nats.conf", "api_keys"}
ANCHORED = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")
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


def anchors(doc: Path) -> set[str]:
    """GitHub's heading slugs: lower case, punctuation dropped, spaces as hyphens."""
    out, fenced = set(), False
    for line in doc.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_anchor_a_link_names_is_a_heading_of_its_target():
    broken = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in ANCHORED.finditer(line):
                target = (doc.parent / m.group(1)).resolve() if m.group(1) else doc
                if m.group(1).startswith(("http:", "https:")) or target.suffix != ".md":
                    continue
                if not target.exists() or m.group(2) not in anchors(target):
                    broken.append(f"{doc.relative_to(ROOT)}:{n}: {m.group(1)}#{m.group(2)}")
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)
