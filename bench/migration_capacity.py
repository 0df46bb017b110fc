"""KV migration on the capacity cases (issue 40 ask 5): talaria vs `talaria-no-migrate` at the
instance counts results/capacity.md found.

    python bench/migration_capacity.py [--seeds 1] [--out results/migration.md] [--workers 2]

For each trace of bench/capacity.py's CASES (regenerated, seed 0, as `capacity.py all` makes
them) and each instance count that the saved capacity runs (bench/data/capacity/case*.json)
name for it (talaria's answer and the best peer's), both configurations run the trace once at
that count, as `sim capacity` runs a deployment (capacity.Runner, no early stop), with the gap model's seeds 0..N-1: returns that recomputed
their context (each a move or a loss), migrations, SCT p50 / p95 of talaria over the ablation
(the baseline, the same sessions in the same run; geometric mean over seeds), and per point a 95 %
paired-bootstrap interval of each pooled percentile ratio (bench/paired.py): talaria is established
slower there only if it lies above 1.00. Replaces the generated part of the "## Simulator: capacity
cases" section of --out, up to its verdict line (the reading below it stays).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from capacity import CASES, write_trace  # noqa: E402

from talaria.sim.capacity import OURS, Runner, load_inputs  # noqa: E402

from bench.paired import VERDICT, cell as ci_cell, paired_ratio, run_ratio, verdict  # noqa: E402
from bench.run_record import replace_generated  # noqa: E402

ON, OFF = "talaria", "talaria-no-migrate"
SECTION = "## Simulator: capacity cases"
SAVED = ROOT / "bench" / "data" / "capacity"


def points() -> list[tuple[str, int, str, int]]:
    """(trace file, models, gaps, instances) of every count the saved capacity runs name."""
    out: dict[tuple, None] = {}
    for k, (trace, models, _shape, gaps, _slo) in enumerate(CASES):
        r = json.loads((SAVED / f"case{k}.json").read_text())
        pol = r["policies"]
        peers = [e["instances"] for n, e in pol.items() if n != OURS and e["instances"] is not None]
        for n in (pol[OURS]["instances"], min(peers) if peers else None):
            if n is not None:
                out[(trace, models, gaps, n)] = None
    return list(out)


def _task(args):
    folder, trace, models, gaps, n, config, seed = args
    sessions, server, gap_model = load_inputs(str(Path(folder) / trace), "paper-tp8", str(models), gaps, seed)
    p = Runner(sessions, server, gap_model, math.inf)(config, n)
    return trace, n, config, seed, p


def gmean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=1, help="gap model seeds 0..N-1")
    ap.add_argument("--out", type=Path, default=Path("results/migration.md"))
    ap.add_argument("--print-only", action="store_true")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="migration-capacity-")
    for trace, models, _gaps, _n in points():  # written once, before the workers read them (seed 0)
        shape = next(c[2] for c in CASES if c[0] == trace)
        if not (Path(folder) / trace).exists():
            write_trace(Path(folder) / trace, models, shape)
    seeds = range(max(1, args.seeds))
    tasks = [(folder, t, m, g, n, c, sd) for t, m, g, n in points() for c in (ON, OFF) for sd in seeds]
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        res = {(t, n, c, sd): p for t, n, c, sd, p in pool.map(_task, tasks)}
    lines = ["| trace | instances | recomputes (no-migrate) | recomputes (talaria) | migrations | "
             "SCT p50 x | SCT p95 x | pooled p50 x [95 % CI] | pooled p95 x [95 % CI] |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    off_total = on_total = mig_total = 0
    worst = 0.0
    found: dict[str, list[str]] = {"slower": [], "faster": [], "run_slower": []}
    for t, _m, _g, n in points():
        on = [res[(t, n, ON, sd)] for sd in seeds]
        off = [res[(t, n, OFF, sd)] for sd in seeds]
        r_off, r_on, mig = (sum(p.recomputes for p in off), sum(p.recomputes for p in on),
                            sum(p.migrations for p in on))
        off_total, on_total, mig_total = off_total + r_off, on_total + r_on, mig_total + mig
        p50 = gmean([a.sct_p50 / b.sct_p50 for a, b in zip(on, off)])
        p95 = gmean([a.sct_p95 / b.sct_p95 for a, b in zip(on, off)])
        worst = max(worst, p50, p95)
        strata = [[(a.scts[sid], b.scts[sid]) for sid in b.scts] for a, b in zip(on, off)]
        ci = []
        for q, label in ((0.50, "p50"), (0.95, "p95")):
            point, lo, hi = paired_ratio(strata, q)
            ci.append(ci_cell(lo, point, hi))
            v = verdict(lo, hi)
            if v in ("slower", "faster"):
                found[v].append(f"{t} at {n} {label} {point:.3f} [{lo:.3f}, {hi:.3f}]")
            _, lo, hi = run_ratio(strata, q)
            if verdict(lo, hi) == "slower":
                found["run_slower"].append(f"{t} at {n} {label} [{lo:.3f}, {hi:.3f}]")
        lines.append(f"| {t} | {n} | {r_off} | {r_on} | {mig} | {p50:.3f} | {p95:.3f} | {ci[0]} | {ci[1]} |")
    drop = 1 - on_total / off_total if off_total else float("nan")
    body = [SECTION, "", f"`python bench/migration_capacity.py --seeds {len(seeds)}` "
            f"({time.perf_counter() - started:.0f} s, gap seeds 0..{len(seeds) - 1}). "
            "The capacity cases' traces (bench/capacity.py CASES, seed 0) at talaria's and the best peer's "
            "instance counts of bench/data/capacity/case*.json; `talaria-no-migrate` is the baseline on the "
            f"same sessions. Recomputes after a move: {off_total} -> {on_total} ({drop:.0%} fewer), "
            f"{mig_total} migrations; worst SCT ratio {worst:.3f}. The pooled columns: each percentile over "
            "every seed's sessions, talaria over the ablation, with a 95 % paired-bootstrap interval (bench/paired.py; a trace whose gap seeds repeat one run, as "
            "recorded gaps do, counts that run once).",
            "", *lines, "",
            f"{VERDICT} established slower (95 % interval above 1.00) in {len(found['slower'])} of "
            f"{2 * len(points())} cell-percentiles: {'; '.join(found['slower']) or 'none'}.** Established faster in "
            f"{len(found['faster'])}: {'; '.join(found['faster']) or 'none'}. Drawing whole runs (gap seeds) instead "
            f"of sessions (bench/paired.run_ratio; none for a trace with one distinct run): established slower in "
            f"{len(found['run_slower'])}: {'; '.join(found['run_slower']) or 'none'}.", ""]
    print("\n".join(body))
    if args.print_only:
        return 0
    args.out.write_text(replace_generated(args.out.read_text(), SECTION, "\n".join(body), VERDICT,
                                          after="## Simulator"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
