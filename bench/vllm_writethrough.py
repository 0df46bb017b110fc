"""What the Talaria KV connector's write-through costs vLLM per step (not a test).

    /work/vllm-venv/bin/python bench/vllm_writethrough.py [--tokens 1024 4096] [--decode 128] [--reps 3]
        [--out results/vllm_engine.md]

The connector (engine/vllm_connector.py) copies every vLLM block to the host pages when it
fills, after the step's forward, so a session's KV is already on the host when vLLM evicts it
or a switch drops it. The alternative, saving only then, has no hook in vLLM: its block pool
reuses an evicted block inside the step that allocates it, and a level-1 sleep discards the
KV at once. So the question is what writing every block costs. Four engines serving
qwen3-tiny (the worst case here: the least compute per byte of KV) run the same calls in
turn, in one process, each adding one thing to the one before:
  none        no connector, vLLM's default (asynchronous) scheduling
  sync        no connector, synchronous scheduling (what the connector needs)
  no-writes   the connector with no host pages: its hooks run every step, it copies nothing
              (what any connector costs, one that saved only on eviction or switch included)
  connector   the connector writing every block through
A call: a fresh prompt of N tokens (prefill, timed to the first token) and `--decode`
generated tokens (decode tokens/s; one block fills per 128). Greedy tokens must be equal on
all four.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run_record import publish  # noqa: E402
from bench.vllm_return import A, prompt_of  # noqa: E402


def one_call(engine, call_id: str, prompt: list[int], decode: int) -> tuple[float, float, list[int]]:
    """(prefill s, decode tok/s, tokens) of one call under its own scope (no prefix reuse)."""
    from talaria.services.instance_agent.engine import Sequence

    t0 = time.perf_counter()
    seq = Sequence(call_id, call_id, A, prompt, decode, kv_scope=call_id)
    step = engine.prefill([seq])[0]
    t1 = time.perf_counter()
    made = 0
    while not step.finished:
        step = engine.decode([seq])[0]
        made += 1
    t2 = time.perf_counter()
    res = engine.finish(seq)
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
        pages = 2 * longest * _kv_token_bytes() + (64 << 20)
        for name, hkvr, sync, host in (("none", False, False, 0), ("sync", False, True, 0),
                                       ("no-writes", True, True, 1), ("connector", True, True, pages)):
            t0 = time.perf_counter()
            engines[name] = VllmEngine(data, [A], hkvr=hkvr, max_model_len=longest,
                                       async_scheduling=False if sync else None, host_kv_bytes=host or None)
            print(f"{name}: engine up in {time.perf_counter() - t0:.0f} s", flush=True)
        for name, eng in engines.items():  # first-call overheads out of the way
            one_call(eng, f"warm-{name}", prompt_of(300, 99), 4)
        block = engines["connector"].capabilities.kv_block_tokens
        rows = []
        for n in args.tokens:
            got: dict[str, list] = {name: [] for name in engines}
            same = []
            for r in range(args.reps):
                prompt = prompt_of(n, 5000 + 10 * n + r)
                names = list(engines)
                tokens = {}
                for name in names[r % len(names):] + names[:r % len(names)]:  # each engine first in turn
                    pre, dec, toks = one_call(engines[name], f"{name}-{n}-{r}", prompt, args.decode)
                    got[name].append((pre, dec))
                    tokens[name] = toks
                same.append(len({tuple(t) for t in tokens.values()}) == 1)
            # best of the repetitions (least prefill time, most decode tok/s): other jobs on the
            # shared box only ever add time, so the best run is the closest to the engine's own cost
            med = {name: (min(x[0] for x in v), max(x[1] for x in v)) for name, v in got.items()}
            rows.append((n, n // block, med, all(same)))
            print(rows[-1], flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    page = _kv_token_bytes() * block
    lines = [f"qwen3-tiny, float32, vLLM block {block} tokens ({page / 2**20:.2f} MiB of KV per block, all "
             f"layers), {args.decode} generated tokens per call, best of {args.reps} (each engine first "
             "in turn).", "",
             "| prompt tokens | blocks written | prefill s: none / sync / no-writes / connector | "
             "decode tok/s: none / sync / no-writes / connector | writing (connector vs no-writes): prefill, "
             "decode | a connector configured (no-writes vs sync): prefill, decode | greedy tokens equal |",
             "|---|---|---|---|---|---|---|"]
    for n, blocks, med, same in rows:
        pre = [med[k][0] for k in ("none", "sync", "no-writes", "connector")]
        dec = [med[k][1] for k in ("none", "sync", "no-writes", "connector")]
        lines.append(f"| {n} | {blocks} | {' / '.join(f'{x:.3f}' for x in pre)} | "
                     f"{' / '.join(f'{x:.1f}' for x in dec)} | "
                     f"{100 * (pre[3] / pre[2] - 1):+.0f}%, {100 * (dec[2] / dec[3] - 1):+.0f}% | "
                     f"{100 * (pre[2] / pre[1] - 1):+.0f}%, {100 * (dec[1] / dec[2] - 1):+.0f}% | {same} |")
    text = "\n".join(lines) + "\n"
    publish(text, args.out, "Write-through run")


def _kv_token_bytes() -> int:
    from talaria.shared.catalog import BUILTIN_MODELS

    s = BUILTIN_MODELS[A]
    return s.layers * 2 * s.kv_heads * s.head_dim * 4


if __name__ == "__main__":
    main()
