"""Reading a trace file of either kind: a normalised one (format.py) or a raw WEKA file (weka.py)."""

from __future__ import annotations

from pathlib import Path

from talaria.traces.format import Session, group_sessions, iter_numbered, sessions_from_calls
from talaria.traces.weka import iter_weka_sessions, looks_like_weka, open_text


def load_trace(path: str | Path) -> list[Session]:
    """Load and validate a normalised trace file (JSONL, or `.xz`). Errors name line and field.

    A raw WEKA kv-cache-tester file (one conversation per line, traces/weka.py) is
    recognised by its first line and converted on the way in, as `talaria sim convert` would."""
    path = Path(path)
    with open_text(path) as stream:
        if looks_like_weka(stream.readline()):
            return sessions_from_calls(c for s in iter_weka_sessions(path) for c in s)
    with open_text(path) as stream:
        return group_sessions(iter_numbered(stream, str(path)), str(path))
