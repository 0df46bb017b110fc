"""The workload matrix over several workload seeds: how robust the win table is (not a test).

    python bench/matrix_seeds.py [--seeds 8] [--workers 2] [--out results/matrix_seeds.md] [--cells SUBSTR,...]

Each generated matrix cell has ~20 sessions, so its SCT p95 is one session's luck and a
single seed's win table says little about one cell. This runs the generated cells and the
router-testbed cell (the fixed replay has one instance: every policy is the same there) for
seeds 0..N-1 (`talaria.sim.matrix.cells(seed)`: each seed draws new sessions, arrivals and
gaps for every cell), every baseline and `talaria`, and reports per seed and overall: cells
where talaria's SCT p50 or p95 is more than 2 % behind the best baseline of that cell and
seed, and the geometric means of talaria / best baseline per cell and of talaria / each
baseline. Seed 0 is the published matrix (results/matrix.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from talaria.sim.matrix import BASELINES, OURS, PEER_SPLITS, cells, run_one  # noqa: E402

SLACK = 1.02  # the "no worse than the best baseline by more than 2 %"


def _task(args: tuple[int, str, str, str]) -> tuple[int, str, str, float, float]:
    seed, name, policy, peer_split = args
    cell = next(c for c in cells(seed) if c.name == name)
    r = run_one(cell, policy, peer_split)
    return seed, name, policy, r["sct_p50"], r["sct_p95"]


def gmean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/matrix_seeds.md"))
    ap.add_argument("--json", type=Path, default=None, help="also write every (seed, cell, policy) SCT p50/p95 here")
    ap.add_argument("--ours", default=OURS, help="talaria variants to compare with the peers, comma-separated "
                    "(e.g. talaria,talaria-forecast-pools: online hot pools vs the peers' forecast)")
    ap.add_argument("--cells", default="", help="only cells whose name contains one of these (comma-separated)")
    ap.add_argument("--peer-split", choices=PEER_SPLITS, default="exact",
                    help="size the peers' pools on the run's own demand (exact) or on another draw of the "
                         "same workload (history: last week's traffic); talaria.sim.matrix.peer_demand")
    args = ap.parse_args()
    variants = tuple(v for v in args.ours.split(",") if v)
    policies = (*BASELINES, *variants)
    only = [c for c in args.cells.split(",") if c]
    tasks = [(seed, c.name, p, args.peer_split) for seed in range(args.seeds) for c in cells(seed)
             if c.weka != "fixed-replay" and (not only or any(o in c.name for o in only)) for p in policies]
    started = time.perf_counter()
    res: dict[tuple[int, str], dict[str, tuple[float, float]]] = defaultdict(dict)
    with ProcessPoolExecutor(args.workers) as pool:
        for k, (seed, name, policy, p50, p95) in enumerate(pool.map(_task, tasks, chunksize=4), 1):
            res[(seed, name)][policy] = (p50, p95)
            if k % 50 == 0:
                print(f"  {k}/{len(tasks)}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - started
    if args.json is not None:
        args.json.write_text(json.dumps([{"seed": seed, "cell": name, "sct": got} for (seed, name), got in
                                         sorted(res.items())], indent=1))
    rows = []
    for variant in variants:
        vrows, worst = _rows(res, variant)
        rows += [f"| {variant}, {r}" for r in vrows]
        if variant == variants[0]:
            first_worst = worst
    worst = first_worst
    text = "\n".join([
        "# Workload matrix over workload seeds",
        "",
        f"`python bench/matrix_seeds.py --seeds {args.seeds}" + (f" --ours {args.ours}" if args.ours != OURS else "")
        + (f" --cells {args.cells}" if only else "")
        + (f" --peer-split {args.peer_split}" if args.peer_split != "exact" else "")
        + f"` ({len(tasks)} runs, {wall:.0f} s wall with "
        f"{args.workers} processes on the shared 2-core machine). Generated cells and the router-testbed "
        "cell of talaria.sim.matrix, each seed drawing new sessions, arrivals and gaps; ratios are "
        "talaria / best baseline of the same cell and seed (below 1: talaria faster). Seed 0 is "
        "results/matrix.md.",
        "",
        "| variant, seeds | cells more than 2 % behind (p50 or p95) | SCT p50 vs best per cell (geomean) "
        "| SCT p95 vs best per cell (geomean) | " + " | ".join(f"SCT p95 vs {b}" for b in BASELINES) + " |",
        "|---|---|---|---|" + "---|" * len(BASELINES),
        *rows,
        "",
        f"Cells {variants[0]} missed most often (of " + f"{args.seeds} seeds): "
        + ", ".join(f"{name} {n}" for name, n in worst if n) + ".",
        "",
    ])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


def _rows(res, variant: str) -> tuple[list[str], list]:
    per_seed: dict[int, list] = defaultdict(list)
    missed_cells: dict[str, int] = defaultdict(int)
    for (seed, name), got in res.items():
        ours = got[variant]
        best = [min(got[b][q] for b in BASELINES) for q in (0, 1)]
        ratio = (ours[0] / best[0], ours[1] / best[1])
        missed = ratio[0] > SLACK or ratio[1] > SLACK
        missed_cells[name] += missed
        per_seed[seed].append((ratio, missed, {b: ours[1] / got[b][1] for b in BASELINES}))
    rows = []
    everything = [x for seed in sorted(per_seed) for x in per_seed[seed]]
    for label, group in [*((f"seed {s}", per_seed[s]) for s in sorted(per_seed)), ("all seeds", everything)]:
        rows.append(
            f"{label} | {sum(m for _, m, _ in group)} / {len(group)} "
            f"| {gmean([r[0] for r, _, _ in group]):.3f}x | {gmean([r[1] for r, _, _ in group]):.3f}x | "
            + " | ".join(f"{gmean([v[b] for _, _, v in group]):.3f}x" for b in BASELINES) + " |")
    return rows, sorted(missed_cells.items(), key=lambda kv: -kv[1])


if __name__ == "__main__":
    raise SystemExit(main())
