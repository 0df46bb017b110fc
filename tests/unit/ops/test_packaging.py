"""One import root: the wheel installs everything under `talaria.`, with its data files."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAPPED = PYPROJECT["tool"]["setuptools"]["package-dir"]


def _package_folders() -> set[str]:
    names = set()
    for package, folder in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            names.add(".".join((package, *rel.parts)))
    return names


def test_every_package_folder_is_installed():
    assert _package_folders() == set(PYPROJECT["tool"]["setuptools"]["packages"])


def test_no_generic_top_level_imports():
    bad = re.compile(r"^\s*(from|import) (shared|services|migrations|ops)\b", re.M)
    offenders = [str(p.relative_to(ROOT)) for folder in ("shared", "services", "migrations", "talaria", "tests", "bench")
                 for p in (ROOT / folder).rglob("*.py") if bad.search(p.read_text())]
    assert offenders == []


def test_data_files_resolve_through_the_package():
    from talaria.audit import audits
    from talaria.shared.db.connection import MIGRATIONS_DIR
    from talaria.sim.workloads import FIXED_REPLAY_FILE

    assert "session_calls" in audits()
    assert (MIGRATIONS_DIR / "env.py").is_file()
    assert FIXED_REPLAY_FILE.is_file()


def test_class_names_are_unique_across_the_code_base():
    """One name, one concept: a reader (or a grep) never lands on the wrong class."""
    seen: dict[str, list[str]] = {}
    for folder in ("shared", "services", "talaria"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in re.findall(r"^class (\w+)", path.read_text(), re.M):
                seen.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in seen.items() if len(p) > 1} == {}
