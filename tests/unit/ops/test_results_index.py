"""results/ holds only current outputs: each file made by one command of bench/regenerate.py (or a
note written by hand, named as such), each Markdown result stamped with that command and a commit,
and the folder small enough to read."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from bench.regenerate import NOTES, RESULTS, main
from bench.run_record import STAMP, stamp, stamp_line

ROOT = Path(__file__).resolve().parents[3]
MAX_FILES = 40  # issue 36: results/ <= 40 files


def results_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line.removeprefix("results/") for line in out.split() if (ROOT / line).exists()]


def test_every_results_file_is_made_by_exactly_one_listed_command():
    made = [o for r in RESULTS for o in r.outputs] + list(NOTES)
    assert len(made) == len(set(made)), "a file listed twice"
    files = set(results_files())
    assert files - set(made) == set(), "in results/ but made by no command in bench/regenerate.py"
    assert set(made) - files == set(), "listed in bench/regenerate.py but not in results/"


def test_the_results_index_names_every_results_file():
    index = (ROOT / "results" / "README.md").read_text()
    assert [f for f in results_files() if f != "README.md" and f not in index] == []
    assert [r.name for r in RESULTS if r.name not in index] == []


def test_results_folder_stays_small():
    assert len(results_files()) <= MAX_FILES


def test_every_markdown_result_is_stamped_with_its_command_and_a_commit():
    for r in RESULTS:
        for out in r.outputs:
            if out.endswith(".md"):
                first = (ROOT / "results" / out).read_text().splitlines()[0]
                m = STAMP.match(first)
                assert m, f"results/{out}: first line is not a stamp: {first[:80]}"
                made_by = {" && ".join(r.commands), r.rerender} - {""}
                assert m["command"] in made_by, f"results/{out}: stamped with another command"
                assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", m["commit"]), f"results/{out}: {m['commit']}"


def test_each_listed_script_exists_and_takes_the_flags_given():
    for r in RESULTS:
        for command in r.commands:
            for script in re.findall(r"\bbench/\w+\.py", command):
                source = (ROOT / script).read_text()
                for flag in re.findall(r"(?<=[\s])--[a-z][a-z-]*", command.split(script, 1)[1].split(" > ")[0]):
                    assert f'"{flag}"' in source, f"{r.name}: {script} has no {flag}"
            for module in re.findall(r"python -m (talaria\.[\w.]+)", command):
                assert (ROOT / (module.replace(".", "/") + ".py")).exists(), module


def test_dry_run_prints_every_command_and_runs_none(capsys):
    before = {f: (ROOT / "results" / f).stat().st_mtime_ns for f in results_files()}
    assert main(["--dry-run"]) == 0
    printed = capsys.readouterr().out
    for r in RESULTS:
        for command in r.commands:
            assert command in printed
    assert before == {f: (ROOT / "results" / f).stat().st_mtime_ns for f in results_files()}


def test_an_unknown_result_name_is_a_one_line_error(capsys):
    assert main(["--dry-run", "--only", "no-such-result"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no-such-result" in err


def test_a_stamp_replaces_the_older_one(tmp_path):
    page = tmp_path / "x.md"
    page.write_text("# title\n\nbody\n")
    stamp(page, "python bench/x.py", at="abc1234")
    stamp(page, "python bench/x.py --n 2", at="def5678")
    assert page.read_text() == stamp_line("python bench/x.py --n 2", at="def5678") + "\n# title\n\nbody\n"
