"""Session inference on real agent sessions with their ids stripped (not a test).

    python bench/session_attribution.py [--trace /work/shared/traces/weka_cc_traces.jsonl.xz]
        [--batch 32] [--limit 0] [--rerendered-tail 512] [--recorded-only] [--out results/session_attribution.md]

The WEKA Claude Code traces carry, per call, the prefix-block hashes of its prompt (64-token
blocks, local to a trace) but no text. Each trace's calls (and each sub-agent's, as its own
session in the same hash namespace) are fed to one tenant's SessionIndex without their ids,
`--batch` sessions at a time interleaved by their own clocks (submission at `t`, the answer
recorded at `t + api_time`), in two variants: as recorded, and with a 16K-token system
prompt shared by every session. Token ids are derived from the block hashes (equal block,
equal tokens); a prompt's tokens past its last full block and its answer's first tokens are
the next call's at those positions when that call extends this one (it then holds the
answer), else tokens of its own. Counted: continuations attributed to their own session,
calls merged into another session, and what each other one repeats of its predecessor.
"""

from __future__ import annotations

import argparse
import heapq
import json
import lzma
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from talaria.services.gateway.session_inference import HORIZON_S, RERENDERED_TAIL_TOKENS, SessionIndex  # noqa: E402

BLOCK = 64  # the traces' block size
SHARED_BLOCKS = 16384 // BLOCK  # the 16K-token shared system prompt variant
ANSWER_TOKENS = 16
SYSTEM_ONLY = "not attributed: only the system prompt and tools repeated"


@dataclass
class Call:
    session: str  # the truth, never shown to the index
    index: int
    namespace: int  # the trace: its hash ids are local to it
    hashes: list[int]
    tokens: int
    t: float
    api_time: float
    system_blocks: int = 0  # the trace's system prompt and tool schema, in blocks (explains misses only)
    next: "Call | None" = None


def sessions_of(trace: dict, namespace: int) -> list[list[Call]]:
    out, parent = [], []
    system = ((trace.get("system_tokens") or 0) + (trace.get("tool_tokens") or 0)) // BLOCK
    for req in trace["requests"]:
        if req.get("type") == "subagent":
            sub = [r for r in req.get("requests", []) if r.get("type") != "subagent"]
            if sub:
                out.append([Call(f"{trace['id']}/{req.get('agent_id')}", i, namespace, r["hash_ids"], r["in"],
                                 float(r["t"]), float(r.get("api_time") or 1.0)) for i, r in enumerate(sub)])
            continue
        parent.append(Call(trace["id"], len(parent), namespace, req["hash_ids"], req["in"], float(req["t"]),
                           float(req.get("api_time") or 1.0)))
    out.insert(0, parent)
    for calls in out:
        for c in calls:
            c.system_blocks = system
        for a, b in zip(calls, calls[1:]):
            a.next = b
    return [c for c in out if c]


class Tokens:
    """A call's prompt (and its answer, past the prompt) as token ids, derived on demand."""

    def __init__(self, call: Call, shared: int) -> None:
        self.call, self.shared = call, shared
        self.length = call.tokens + shared * BLOCK

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, s: slice) -> list[int]:
        stop = self.length if s.stop is None else s.stop
        return [self.at(p) for p in range(s.start or 0, stop)]

    def at(self, p: int) -> int:
        c, shared = self.call, self.shared
        block, off = divmod(p, BLOCK)
        if block < shared:
            return hash(("system", block, off))
        if block - shared < len(c.hashes):
            return hash((c.namespace, c.hashes[block - shared], off))
        n = c.next  # past this call's full blocks: the next call's, if it extends this one
        if n is not None and n.hashes[:len(c.hashes)] == c.hashes and block - shared < len(n.hashes):
            return hash((n.namespace, n.hashes[block - shared], off))
        return hash(("own", c.session, c.index, p))


def hashes_of(call: Call, shared: int) -> list[int]:
    own = [(call.namespace << 40) | h for h in call.hashes]
    return [(1 << 62) | b for b in range(shared)] + own if shared else own


def run(batches, shared: int, horizon_s: float, tail: int) -> Counter:
    stats: Counter = Counter()
    index = SessionIndex(horizon_s=horizon_s, block=BLOCK, rerendered_tail=tail)
    clock = 0.0
    for batch in batches:
        events, inferred, owner = [], {}, {}
        for calls in batch:
            for c in calls:
                heapq.heappush(events, (clock + c.t, 0, id(c), c))
        end = clock
        while events:
            now, kind, _, c = heapq.heappop(events)
            ids = Tokens(c, shared)
            if kind == 0:
                got = index.infer("tenant", hashes_of(c, shared), ids, now, f"anon-{c.session}-{c.index}")
                inferred[id(c)] = got.session_id
                owner.setdefault(got.session_id, c.session)
                stats["calls"] += 1
                if owner[got.session_id] != c.session:
                    stats["merged into another session"] += 1
                if got.kind == "forked" and owner.get(got.parent) != c.session:
                    stats["merged: forked off another session's turn"] += 1
                if c.index > 0:
                    stats["continuations"] += 1
                    prev = batch_prev(c, batch)
                    if got.session_id == inferred.get(id(prev)):
                        stats["attributed to their own session"] += 1
                    else:
                        stats[f"not attributed: {why(c, prev, got.kind, horizon_s, tail)}"] += 1
                done = now + max(c.api_time, 0.01)
                heapq.heappush(events, (done, 1, id(c), c))
            else:
                answer = [ids.at(p) for p in range(len(ids), len(ids) + ANSWER_TOKENS)]
                index.record("tenant", inferred[id(c)], hashes_of(c, shared), ids, answer, "", now)
                end = max(end, now)
        clock = end + horizon_s + 1  # the next batch starts after this one's turns expired
    return stats


