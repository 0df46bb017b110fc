"""`talaria trace`: a session's timeline from the spans the services exported as JSON lines.

With OTLP export configured, use your trace viewer instead; this reads the local files.
Sessions are named as their clients sent them; the stored id is `<tenant>:<id>`.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from talaria.running import match_sessions, pick_session
from talaria.services.gateway.auth import SCOPE_SEPARATOR
from talaria.shared.tracing import read_spans, session_trace_id


def print_timeline(directory: Path, session_id: str | None, tenant: str | None = None) -> int:
    if not directory.exists():
        print(f"talaria trace: no spans under {directory} (is OTLP export on?)", file=sys.stderr)
        return 1
    spans = read_spans(directory)
    stored = {s["attributes"].get("gen_ai.conversation.id") for s in spans} - {None}
    if session_id is None:
        for sid in sorted(stored):
            owner, sep, sent = sid.partition(SCOPE_SEPARATOR)
            print(f"{sent}  (tenant {owner})" if sep else sid)
        if not stored:
            print("no sessions traced yet")
        return 0
    scoped = pick_session(session_id, match_sessions(session_id, stored, tenant))
    trace_id = f"{session_trace_id(scoped):032x}"
    mine = [s for s in spans if s["trace_id"] == trace_id]
    if not mine:
        print(f"talaria trace: no spans for session {session_id!r}"
              f"{f' of tenant {tenant!r}' if tenant else ''} under {directory}", file=sys.stderr)
        return 1
    children: dict[str | None, list[dict]] = defaultdict(list)
    for s in mine:
        children[s["parent_id"]].append(s)
    t0 = min(s["start"] for s in mine)
    ids = {s["span_id"] for s in mine}
    roots = [s for s in mine if s["parent_id"] is None or s["parent_id"] not in ids]
    owner, sep, sent = scoped.partition(SCOPE_SEPARATOR)
    inferred = any(s["attributes"].get("talaria.session.inferred") or "talaria.session.origin" in s["attributes"]
                   for s in mine)
    mark = "  (inferred: the client named no session)" if inferred else ""
    print(f"session {sent} (tenant {owner})  trace {trace_id}{mark}" if sep else f"session {scoped}  trace {trace_id}{mark}")
    for root in sorted(roots, key=lambda s: s["start"]):
        _print(root, children, t0, 0)
    return 0


def _print(span: dict, children, t0: float, depth: int) -> None:
    attrs = span["attributes"]
    keys = ("talaria.call.index", "talaria.session.origin", "gen_ai.request.model", "talaria.instance.id",
            "talaria.kv_source",
            "talaria.queue_s", "talaria.ttft_s", "talaria.prefill_s", "talaria.decode_s")
    detail = " ".join(f"{k.split('.', 1)[1] if k.startswith('talaria.') else 'model'}={_fmt(attrs[k])}"
                      for k in keys if k in attrs)
    print(f"{'  ' * depth}+{span['start'] - t0:8.3f}s {span['end'] - span['start']:8.3f}s  "
          f"{span['name']:<20} [{span['service']}] {detail}")
    for child in sorted(children.get(span["span_id"], []), key=lambda s: s["start"]):
        _print(child, children, t0, depth + 1)


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
