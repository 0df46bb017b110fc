"""Sensitivity of the talaria policy's rules beyond the paper, in the simulator (not a test).

    python bench/router_sensitivity.py [--seeds 8] [--scale-sessions 1000] [--out results/router_sensitivity.md]

Rows add the rules one at a time: `PolicyConfig.kv_home_admits`, `price_round_sharing` (decode
priced by the rotation it joins, over the calls the session will still make: no constant)
and the first-call placement constant (`new_session_running_s`), then vary it. Columns: router testbed SCT p95 at low / medium / high load (mean
over gap seeds, beside session-sticky, the best baseline there), and SCT p50 / p95 of one
run of the scale workload (64 instances, 20 Zipf models) with `--scale-sessions` sessions
beside least-pressure. The placement constants were chosen on the router testbed; the scale
workload is the out-of-sample check.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from talaria.services.router.policy.base import PolicyConfig  # noqa: E402
from talaria.sim.cluster import RunConfig, simulate  # noqa: E402
from talaria.sim.experiments import OVERLOAD, PAPER_GAPS  # noqa: E402
from talaria.sim.executor import instance_config  # noqa: E402
from talaria.sim.metrics import summarise  # noqa: E402
from talaria.sim.profiles import PAPER_TP8, ROUTER_TP4, catalogue  # noqa: E402
from talaria.sim.workloads import router_testbed, synthetic_catalogue  # noqa: E402

OFF = dict(new_session_running_s=0.0)
VARIANTS = [  # (label, policy, PolicyConfig overrides)
    ("paper Eq. 1 + admission (rules off)", "talaria", dict(kv_home_admits=False, price_round_sharing=False, **OFF)),
    ("+ return admitted where its KV is", "talaria", dict(price_round_sharing=False, **OFF)),
    ("+ decode priced by the rotation, over the session's calls", "talaria", dict(OFF)),
    ("+ placement: 1 s per call running where a session starts (default)", "talaria", {}),
    ("placement: 0.5 s per running call", "talaria", dict(new_session_running_s=0.5)),
    ("placement: 2 s per running call", "talaria", dict(new_session_running_s=2.0)),
    ("session-sticky (best router-testbed baseline)", "session-sticky", {}),
    ("least-pressure", "least-pressure", {}),
]


def testbed_p95(policy: str, overrides: dict, load: str, seeds: int) -> float:
    p95 = []
    for seed in range(seeds):
        cfg = RunConfig(ROUTER_TP4, 2, policy, PolicyConfig(lease_timeout_s=1.0, overload=OVERLOAD, **overrides),
                        instance_config(), replace(PAPER_GAPS, seed=seed), label=load)
        p95.append(summarise(simulate(router_testbed(load), cfg))["sct_p95"])
    return sum(p95) / len(p95)


def scale_sct(policy: str, overrides: dict, sessions: int) -> tuple[float, float]:
    server = catalogue(PAPER_TP8, 20)
    work = synthetic_catalogue(sessions, list(server.models), 0.25, 1.0, 0)
    cfg = RunConfig(server, 64, policy, PolicyConfig(overload=OVERLOAD, **overrides), instance_config(),
                    replace(PAPER_GAPS, seed=0), label=policy)
    s = summarise(simulate(work, cfg))
    return s["sct_p50"], s["sct_p95"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--scale-sessions", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=Path("results/router_sensitivity.md"))
    args = ap.parse_args()
    rows = []
    for label, policy, overrides in VARIANTS:
        print(f"{label} ...", file=sys.stderr, flush=True)
        p95 = [testbed_p95(policy, overrides, load, args.seeds) for load in ("low", "medium", "high")]
        p50s, p95s = scale_sct(policy, overrides, args.scale_sessions)
        rows.append(f"| {label} | {p95[0]:.1f} | {p95[1]:.1f} | {p95[2]:.1f} | {p50s:.1f} / {p95s:.1f} |")
    text = "\n".join([
        "# Router policy sensitivity (simulator)",
        "",
        f"`python bench/router_sensitivity.py --seeds {args.seeds} --scale-sessions {args.scale_sessions}`. "
        f"Router testbed: SCT p95 in seconds, mean over {args.seeds} gap seeds. Scale: "
        f"{args.scale_sessions} sessions, 64 instances, 20 Zipf models, 0.25 sessions/s, gap seed 0.",
        "",
        "| talaria variant | testbed low | testbed medium | testbed high | scale SCT p50 / p95 |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
