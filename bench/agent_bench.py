"""Instance-agent mechanism benchmark on the torch engine (not a test).

    python bench/agent_bench.py [--device cuda] [--out results/agent_bench.md] [--quick]

1. Return latency (TTFT of a session's returning call) with its prefix on device, restored
   from HKVR (host), or recomputed, at 1K / 4K / 16K prefix tokens on qwen3-tiny; ratios
   are computed within the same run.
2. Model switch time by path (d2d_full / d2d_partial / host_only) and by model, with bytes
   moved and the P1-P5 phase split.
Writes a Markdown report and one PNG next to it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from talaria.services.instance_agent.engine import Sequence, TorchEngine  # noqa: E402

MODEL = "qwen3-tiny"
OTHER = "gpt2-tiny"
ALL = ["qwen3-tiny", "qwen3-moe-tiny", "gpt2-tiny"]


def prompt_of(n: int, salt: int) -> list[int]:
    return [256] + [(salt * 131 + i * 7 + (i // 97)) % 256 for i in range(n - 1)]


def return_latency(data: Path, device: str, n: int, source: str, reps: int) -> tuple[float, int, str]:
    """Median TTFT of the return call; (seconds, cached tokens, kv_source seen)."""
    eng = TorchEngine(data, [MODEL, OTHER], device=device, kv_pages=max(64, n // 16 + 96),
                      host_kv_pages=max(256, 2 * (n // 16 + 64)), hkvr=source != "recompute",
                      staging=False)
    times, cached, seen = [], 0, ""
    try:
        for r in range(reps):
            sid = f"s{r}"
            first_prompt = prompt_of(n, r)
            first = eng.generate(Sequence(f"a{r}", sid, MODEL, first_prompt, 2))
            if eng.hkvr is not None:
                eng.hkvr.drain(MODEL)  # the tool gap: the call's D2H checkpoint completes meanwhile
            if source != "device":
                eng.switch_to(OTHER)  # forced switch: the device KV of MODEL is released
                eng.switch_to(MODEL)
            ret = first_prompt + first.token_ids + prompt_of(17, r + 1)[1:]
            res = eng.generate(Sequence(f"b{r}", sid, MODEL, ret, 1))
            times.append(res.ttft_s)
            cached, seen = res.cached_tokens, res.kv_source
            eng.switch_to(OTHER)  # start the next rep from a clean device pool
            eng.switch_to(MODEL)
    finally:
        eng.close()
    return statistics.median(times), cached, seen


def switch_paths(data: Path, device: str, reps: int) -> list[dict]:
    """For each target model: host_only, d2d_full and d2d_partial switches into it."""
    rows = []
    for target in ALL:
        src = MODEL if target != MODEL else OTHER
        for path in ("host_only", "d2d_full", "d2d_partial"):
            eng = TorchEngine(data, ALL, device=device, kv_pages=320, staging=True, auto_stage=False,
                              stage_chunk_bytes=512 * 1024, hkvr=True)
            recs = []
            try:
                for r in range(reps):
                    eng.switch_to(src)
                    if path != "host_only":
                        eng.stage(target, wait=True)
                    if path == "d2d_partial":
                        _dirty_tail(eng, r)
                    recs.append(eng.switch_to(target))
                    eng.switch_to(src if src != target else OTHER)
            finally:
                eng.close()
            recs = [x for x in recs if x.path == path] or recs
            rows.append(_summarise(target, path, recs))
    return rows


def _dirty_tail(eng: TorchEngine, r: int) -> None:
    """A long call whose low-first pages climb into the staged tail, dirtying chunks."""
    pb = eng.page_bytes(eng.active_model)
    staged_lo = min(c.dst_lo for c in eng.staging.planner.chunks if c.dst_lo >= 0)
    pages = (staged_lo - eng.bump.kv_base) // pb + 24
    n = min(pages * 16 - 8, eng.stats().kv_capacity_tokens - 16, eng.specs[eng.active_model].context_length - 4)
    eng.generate(Sequence(f"fill{r}", f"fill{r}", eng.active_model, prompt_of(n, 99 + r), 1))
    eng.hkvr.drain(eng.active_model)  # keep this call's D2H out of the switch's P1


def _summarise(model: str, path: str, recs) -> dict:
    med = lambda f: statistics.median(f(x) for x in recs)  # noqa: E731
    return {
        "model": model, "path": path, "seen": ",".join(sorted({x.path for x in recs})), "n": len(recs),
        "total_ms": med(lambda x: x.total_s) * 1e3, "p1": med(lambda x: x.save_teardown_s) * 1e3,
        "p2": med(lambda x: x.open_weights_s) * 1e3, "p3": med(lambda x: x.kv_shell_s) * 1e3,
        "p4": med(lambda x: x.runtime_s) * 1e3, "p5": med(lambda x: x.publish_s) * 1e3,
        "d2d": int(med(lambda x: x.bytes_d2d)), "h2d": int(med(lambda x: x.bytes_h2d)),
        "dirty": int(med(lambda x: x.dirty_chunks)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="results/agent_bench.md")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1 keeps timings stable on a shared CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="talaria-bench-"))
    lengths = [256, 1024] if args.quick else [1024, 4096, 16384]
    t0 = time.perf_counter()
    lat = {}
    for n in lengths:
        reps = 1 if args.quick else (3 if n <= 4096 else 2)
        for source in ("device", "host", "recompute"):
            lat[(n, source)] = return_latency(data, args.device, n, source, 1 if source == "recompute" and n > 4096 else reps)
            print(f"{n:>6} {source:<9} ttft={lat[(n, source)][0]*1e3:9.2f} ms  cached={lat[(n, source)][1]}  "
                  f"source={lat[(n, source)][2]}", flush=True)
    sw = switch_paths(data, args.device, 1 if args.quick else 5)
    for row in sw:
        print(f"switch {row['model']:<15} {row['path']:<12} {row['total_ms']:8.2f} ms (seen {row['seen']})", flush=True)
    report(out, args, lengths, lat, sw, time.perf_counter() - t0)


def report(out: Path, args, lengths, lat, sw, wall: float) -> None:
    lines = [
        "# Instance-agent bench (torch engine)", "",
        f"device `{args.device}`, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{'quick' if args.quick else 'full'} run, {wall:.0f} s wall. Model `{MODEL}` "
        "(tiny random weights; absolute numbers reflect this machine, ratios are the point).", "",
        "## Return latency (TTFT of the returning call, median)", "",
        "| prefix tokens | device (ms) | HKVR host restore (ms) | recompute (ms) | recompute / host | host / device |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        d, h, r = (lat[(n, s)][0] * 1e3 for s in ("device", "host", "recompute"))
        lines.append(f"| {n} | {d:.2f} | {h:.2f} | {r:.2f} | {r / h:.1f}x | {h / d:.2f}x |")
    lines += ["", "cached tokens / kv_source seen: " + "; ".join(
        f"{n}/{s}: {lat[(n, s)][1]} ({lat[(n, s)][2]})" for n in lengths for s in ("device", "host", "recompute")), ""]
    lines += [
        "## Switch time by path (median of the runs; phases P1-P5 in ms)", "",
        "| into model | path | seen | total ms | P1 save | P2 open | P3 kv shell | P4 runtime | P5 publish | D2D bytes | H2D bytes | dirty chunks |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in sw:
        lines.append(f"| {w['model']} | {w['path']} | {w['seen']} | {w['total_ms']:.2f} | {w['p1']:.2f} | {w['p2']:.2f} | "
                     f"{w['p3']:.3f} | {w['p4']:.3f} | {w['p5']:.3f} | {w['d2d']:,} | {w['h2d']:,} | {w['dirty']} |")
    png = out.with_suffix(".png")
    _plot(png, lengths, lat, sw)
    lines += ["", f"![bench]({png.name})", ""]
    out.write_text("\n".join(lines))
    print(f"wrote {out} and {png}")


def _plot(png: Path, lengths, lat, sw) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.27
    for i, s in enumerate(("device", "host", "recompute")):
        a.bar([j + (i - 1) * width for j in range(len(lengths))], [lat[(n, s)][0] * 1e3 for n in lengths], width, label=s)
    a.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    a.set_yscale("log")
    a.set_xlabel("prefix tokens")
    a.set_ylabel("return TTFT (ms, log)")
    a.legend()
    models = sorted({w["model"] for w in sw})
    paths = ["d2d_full", "d2d_partial", "host_only"]
    for i, p in enumerate(paths):
        vals = [next((w["total_ms"] for w in sw if w["model"] == m and w["path"] == p), 0) for m in models]
        b.bar([j + (i - 1) * width for j in range(len(models))], vals, width, label=p)
    b.set_xticks(range(len(models)), models)
    b.set_ylabel("switch time (ms)")
    b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
