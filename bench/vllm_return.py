"""A session returning to its model after a switch, on the vllm engine (not a test).

    /work/vllm-venv/bin/python bench/vllm_return.py [--tokens 1024 4096] [--reps 3] [--out results/vllm_engine.md]

One VllmEngine serving qwen3-tiny and gpt2-tiny with `release` switching (a switch drops the
outgoing engine's KV, as a GPU sleep at level 1 does) and the Talaria host KV connector. Per
prefix length and repetition: a session's first call, a switch to the other model and back,
then its return call (the prompt grown by a tool result), timed to its first token:
  connector   the return loads the session's blocks from the host pages (kv_source host)
  recompute   the same return prompt under another tenant scope (`kv_scope`: the salted
              block hashes match nothing), so vLLM recomputes it, in the same engine
  resident    (a second engine set, `resident` switching) the KV never left: device reuse
Greedy parity: the return's tokens with the connector equal the recompute's and a fresh
engine's. Ratios are within one run. Writes a Markdown section to --out (appends a run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run_record import publish  # noqa: E402

A, B = "qwen3-tiny", "gpt2-tiny"


def prompt_of(n: int, salt: int) -> list[int]:
    from talaria.shared.catalog import BUILTIN_MODELS
    from talaria.shared.model_text import text_for

    allowed = [t for t in text_for(BUILTIN_MODELS[A]).allowed_output if t < 4000]
    return [allowed[(salt * 131 + i * 7 + i // 97) % len(allowed)] for i in range(n)]


def timed(engine, call_id: str, session: str, prompt: list[int], n: int = 8, scope: str = ""):
    from talaria.services.instance_agent.engine import Sequence

    t0 = time.perf_counter()
    seq = Sequence(call_id, session, A, prompt, n, kv_scope=scope)
    step = engine.prefill([seq])[0]
    ttft = time.perf_counter() - t0
    while not step.finished:
        step = engine.decode([seq])[0]
    return ttft, engine.finish(seq)


def measure(data: Path, mode: str, sizes: list[int], reps: int) -> dict:
    from talaria.services.instance_agent.engine.vllm_engine import VllmEngine

    t0 = time.perf_counter()
    eng = VllmEngine(data, [A, B], hkvr=True, switch_mode=mode, max_model_len=max(sizes) + 256)
    start_s = time.perf_counter() - t0
    out = {"start_s": start_s, "rows": {}}
    try:
        timed(eng, "warm", "warm", prompt_of(300, 99))  # first-call overheads out of the way
        for n in sizes:
            rows = {"connector" if mode == "release" else "resident": [], "recompute": [], "first": []}
            tokens = {}
            for r in range(reps):
                prompt = prompt_of(n, 1000 * n + r)
                first_s, first = timed(eng, f"f{n}.{r}", f"s{n}.{r}", prompt)
                follow = prompt + first.token_ids + prompt_of(64, 7 + r)
                eng.switch_to(B)
                eng.switch_to(A)
                key = "connector" if mode == "release" else "resident"
                back_s, back = timed(eng, f"b{n}.{r}", f"s{n}.{r}", follow)
                cold_s, cold = timed(eng, f"c{n}.{r}", f"x{n}.{r}", follow, scope=f"other-{r}")
                rows["first"].append(first_s)
                rows[key].append((back_s, back.kv_source, back.cached_tokens, back.host_restored_tokens))
                rows["recompute"].append((cold_s, cold.kv_source, cold.cached_tokens, 0))
                tokens.setdefault("same", []).append(back.token_ids == cold.token_ids)
            out["rows"][n] = (rows, tokens)
    finally:
        eng.close()
    return out


def report(results: dict, sizes: list[int], reps: int) -> str:
    lines = ["| prefix tokens | path | return TTFT (median s) | kv_source | reused tokens | vs recompute | greedy tokens equal |",
             "|---|---|---|---|---|---|---|"]
    for n in sizes:
        for mode, res in results.items():
            rows, tokens = res["rows"][n]
            cold = statistics.median(x[0] for x in rows["recompute"])
            for key in ("connector", "resident"):
                if key not in rows:
                    continue
                warm = statistics.median(x[0] for x in rows[key])
                src = "/".join(sorted({x[1] for x in rows[key]}))
                reused = statistics.median(max(x[2], x[3]) for x in rows[key])
                lines.append(f"| {n} | {key} ({mode}) | {warm:.3f} | {src} | {reused:.0f} | "
                             f"{cold / warm:.1f}x faster | {all(tokens['same'])} |")
            lines.append(f"| {n} | recompute ({mode} run) | {cold:.3f} | "
                         f"{'/'.join(sorted({x[1] for x in rows['recompute']}))} | 0 | 1.0x | - |")
    starts = ", ".join(f"{m}: {r['start_s']:.0f} s" for m, r in results.items())
    return "\n".join(lines) + f"\n\nEngine set start (two models): {starts}; {reps} repetitions per row.\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["release", "resident"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="vllm-return-"))
    results = {m: measure(data, m, args.tokens, args.reps) for m in args.modes}
    text = report(results, args.tokens, args.reps)
    publish(text, args.out, "Run")


if __name__ == "__main__":
    main()