def batch_prev(c: Call, batch) -> Call:
    for calls in batch:
        if calls[0].session == c.session and calls[c.index].index == c.index and calls[c.index] is c:
            return calls[c.index - 1]
    raise AssertionError("a call outside its batch")


def why(c: Call, prev: Call, kind: str, horizon_s: float, tail: int) -> str:
    """What the call shares with its predecessor (the truth, for the table only)."""
    same = next((k for k, (a, b) in enumerate(zip(prev.hashes, c.hashes)) if a != b), min(len(prev.hashes), len(c.hashes)))
    lost = len(prev.hashes) - same
    if lost and same <= c.system_blocks + 1:
        return ("only the system prompt and tools repeated, the context shrank (compaction)"
                if c.tokens < 0.8 * prev.tokens else
                "only the system prompt and tools repeated, history re-rendered from its start")
    if lost * BLOCK > max(tail, 2048) or same < 0.9 * len(prev.hashes):
        return "more than the system prompt repeated, history edited before its tail"
    if lost and c.index == 1:
        return "the previous prompt but a re-rendered tail, no earlier turn to repeat whole (2nd call)"
    if lost * BLOCK > tail:
        return f"the previous prompt but a re-rendered tail longer than {tail} tokens"
    if c.t - (prev.t + prev.api_time) > horizon_s:
        return "the previous turn expired (gap past the horizon)"
    if c.t < prev.t + prev.api_time:
        return "sent before the previous call was answered (parallel calls)"
    if lost and kind == "new":
        return "the previous prompt but a re-rendered tail, no earlier turn repeated whole with its answer (rewrites in a row)"
    return f"other ({'re-rendered tail' if lost else 'whole prompt'}, {kind})"


def read_batches(path: str, batch: int, limit: int):
    with lzma.open(path, "rt") as f:
        group: list[list[Call]] = []
        for n, line in enumerate(f):
            if limit and n >= limit:
                break
            group += sessions_of(json.loads(line), n)
            if len(group) >= batch:
                yield group
                group = []
        if group:
            yield group


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="/work/shared/traces/weka_cc_traces.jsonl.xz")
    p.add_argument("--batch", type=int, default=32, help="sessions live at once in the tenant")
    p.add_argument("--limit", type=int, default=0, help="traces to read (0: all)")
    p.add_argument("--horizon-s", type=float, default=HORIZON_S)
    p.add_argument("--rerendered-tail", type=int, default=RERENDERED_TAIL_TOKENS,
                   help="tokens at the end of a session's newest prompt a continuation may rewrite")
    p.add_argument("--recorded-only", action="store_true", help="skip the 16K shared system prompt variant")
    p.add_argument("--out", default="results/session_attribution.md")
    args = p.parse_args()
    rows = []
    for shared in (0, SHARED_BLOCKS)[:1 if args.recorded_only else 2]:
        t0 = time.perf_counter()
        stats = run(read_batches(args.trace, args.batch, args.limit), shared, args.horizon_s, args.rerendered_tail)
        rows.append((shared, stats, time.perf_counter() - t0))
        print(("16K shared system prompt" if shared else "as recorded"), dict(stats))
    lines = ["# Session inference on the WEKA Claude Code traces, ids stripped", "",
             f"`python bench/session_attribution.py --batch {args.batch}"
             f"{f' --limit {args.limit}' if args.limit else ''}` (horizon {args.horizon_s:.0f} s; "
             f"{args.batch} sessions live at once in one tenant; sub-agents are sessions of their own).", ""]
    for shared, stats, secs in rows:
        cont = stats["continuations"]
        lines += [f"## {'every prompt after a shared 16K-token system prompt' if shared else 'as recorded'}", "",
                  "| | calls | share |", "|---|---:|---:|",
                  f"| calls | {stats['calls']:,} | |", f"| continuations (a session's call after its first) | {cont:,} | |"]
        for key, n in sorted(stats.items()):
            if key.startswith(("attributed", "not attributed", "merged")):
                base = stats["calls"] if key.startswith("merged") else cont
                lines.append(f"| {key} | {n:,} | {100 * n / max(1, base):.2f} % |")
        if not stats["merged into another session"]:
            lines.append("| merged into another session | 0 | 0.00 % |")
        bare = sum(n for key, n in stats.items() if key.startswith(SYSTEM_ONLY))
        lines += ["", f"Bound: {bare:,} continuations ({100 * bare / max(1, cont):.2f} %) repeat nothing of their "
                  "predecessor but the system prompt and tools (the hashes are chained: nothing past the first "
                  "difference can be compared), so a rule that never merges on a shared system prompt attributes "
                  f"at most {100 * (cont - bare) / max(1, cont):.2f} %.", "", f"({secs:.0f} s)", ""]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
