"""A benchmark run's Markdown: printed, and appended to a results file under a heading that
says when and with which command line it was made (so a results file keeps every run)."""

from __future__ import annotations

import sys
import time


def publish(text: str, out: str | None, title: str) -> None:
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(f"\n### {title} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
                    f"`{' '.join(sys.argv)}`\n\n{text}")
