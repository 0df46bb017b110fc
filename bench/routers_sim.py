"""What partitioned routing costs against one router, in the simulator (talaria/sim/cluster.py):
N routers each decide the sessions of their partitions, with the others' placements, leases
and completions visible only `lag` later (the stream-view lag measured live,
`talaria_router_peer_placement_lag_seconds`, results/routers_load.md), snapshots at once.

    python bench/routers_sim.py [--instances 64,256] [--routers 1,2,4] [--lag-ms 2] [--stress-ms 100]
                                [--sessions-per-instance 40] [--out results/routers.md]

The scale workload (sim/workloads.py synthetic_catalogue: Zipf over 20 models, paper gaps)
with sessions and arrival rate proportional to the instances (the 64-instance scale run's
load per instance: a session every 4 s per 64 instances). Every run: SCT p50/p95, cold
opens (avoidable ones too), TTFT p95, each as a ratio to one router on the same workload.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from talaria.services.router.policy.base import PolicyConfig  # noqa: E402
from talaria.sim.cluster import RunConfig, simulate  # noqa: E402
from talaria.sim.executor import instance_config  # noqa: E402
from talaria.sim.experiments import OVERLOAD, PAPER_GAPS  # noqa: E402
from talaria.sim.metrics import summarise  # noqa: E402
from talaria.sim.profiles import PAPER_TP8, catalogue  # noqa: E402
from talaria.sim.workloads import synthetic_catalogue  # noqa: E402


def one_run(work, server, instances: int, routers: int, lag_s: float, policy: str, seed: int) -> dict:
    cfg = RunConfig(server, instances, policy, PolicyConfig(overload=OVERLOAD), instance_config(),
                    replace(PAPER_GAPS, seed=seed), label=f"{instances}i/{routers}r/{lag_s * 1000:g}ms",
                    routers=routers, propagation_s=lag_s)
    started = time.perf_counter()
    result = simulate(work, cfg)
    s = summarise(result)
    return {"instances": instances, "seed": seed, "routers": routers, "lag_ms": lag_s * 1000, "complete": s["complete"],
            "sct_p50": s["sct_p50"], "sct_p95": s["sct_p95"], "ttft_p95": s["ttft_p95"],
            "opens": result.router.model_opens_needed, "avoidable_cold_opens": result.router.avoidable_cold_opens,
            "rejected": result.router.rejected, "calls": len(result.jobs), "wall_s": time.perf_counter() - started}


def run(instance_counts, router_counts, lag_s, stress_s, per_instance, policy, seed) -> list[dict]:
    rows = []
    server = catalogue(PAPER_TP8, 20)
    for n in instance_counts:
        rate = 0.25 * n / 64  # sessions per second: the 64-instance scale run's load per instance
        work = synthetic_catalogue(per_instance * n, list(server.models), rate, 1.0, seed)
        plan = [(1, 0.0)] + [(r, lag_s) for r in router_counts if r > 1]
        if stress_s:
            plan.append((max(router_counts), stress_s))
        for routers, lag in plan:
            row = one_run(work, server, n, routers, lag, policy, seed)
            print("routers_sim: " + json.dumps(row), file=sys.stderr)
            rows.append(row)
    return rows


def markdown(rows: list[dict], command: str, policy: str) -> str:
    def ratio(a, b):
        return "-" if not a or not b else f"{a / b:.3f}"

    lines = [
        "# Router replicas in the simulator: partitioned routing against one router", "",
        f"`{command}` (policy `{policy}`). N routers each decide their own partitions' sessions; the others' "
        "placements, leases and completions reach a router only after the lag (snapshots reach all at once, as "
        "live). The lag is the live figure of results/routers_load.md (a peer's routed call folded by the other "
        "router); a stress row takes a loaded box's lag. Scale workload with sessions and arrivals proportional to "
        "the instances.", "",
        "| instances | seed | routers | lag ms | calls | SCT p50 s | SCT p95 s | TTFT p95 s | opens | avoidable cold opens "
        "| 503s | SCT p50 / 1 router | SCT p95 / 1 router | opens / 1 router | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(b for b in rows if b["instances"] == r["instances"] and b["routers"] == 1
                    and b.get("seed", 0) == r.get("seed", 0))
        lines.append(
            f"| {r['instances']} | {r.get('seed', 0)} | {r['routers']} | {r['lag_ms']:g} | {r['calls']} | {r['sct_p50']:.2f} "
            f"| {r['sct_p95']:.2f} | {r['ttft_p95']:.2f} | {r['opens']} | {r['avoidable_cold_opens']} "
            f"| {r['rejected']} | {ratio(r['sct_p50'], base['sct_p50'])} | {ratio(r['sct_p95'], base['sct_p95'])} "
            f"| {ratio(r['opens'], base['opens'])} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", default="64,256")
    ap.add_argument("--routers", default="1,2,4")
    ap.add_argument("--lag-ms", type=float, default=2.0, help="the measured peer lag (results/routers_load.md)")
    ap.add_argument("--stress-ms", type=float, default=100.0, help="a pessimistic lag (0: none)")
    ap.add_argument("--sessions-per-instance", type=int, default=40)
    ap.add_argument("--policy", default="talaria")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/routers.md")
    ap.add_argument("--add", action="store_true", help="add these rows to the --out file's JSON and rewrite it")
    args = ap.parse_args()
    rows = run([int(x) for x in args.instances.split(",")], [int(x) for x in args.routers.split(",")],
               args.lag_ms / 1000, args.stress_ms / 1000, args.sessions_per_instance, args.policy, args.seed)
    command = (f"python bench/routers_sim.py --instances {args.instances} --routers {args.routers} "
               f"--lag-ms {args.lag_ms:g} --stress-ms {args.stress_ms:g} "
               f"--sessions-per-instance {args.sessions_per_instance}")
    out = ROOT / args.out
    if args.add and out.with_suffix(".json").exists():
        rows = json.loads(out.with_suffix(".json").read_text()) + rows
        command = "; ".join(dict.fromkeys([*(out.read_text().split("`")[1].split("; ")), command]))
    out.write_text(markdown(rows, command, args.policy))
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
