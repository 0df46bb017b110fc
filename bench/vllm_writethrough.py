"""What the Talaria KV connector's write-through costs vLLM per step (not a test).

    /work/vllm-venv/bin/python bench/vllm_writethrough.py [--tokens 1024 4096] [--decode 128] [--reps 3]
        [--out results/vllm_engine.md]

The connector (engine/vllm_connector.py) copies every vLLM block to the host pages when it
fills, after the step's forward, so a session's KV is already on the host when vLLM evicts it
or a switch drops it. The alternative, saving only then, has no hook in vLLM: its block pool
reuses an evicted block inside the step that allocates it, and a level-1 sleep discards the
KV at once. So the question is what writing every block costs. Two engines serving
qwen3-tiny (the worst case here: the least compute per byte of KV), one with the connector
and one without, run the same calls alternately in one process: a fresh prompt of N tokens
(prefill, timed to the first token) and `--decode` generated tokens (decode tokens/s; one
block fills per 128). Greedy tokens must be equal with and without the connector.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vllm_return import A, prompt_of  # noqa: E402


def one_call(engine, call_id: str, prompt: list[int], decode: int) -> tuple[float, float, list[int]]:
    """(prefill s, decode tok/s, tokens) of one call under its own scope (no prefix reuse)."""
    from talaria.services.instance_agent.engine import GenRequest

    t0 = time.perf_counter()
    step = engine.prefill([GenRequest(call_id, call_id, A, prompt, decode, kv_scope=call_id)])[0]
    t1 = time.perf_counter()
    made = 0
    while not step.finished:
        step = engine.decode([call_id])[0]
        made += 1
    t2 = time.perf_counter()
    res = engine.finish(call_id)
    assert res.cached_tokens == 0 and res.host_restored_tokens == 0, "a fresh scope reused KV"
    return t1 - t0, made / (t2 - t1) if made else 0.0, res.token_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from talaria.services.instance_agent.engine.vllm_engine import VllmEngine

    data = Path(tempfile.mkdtemp(prefix="vllm-writethrough-"))
    longest = max(args.tokens) + args.decode + 16
    engines = {}
    try:
        for name, hkvr in (("connector", True), ("none", False)):
            t0 = time.perf_counter()
            engines[name] = VllmEngine(data, [A], hkvr=hkvr, max_model_len=longest,
                                       host_kv_bytes=2 * longest * _kv_token_bytes() + (64 << 20))
            print(f"{name}: engine up in {time.perf_counter() - t0:.0f} s", flush=True)
        for name, eng in engines.items():  # first-call overheads out of the way
            one_call(eng, f"warm-{name}", prompt_of(300, 99), 4)
        block = engines["connector"].capabilities.kv_block_tokens
        rows = []
        for n in args.tokens:
            got: dict[str, list] = {"connector": [], "none": []}
            same = []
            for r in range(args.reps):
                prompt = prompt_of(n, 5000 + 10 * n + r)
                order = ("connector", "none") if r % 2 == 0 else ("none", "connector")
                tokens = {}
                for name in order:
                    pre, dec, toks = one_call(engines[name], f"{name}-{n}-{r}", prompt, args.decode)
                    got[name].append((pre, dec))
                    tokens[name] = toks
                same.append(tokens["connector"] == tokens["none"])
            on_pre = statistics.median(x[0] for x in got["connector"])
            off_pre = statistics.median(x[0] for x in got["none"])
            on_dec = statistics.median(x[1] for x in got["connector"])
            off_dec = statistics.median(x[1] for x in got["none"])
            blocks = n // block
            rows.append((n, blocks, on_pre, off_pre, on_dec, off_dec, all(same)))
            print(rows[-1], flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    page = _kv_token_bytes() * block
    lines = [f"qwen3-tiny, float32, vLLM block {block} tokens ({page / 2**20:.2f} MiB of KV per block, all "
             f"layers), {args.decode} generated tokens per call, median of {args.reps} (calls alternate "
             "between the two engines).", "",
             "| prompt tokens | blocks written | prefill s, connector | prefill s, none | prefill overhead | "
             "write cost per block ms | decode tok/s, connector | decode tok/s, none | decode overhead | "
             "greedy tokens equal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n, blocks, on_pre, off_pre, on_dec, off_dec, same in rows:
        lines.append(f"| {n} | {blocks} | {on_pre:.3f} | {off_pre:.3f} | {100 * (on_pre / off_pre - 1):+.1f}% | "
                     f"{1000 * (on_pre - off_pre) / max(blocks, 1):.2f} | {on_dec:.1f} | {off_dec:.1f} | "
                     f"{100 * (off_dec / on_dec - 1):+.1f}% | {same} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n### Write-through run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
                    f"`{' '.join(sys.argv)}`\n\n{text}")


def _kv_token_bytes() -> int:
    from talaria.shared.catalog import CATALOG

    s = CATALOG[A]
    return s.layers * 2 * s.kv_heads * s.head_dim * 4


if __name__ == "__main__":
    main()
