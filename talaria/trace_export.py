"""`talaria trace export [--since WHEN] OUT.jsonl`: what the stack served, as a normalised
trace (talaria/traces/format.py) that `talaria sim run --trace OUT.jsonl --policy P` replays.

From the projected `calls` rows with outcome `completed`, per (session, model) in call order:

- prompt_tokens, output_tokens, model: as served;
- reusable_prefix_tokens: an agent's call repeats its previous prompt and answer, so a call
  whose prompt is at least that long reuses all of it; a shorter prompt (edited or
  compacted context) counts only what the engine found cached (`cached_tokens`). Capped at
  prompt - 1; 0 on a model-session's first call;
- gap_before_s: the measured gap, this call's submission minus the previous completion
  (>= 0); a model-session's first call: its start offset from the earliest exported start.

A session that changed model is split into model-sessions `<session>@<model>`, the
simulator's unit. Failed or unfinished calls are left out (a retry of them is a later row).
"""

from __future__ import annotations

import asyncio
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

from talaria.shared.settings import asyncpg_dsn
from talaria.traces.format import SERVED_SOURCE, Session, TraceCall, save_sessions

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """An ISO-8601 time (UTC if no zone) or a duration back from now: 90s, 30m, 2h, 1d."""
    now = now or datetime.now(timezone.utc)
    m = _DURATION.match(text.strip())
    if m:
        return now - timedelta(seconds=float(m.group(1)) * _UNIT_S[m.group(2)])
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: not an ISO-8601 time or a duration like 30m, 2h, 1d") from None
    return at if at.tzinfo else at.replace(tzinfo=timezone.utc)


def rows_to_sessions(rows) -> list[Session]:
    """Completed `calls` rows (mappings with session_id, call_index, model, prompt_tokens,
    output_tokens, cached_tokens, sub, done: epoch seconds) -> model-sessions."""
    groups: dict[tuple[str, str], list] = {}
    for r in rows:
        if r["prompt_tokens"] is None or r["prompt_tokens"] < 1 or r["sub"] is None or r["done"] is None:
            continue
        groups.setdefault((r["session_id"], r["model"]), []).append(r)
    if not groups:
        return []
    split = {sid for sid, _ in groups if sum(1 for s, _ in groups if s == sid) > 1}
    t0 = min(float(r["sub"]) for calls in groups.values() for r in calls)
    out = []
    for (sid, model), calls in sorted(groups.items(), key=lambda kv: min(float(r["sub"]) for r in kv[1])):
        calls.sort(key=lambda r: (r["call_index"] if r["call_index"] is not None else 0, float(r["sub"])))
        name = f"{sid}@{model}" if sid in split else sid
        trace: list[TraceCall] = []
        prev = None
        for idx, r in enumerate(calls):
            prompt, output = int(r["prompt_tokens"]), max(1, int(r["output_tokens"] or 0))
            if prev is None:
                reuse, gap = 0, float(r["sub"]) - t0
            else:
                context = int(prev["prompt_tokens"]) + max(1, int(prev["output_tokens"] or 0))
                reuse = context if prompt >= context else int(r["cached_tokens"] or 0)
                gap = float(r["sub"]) - float(prev["done"])
            trace.append(TraceCall(name, idx, model, prompt, max(0, min(reuse, prompt - 1)), output,
                                   max(0.0, gap), "start" if idx == 0 else "tool", f"{SERVED_SOURCE}{r.get('call_id', '')}"))
            prev = r
        out.append(Session(name, tuple(trace)))
    return out


async def fetch_rows(database_url: str, since: datetime | None = None) -> list:
    import asyncpg

    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        rows = await conn.fetch(
            "SELECT call_id, session_id, call_index, model, prompt_tokens, output_tokens, cached_tokens,"
            " extract(epoch FROM submitted_at) AS sub, extract(epoch FROM completed_at) AS done"
            " FROM calls WHERE outcome = 'completed' AND ($1::timestamptz IS NULL OR submitted_at >= $1)"
            " ORDER BY session_id, call_index", since)
        return [dict(r) for r in rows]
    finally:
        await conn.close()


def export(database_url: str, out: Path, since: datetime | None = None) -> dict:
    sessions = rows_to_sessions(asyncio.run(fetch_rows(database_url, since)))
    save_sessions(sessions, out)
    return {"sessions": len(sessions), "calls": sum(len(s.calls) for s in sessions), "out": str(out)}
