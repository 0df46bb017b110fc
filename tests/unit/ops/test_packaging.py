"""One import root: the wheel installs everything under `talaria.`, with its data files."""

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
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


def _data_folders() -> set[str]:
    """Packages that hold only data (no __init__.py): listed so setuptools ships them quietly."""
    return {name for name in PYPROJECT["tool"]["setuptools"]["package-data"] if name not in _package_folders()}


def test_every_package_folder_is_installed():
    assert _package_folders() | _data_folders() == set(PYPROJECT["tool"]["setuptools"]["packages"])


def test_the_distribution_name_is_not_the_unrelated_pypi_talaria():
    # `pip install talaria` installs someone else's project; ours installs as this name, from a clone.
    assert PYPROJECT["project"]["name"] == "talaria-serving"
    assert PYPROJECT["project"]["scripts"] == {"talaria": "talaria.cli:main"}


def test_the_wheel_builds_without_warnings_and_carries_its_data(tmp_path):
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in set(MAPPED.values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                          "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "would be ignored" not in out.stdout + out.stderr
    (wheel,) = tmp_path.glob("talaria_serving-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for data in ("talaria/ops/audit/session_calls.sql", "talaria/ops/otel/collector.yaml",
                 "talaria/sim/data/fixed_replay_sessions.jsonl", "talaria/shared/data/demo_bpe_corpus.txt",
                 "talaria/migrations/alembic.ini"):
        assert data in names
    assert not {n.split("/")[0] for n in names} - {"talaria", "talaria_serving-0.1.0.dist-info"}


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
