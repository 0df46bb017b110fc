"""KV migration in the simulator (issue 40): talaria vs its `no-migrate` ablation on the matrix cells.

    python bench/migration_sim.py [--seeds 3] [--link-scale 1] [--setup-scale 1] [--out results/migration.md]

Per matrix cell (talaria.sim.matrix.cells(seed), seeds 0..N-1), both configurations on the
same sessions: returns that recomputed their context (kv_source "recompute": every one of
them is a move or a loss, since a return that stayed finds its KV on device or host), the
migrations that replaced them, and SCT p50 / p95 of talaria over the ablation (geometric mean
over seeds; the ablation is the baseline, measured in the same run). --link-scale and
--setup-scale multiply the profile's link bandwidth and setup (ServerProfile.link_*: an
[asm] constant, so its flatness is shown by rerunning at 0.1x and 10x). Replaces the
generated part of the "## Simulator" section of --out, up to its verdict line (the reading
written below it stays; the live TTFT table there is bench/migration_ttft.py's). Per cell, a
95 % paired-bootstrap interval of each pooled percentile ratio (bench/paired.py) says whether
talaria is established slower than the ablation there (the interval above 1.00) or not.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from talaria.sim.cluster import simulate  # noqa: E402
from talaria.sim.matrix import cells, run_config  # noqa: E402
from talaria.sim.metrics import summarise  # noqa: E402

from bench.paired import VERDICT, cell as ci_cell, paired_ratio, run_ratio, verdict  # noqa: E402
from bench.run_record import replace_generated  # noqa: E402

ON, OFF = "talaria", "talaria-no-migrate"
SECTION = "## Simulator"


def _task(args):
    seed, name, policy, link_scale, setup_scale = args
    cell = next(c for c in cells(seed) if c.name == name)
    run, _, sessions, _ = run_config(cell, policy)
    server = replace(run.server, link_bytes_s=run.server.link_bytes_s * link_scale,
                     link_setup_s=run.server.link_setup_s * setup_scale)
    s = summarise(simulate(sessions, replace(run, server=server)))
    kv = s["kv_sources"]
    sct = {e["session"]: math.inf if e["sct"] is None else e["sct"] for e in s["per_session"]}
    return seed, name, policy, kv.get("recompute", 0), kv.get("migrated", 0), s["sct_p50"], s["sct_p95"], sct


def gmean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v))


def pairs(on: list, off: list) -> list[list[tuple[float, float]]]:
    """Per seed, (SCT with, SCT without) of each session: the same sessions in both runs."""
    return [[(a[7][sid], b[7][sid]) for sid in b[7]] for a, b in zip(on, off)]


def table(rows, seeds: int) -> tuple[list[str], dict]:
    names = list(dict.fromkeys(r[1] for r in rows))
    by = {(r[0], r[1], r[2]): r for r in rows}
    out = ["| cell | recomputes (no-migrate) | recomputes (talaria) | migrations | SCT p50 x | SCT p95 x | "
           "pooled p50 x [95 % CI] | pooled p95 x [95 % CI] |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    tot = {"off": 0, "on": 0, "mig": 0, "worst_p50": 0.0, "worst_p95": 0.0, "p50": [], "p95": [],
           "slower": [], "faster": [], "intervals": 0, "run_slower": []}
    for n in names:
        on = [by[(s, n, ON)] for s in range(seeds)]
        off = [by[(s, n, OFF)] for s in range(seeds)]
        r_off, r_on, mig = sum(r[3] for r in off), sum(r[3] for r in on), sum(r[4] for r in on)
        p50 = gmean([a[5] / b[5] for a, b in zip(on, off)])
        p95 = gmean([a[6] / b[6] for a, b in zip(on, off)])
        tot["off"] += r_off
        tot["on"] += r_on
        tot["mig"] += mig
        tot["p50"].append(p50)
        tot["p95"].append(p95)
        ci = []
        for q, label in ((0.50, "p50"), (0.95, "p95")):
            point, lo, hi = paired_ratio(pairs(on, off), q)
            ci.append(ci_cell(lo, point, hi))
            tot["intervals"] += 1
            v = verdict(lo, hi)
            if v in ("slower", "faster"):
                tot[v].append(f"{n} {label} {point:.3f} [{lo:.3f}, {hi:.3f}]")
            _, lo, hi = run_ratio(pairs(on, off), q)
            if verdict(lo, hi) == "slower":
                tot["run_slower"].append(f"{n} {label} [{lo:.3f}, {hi:.3f}]")
        out.append(f"| {n} | {r_off} | {r_on} | {mig} | {p50:.3f} | {p95:.3f} | {ci[0]} | {ci[1]} |")
    tot["worst_p50"], tot["worst_p95"] = max(tot["p50"]), max(tot["p95"])
    out.append(f"| **all cells** | **{tot['off']}** | **{tot['on']}** | **{tot['mig']}** | "
               f"**{gmean(tot['p50']):.3f}** (worst {tot['worst_p50']:.3f}) | "
               f"**{gmean(tot['p95']):.3f}** (worst {tot['worst_p95']:.3f}) | | |")
    return out, tot


def verdict_line(tot: dict) -> str:
    """The cells whose interval lies above 1 (established slower) and below it (faster)."""
    slower = "; ".join(tot["slower"]) if tot["slower"] else "none"
    faster = "; ".join(tot["faster"]) if tot["faster"] else "none"
    return (f"{VERDICT} established slower (95 % interval above 1.00) in {len(tot['slower'])} of "
            f"{tot['intervals']} cell-percentiles: {slower}.** Established faster in {len(tot['faster'])}: "
            f"{faster}. Drawing whole runs (seeds) instead of sessions, which keeps the sessions that shared "
            f"a run's instances together (bench/paired.run_ratio): established slower in {len(tot['run_slower'])}: "
            f"{'; '.join(tot['run_slower']) or 'none'}.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--link-scale", type=float, default=1.0)
    ap.add_argument("--setup-scale", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=Path("results/migration.md"))
    ap.add_argument("--print-only", action="store_true", help="print the table, leave --out alone")
    ap.add_argument("--cells", default="", help="comma-separated cell names (default: all; implies --print-only)")
    args = ap.parse_args()
    if args.seeds < 1 or args.link_scale <= 0 or args.setup_scale < 0:
        ap.error("--seeds >= 1, --link-scale > 0 and --setup-scale >= 0")
    only = set(filter(None, args.cells.split(",")))
    tasks = [(s, c.name, p, args.link_scale, args.setup_scale) for s in range(args.seeds) for c in cells(s)
             for p in (ON, OFF) if not only or c.name in only]
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(_task, tasks))
    lines, tot = table(rows, args.seeds)
    drop = 1 - tot["on"] / tot["off"] if tot["off"] else float("nan")
    cmd = (f"python bench/migration_sim.py --seeds {args.seeds} --link-scale {args.link_scale:g} "
           f"--setup-scale {args.setup_scale:g}")
    body = [f"{SECTION}", "", f"`{cmd}` ({time.perf_counter() - started:.0f} s). Every matrix cell, seeds "
            f"0..{args.seeds - 1}; the `no-migrate` ablation is the baseline, on the same sessions. "
            f"Recomputes after a move: {tot['off']} -> {tot['on']} ({drop:.0%} fewer), {tot['mig']} migrations. "
            "SCT p50 / p95 x: geometric mean over seeds of talaria over the ablation; pooled: each percentile "
            "over every seed's sessions, with a 95 % paired-bootstrap interval (bench/paired.py: sessions drawn "
            "with replacement within each seed, both runs' SCT of a drawn session kept together).",
            "", *lines, "", verdict_line(tot), ""]
    print("\n".join(body))
    if args.print_only or only:
        return 0
    text = args.out.read_text() if args.out.exists() else "# KV migration (issue 40)\n"
    args.out.write_text(replace_generated(text, SECTION, "\n".join(body), VERDICT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
