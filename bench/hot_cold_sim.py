"""Live's hot-pool configuration in the simulator: every agent cold, with and without the
router's hot+cold controller (`TALARIA_HOT_POOLS`), on the matrix's generated cells (not a test).

    python bench/hot_cold_sim.py [--seeds 3] [--cells SUBSTR,...] [--out results/hot_cold_sim.md]

Live agents start cold (each serves every model in rounds); with `TALARIA_HOT_POOLS` the
router turns a cold agent hot for a model when that model's measured demand surely fills an
instance (services/router/hot_pools.py, the hot+cold rule). This runs talaria's policy both
ways on each generated cell of `talaria.sim.matrix.cells(seed)`: `cold` (no controller) and
`hot+cold` (the controller, started all cold as live agents register), and reports SCT p50 /
p95 per cell, the controller's repins, and the geometric mean of hot+cold / cold SCT p95
per seed. A cell whose sessions never all finish has SCT infinity (a model left with no
instance to run on).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from talaria.sim import matrix as M  # noqa: E402
from talaria.sim.cluster import RunConfig, simulate  # noqa: E402
from talaria.sim.executor import instance_config  # noqa: E402
from talaria.sim.metrics import summarise  # noqa: E402


def run(cell: M.Cell, controller: bool) -> tuple[float, float, int]:
    """(SCT p50, SCT p95, repins) of talaria on `cell`, every instance starting cold."""
    flags = instance_config("talaria")
    sessions, gaps, _ = M.workload(cell, flags)
    name, pc = M.policy_config(M.OURS)
    server = M.server_for(cell)
    shared = {m: cell.shared for m in server.models} if cell.shared else {}
    cfg = RunConfig(server, cell.instances, name, pc, flags, gaps, label=f"{cell.name}/cold",
                    pinned=(None,) * cell.instances, shared_prefix=shared, hot_pools=controller)
    result = simulate(sessions, cfg)
    s = summarise(result)
    return s["sct_p50"], s["sct_p95"], result.router.repins


def _task(args: tuple[int, str]) -> tuple[int, str, tuple, tuple]:
    seed, name = args
    cell = next(c for c in M.cells(seed) if c.name == name)
    return seed, name, run(cell, False), run(cell, True)


def _gmean(ratios: list[float]) -> float:
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cells", default="", help="comma-separated substrings of cell names")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/hot_cold_sim.md"))
    args = ap.parse_args(argv)
    only = [c for c in args.cells.split(",") if c]
    tasks = [(seed, c.name) for seed in range(args.seeds) for c in M.cells(seed)
             if not c.weka and (not only or any(o in c.name for o in only))]
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        rows = sorted(pool.map(_task, tasks))
    lines = [
        "# Live's hot-pool configuration in the simulator: all cold vs the hot+cold controller",
        "",
        f"`python bench/hot_cold_sim.py --seeds {args.seeds}` ({time.perf_counter() - started:.0f} s). "
        "talaria's policy, every instance starting cold; `hot+cold` adds the router's controller "
        "(`TALARIA_HOT_POOLS`, services/router/hot_pools.py). SCT in seconds; inf: a session never finished.",
        "",
        "| seed | cell | cold SCT p50 / p95 | hot+cold SCT p50 / p95 | repins | p95 hot+cold / cold |",
        "|---|---|---|---|---|---|",
    ]
    per_seed: dict[int, list[float]] = {}
    for seed, name, (c50, c95, _), (h50, h95, repins) in rows:
        ratio = h95 / c95 if math.isfinite(h95) else math.inf
        per_seed.setdefault(seed, []).append(ratio)
        lines.append(f"| {seed} | {name} | {c50:.1f} / {c95:.1f} | {h50:.1f} / {h95:.1f} | {repins} | {ratio:.3f} |")
    lines += ["", "Geometric mean of hot+cold / cold SCT p95, per seed: " + ", ".join(
        f"seed {s} {_gmean(r):.3f}" for s, r in sorted(per_seed.items())) + "."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
