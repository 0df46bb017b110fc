"""Per-call cost of session inference at the gateway (not a test).

    python bench/session_inference.py [--out results/session_inference.md] [--reps 200]

A call that names no session is matched against its tenant's live turns with the block
hashes prepare() already computed for it, so the cost measured here is what inference adds:
the lookup (SessionIndex.infer, then release to measure again), and after the answer the
turn's record with its answer head tokenised (SessionInferrer.answer_ids). Prompts of 1K,
25K and 100K tokens; the tenant holds 64 live sessions (a busy tenant) or its full bound of
turns at spread lengths (the worst case for a call that continues nothing); every prompt opens with a shared system prompt. Hashing the
prompt afresh (block_hashes) is timed alongside: that is what reuse saves.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from talaria.services.gateway.session_inference import MAX_TURNS  # noqa: E402
from talaria.services.gateway.session_inferrer import SessionInferrer  # noqa: E402
from talaria.shared.catalog import BUILTIN_MODELS  # noqa: E402
from talaria.shared.tokenizer import block_hashes  # noqa: E402

SIZES = (1_000, 25_000, 100_000)
SYSTEM = 2_000  # tokens every session of the tenant starts with
TOOL_RESULT = 300  # tokens a continuation adds after the answer
ANSWER = "I will run the failing test first and read its traceback before I edit parser.py."


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4352) for _ in range(n)]


def timed_us(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(samples)


def scenario(size: int, full: bool, reps: int) -> dict[str, float]:
    rng = random.Random(size)
    inferrer = SessionInferrer(BUILTIN_MODELS)
    index = inferrer.index
    system = tokens(rng, min(SYSTEM, size // 2))
    answer = inferrer.answer_ids("qwen3-tiny", ANSWER)
    live = MAX_TURNS if full else 64
    mine = None
    for s in range(live):  # each turn at its own length: the lookup cannot skip any of them
        # Every prompt is the system prompt and its own turns, at a length of its own.
        own = size - len(system) if s == 0 else (rng.randrange(16, size - len(system)) if full
                                                  else size - len(system) - rng.randrange(0, 64))
        ids = system + tokens(rng, own)
        index.record("t", f"s{s}", block_hashes(ids), ids, answer, "", 0.0)
        if s == 0:
            mine = ids
    nxt = mine + answer + tokens(rng, TOOL_RESULT)
    nxt_hashes = block_hashes(nxt)
    fresh = system + tokens(rng, size - len(system))
    fresh_hashes = block_hashes(fresh)
    now, turns = 1.0, index.turns("t")

    def cont():
        got = index.infer("t", nxt_hashes, nxt, now, "anon-x")
        assert got.kind == "continued"
        index.release("t", got)

    def new():
        assert index.infer("t", fresh_hashes, fresh, now, "anon-y").kind == "new"

    def record():  # a new turn per rep: the bound keeps the table at its size
        index.record("t", "s0", nxt_hashes, nxt, inferrer.answer_ids("qwen3-tiny", ANSWER), "", now)

    return {"continue_us": timed_us(cont, reps), "new_us": timed_us(new, reps),
            "record_us": timed_us(record, reps), "hash_us": timed_us(lambda: block_hashes(nxt), max(5, reps // 20)),
            "turns": turns}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/session_inference.md")
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    rows = []
    for full in (False, True):
        for size in SIZES:
            r = scenario(size, full, args.reps)
            rows.append((size, full, r))
            print(f"{size:>7} tokens, {r['turns']:>5} turns: continue {r['continue_us']:.1f} us, "
                  f"new {r['new_us']:.1f} us, record {r['record_us']:.1f} us, hash afresh {r['hash_us']:.0f} us")
    lines = ["# Session inference: per-call cost at the gateway", "",
             f"`python bench/session_inference.py` (median of {args.reps} calls each, on the shared 2-core dev box "
             f"at load average {os.getloadavg()[0]:.1f}: compare with the last column, hashing the prompt, which "
             "inference does not do; the block hashes are the ones prepare() computed).", "",
             "Per call: the lookup (a continuation, or a new session that matches nothing), then after the answer "
             "its turn's record (answer head tokenised with qwen3-tiny's BPE). Inference adds lookup + record.", "",
             "| prompt tokens | live turns in the tenant | lookup, continuation (us) | lookup, new session (us) "
             "| record after the answer (us) | lookup + record, worst (us) | hashing the prompt afresh (us) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for size, full, r in rows:
        worst = max(r["continue_us"], r["new_us"]) + r["record_us"]
        lines.append(f"| {size:,} | {r['turns']:,}{' (the bound)' if full else ''} | {r['continue_us']:.1f} | "
                     f"{r['new_us']:.1f} | {r['record_us']:.1f} | {worst:.1f} | {r['hash_us']:,.0f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
