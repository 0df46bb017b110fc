"""What the metrics cost a call: the CPU time of every metric update one call makes, summed
over the services (gateway timeline with 16 streamed tokens, the router's decision, lease and
completion, the agent's completion, round and engine steps), and of one scrape per service.

    python bench/metrics_overhead.py [--calls 20000]

Pure CPU on this process: no server. Compare with a call's control-plane CPU
(results/README.md, the overhead bench) to see the share.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from talaria.shared.events import (  # noqa: E402
    CallCompleted,
    CandidateCost,
    LeaseConsumed,
    LeaseIssued,
    RoundSummary,
    RoutingDecision,
)
from talaria.shared.messages import Timings, Usage  # noqa: E402
from talaria.shared.metrics import AgentMetrics, FrontendMetrics, RouterMetrics, TelemetryMetrics  # noqa: E402

TOKENS = 16


def one_call(i: int, front: FrontendMetrics, router: RouterMetrics, agent: AgentMetrics) -> None:
    cid = f"c{i}"
    call = front.call("qwen3-tiny", "chat", started=0.0)
    for t in range(TOKENS):
        call.token(now=0.1 + 0.01 * t)
    decision = RoutingDecision(cid, "s", i, "qwen3-tiny", "talaria", "route", 0.0, chosen="a0",
                               candidates=[CandidateCost("a0", 0.1, queue_s=0.05), CandidateCost("a1", 0.2)],
                               lease_outcome="consumed", expected_kv="device")
    done = CallCompleted(cid, "s", i, "qwen3-tiny", "a0", 500, TOKENS, "stop", 0.0, 0.05, 0.1, 0.3,
                         cached_tokens=400, kv_source="device", queue_s=0.04, ttft_s=0.1)
    router.observe_all([decision, LeaseConsumed("s", "qwen3-tiny", "a0", cid, 0.0)])
    router.phase.labels("decide").observe(1e-4)
    router.phase.labels("dispatch").observe(5e-5)
    router.phase.labels("store").observe(1e-3)
    router.observe(done)
    router.observe(LeaseIssued("s", "qwen3-tiny", "a0", cid, 0.3, 1.3))
    agent.observe(done)
    agent.observe(RoundSummary("a0", i, 0.3, 0.25, 0.0, 0.3))
    for _ in range(TOKENS):
        agent.engine_step("decode", 0.005)
    call.answered(200, Usage(500, TOKENS, 500 + TOKENS, 400), Timings(ttft_s=0.1), now=0.3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    front, router, agent, telemetry = FrontendMetrics(), RouterMetrics(), AgentMetrics("a0"), TelemetryMetrics()
    agent.snapshot_gauges(lambda: type("Snap", (), {"sessions": [], "running": 0, "queued": {},
                                                    "kv_used_tokens": 0, "kv_capacity_tokens": 1})())
    for i in range(1000):  # warm: every label child exists
        one_call(i, front, router, agent)
    start = time.process_time()
    for i in range(args.calls):
        one_call(1000 + i, front, router, agent)
    per_call = (time.process_time() - start) / args.calls
    start = time.process_time()
    scrapes = 200
    sizes = {}
    for _ in range(scrapes):
        for name, m in (("gateway", front), ("router", router), ("agent", agent), ("telemetry", telemetry)):
            sizes[name] = len(m.render())
    per_scrape = (time.process_time() - start) / scrapes
    print(f"metric updates per call (all services, {TOKENS} streamed tokens): {per_call * 1e6:.1f} us CPU")
    print(f"one scrape of all four services: {per_scrape * 1e3:.2f} ms CPU; bytes "
          + ", ".join(f"{k} {v}" for k, v in sizes.items()))


if __name__ == "__main__":
    main()
