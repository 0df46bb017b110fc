"""Convert the WEKA kv-cache-tester traces (shared/traces/README.md) to the normalised format.

Streaming: one input line (one conversation) is parsed, converted and written before the
next is read, so the 460 MB decompressed file never sits in memory. `.xz` input is read
through `lzma`. The field mapping per LLM call: `convert_session`; sub-agent markers (their
own call lists): `iter_converted`.
"""

from __future__ import annotations

import json
import lzma
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from talaria.traces.format import TraceCall, dump_calls

BLOCK_TOKENS = 64


@dataclass
class ConvertSummary:
    traces: int = 0
    sessions: int = 0
    calls: int = 0
    subagent_sessions: int = 0
    subagents_dropped: int = 0
    multi_model_sessions: int = 0
    missing_think_time: int = 0
    models: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["models"] = dict(self.models)
        return d


def open_text(path: str | Path) -> IO[str]:
    path = Path(path)
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def looks_like_weka(first_line: str) -> bool:
    """A WEKA conversation line: an object with `id` and a `requests` list (a normalised
    trace line has `session` instead)."""
    try:
        obj = json.loads(first_line)
    except ValueError:
        return False
    return isinstance(obj, dict) and "session" not in obj and isinstance(obj.get("requests"), list) and "id" in obj


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _gap(req: dict, prev: dict | None, summary: ConvertSummary) -> float:
    if prev is None:
        return 0.0
    think = req.get("think_time")
    if think is not None:
        return max(0.0, float(think))
    summary.missing_think_time += 1
    dt = float(req.get("t", 0.0)) - float(prev.get("t", 0.0))
    if prev.get("api_time") is not None:
        dt -= float(prev["api_time"])
    return max(0.0, dt)


def _kind(req: dict, index: int) -> str:
    if index == 0:
        return "start"
    types = req.get("input_types") or []
    return "user" if "text" in types and "tool_result" not in types else "tool"


def convert_session(
    session_id: str, requests: list[dict], summary: ConvertSummary, source: str = ""
) -> list[TraceCall]:
    """Convert one call list (parent or sub-agent) into normalised calls.

    Field mapping, per LLM call (`type` "n"/"s"):

    - ``session`` = the trace ``id``; ``call_index`` = position among the session's calls.
    - ``prompt_tokens`` = ``in``; ``output_tokens`` = max(1, ``out``).
    - ``reusable_prefix_tokens``: longest common prefix of ``hash_ids`` with the previous call,
      in 64-token blocks. When the previous prompt's blocks are *all* a prefix of this prompt,
      the previous output is counted too (the paper's "prior prompt plus generated response"),
      i.e. min(prev_in + prev_out, in). Capped at ``in``; 0 on call 0.
    - ``gap_before_s`` = ``think_time`` of this call (the README's choice: ``t`` has 1 s
      resolution). Without ``think_time``: t - (t_prev + api_time_prev), floored at 0, or the
      ``t`` difference when ``api_time`` is missing too. Call 0: 0.
    - ``kind``: "start" on call 0, "user" when ``input_types`` has "text" and no
      "tool_result", else "tool".
    - ``model``: a session keeps one model in the normalised format; a trace whose parent calls
      use several models takes its most frequent one (the original mix is counted in the
      summary). The simulator maps trace models onto served models anyway.
    """
    llm = [r for r in requests if r.get("type") != "subagent"]
    if not llm:
        return []
    counts = Counter(str(r.get("model", "unknown")) for r in llm)
    model = counts.most_common(1)[0][0]
    if len(counts) > 1:
        summary.multi_model_sessions += 1
    out: list[TraceCall] = []
    prev: dict | None = None
    for i, req in enumerate(llm):
        prompt = max(1, int(req.get("in", 0)))
        reusable = 0
        if prev is not None:
            a, b = prev.get("hash_ids") or [], req.get("hash_ids") or []
            blocks = _lcp(a, b)
            if a and blocks == len(a):
                reusable = int(prev.get("in", 0)) + int(prev.get("out", 0))
            else:
                reusable = blocks * BLOCK_TOKENS
            reusable = min(reusable, prompt)
        out.append(
            TraceCall(
                session=session_id,
                call_index=i,
                model=model,
                prompt_tokens=prompt,
                reusable_prefix_tokens=reusable,
                output_tokens=max(1, int(req.get("out", 1))),
                gap_before_s=_gap(req, prev, summary),
                kind=_kind(req, i),
                source=source,
            )
        )
        prev = req
    summary.models[model] += 1
    return out


def iter_converted(
    stream: IO[str], summary: ConvertSummary, subagents: str = "separate"
) -> Iterator[list[TraceCall]]:
    """Yield one converted session (a list of calls) at a time.

    Sub-agent markers (``type`` "subagent", 63 in 19 traces) carry their own call list:

    - ``subagents="separate"`` (default): each becomes its own session
      ``<trace id>/<agent_id>`` written right after its parent, starting at offset 0. Its hash
      namespace is the parent's, but prefix reuse is computed within the sub-agent's own calls.
    - ``subagents="drop"``: markers are skipped; the parent's next gap already spans the
      sub-agent's run (its ``think_time``), so parents are unchanged either way.
    """
    if subagents not in ("separate", "drop"):
        raise ValueError(f"subagents must be 'separate' or 'drop', got {subagents!r}")
    for lineno, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            trace = json.loads(line)
            trace_id = str(trace["id"])
            requests = trace["requests"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"WEKA trace line {lineno}: not a trace object ({exc})") from exc
        summary.traces += 1
        parent = convert_session(trace_id, requests, summary, source=trace_id)
        if parent:
            summary.sessions += 1
            summary.calls += len(parent)
            yield parent
        for marker in (r for r in requests if r.get("type") == "subagent"):
            if subagents == "drop":
                summary.subagents_dropped += 1
                continue
            sid = f"{trace_id}/{marker.get('agent_id', 'agent')}"
            sub = convert_session(sid, marker.get("requests") or [], summary, source=trace_id)
            if sub:
                summary.subagent_sessions += 1
                summary.sessions += 1
                summary.calls += len(sub)
                yield sub


def convert_file(
    src: str | Path,
    dst: str | Path,
    subagents: str = "separate",
    limit: int | None = None,
) -> ConvertSummary:
    """Convert a WEKA JSONL(.xz) file into a normalised JSONL file, streaming."""
    summary = ConvertSummary()
    with open_text(src) as stream, Path(dst).open("w", encoding="utf-8") as out:
        for session in iter_converted(stream, summary, subagents):
            dump_calls(session, out)
            if limit is not None and summary.traces >= limit:
                break
    return summary


def iter_weka_sessions(
    src: str | Path, subagents: str = "separate"
) -> Iterator[list[TraceCall]]:
    """Stream converted sessions straight from a WEKA file (no intermediate file)."""
    summary = ConvertSummary()
    with open_text(src) as stream:
        yield from iter_converted(stream, summary, subagents)
