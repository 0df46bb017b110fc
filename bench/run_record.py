"""A benchmark run's Markdown: printed, and appended to a results file under a heading that
says when, with which command line and at which commit it was made; and the one-line stamp
(command and commit) that bench/regenerate.py puts on every Markdown result."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAMP = re.compile(r"^<!-- made by `(?P<command>.+)` at commit (?P<commit>\S+) -->$")


def commit() -> str:
    """The checkout's short commit, `+dirty` when the tree has changes (the stamp must not lie)."""
    def git(*a):
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    # the outputs themselves do not count: they are what is being made
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!results") else "")


def stamp_line(command: str, at: str | None = None) -> str:
    return f"<!-- made by `{command}` at commit {at or commit()} -->"


def stamp(path: Path, command: str, at: str | None = None) -> None:
    """Put the stamp on a Markdown result's first line (replacing an older stamp)."""
    lines = path.read_text().splitlines()
    if lines and STAMP.match(lines[0]):
        lines = lines[1:]
    path.write_text("\n".join([stamp_line(command, at), *lines]) + "\n")


def publish(text: str, out: str | None, title: str) -> None:
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(f"\n### {title} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
                    f"`{' '.join(sys.argv)}` at commit {commit()}\n\n{text}")


def replace_generated(text: str, section: str, body: str, end: str, after: str = "") -> str:
    """`text` with the generated part of `section` (a "## ..." heading line) replaced by `body`.
    The generated part runs from the heading to the first line after it that starts with
    `end` (a verdict line the bench writes last), so the reading a person wrote below it is
    kept; without such a line, to the next "## " heading. A missing section goes after the
    section headed `after` (else at the end)."""
    head, found, rest = text.partition(section + "\n")
    if found:
        stop = rest.find("\n" + end)
        if stop >= 0 and (rest.find("\n## ") < 0 or stop < rest.find("\n## ")):
            tail = rest[rest.find("\n", stop + 1):] if rest.find("\n", stop + 1) >= 0 else ""
        else:
            tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
        return head.rstrip() + "\n\n" + body.rstrip() + ("\n\n" + tail.lstrip("\n") if tail.strip() else "\n")
    head, sec, rest = text.partition(after + "\n") if after else (text, "", "")
    if not sec:
        return text.rstrip() + "\n\n" + body.rstrip() + "\n"
    cut = rest.find("\n## ")
    return head + sec + (rest[:cut] if cut >= 0 else rest).rstrip() + "\n\n" + body.rstrip() + "\n" + (
        rest[cut:] if cut >= 0 else "")
