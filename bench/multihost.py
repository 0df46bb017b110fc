"""talaria across three network hosts on this machine (namespaces; tests/multihost/hosts.py):
a control host and two agent hosts, each running a node of one NATS cluster. One load per phase:

- baseline: no fault;
- netem: every agent host's link shaped to 0.5 ms and 1 Gbit/s;
- partition: an agent host's link down for 10 s, then up;
- kill-nats: an agent host's NATS node SIGKILLed, restarted 5 s later.

Per phase: calls answered / lost (no 200) / run twice (`call completed` log lines per call_id
on the agent hosts), the longest stall (no call answered while one waited) and when it began and
ended (seconds after the fault began: the partition heals at +10), and call latency p50/p95 as a
ratio to the baseline measured in the same run.

    python bench/multihost.py [--seconds 30] [--sessions 6] [--out results/multihost.md]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_record import publish  # noqa: E402
from tests.multihost.hosts import Cluster, available  # noqa: E402
from tests.multihost.load import latency_p, under_fault  # noqa: E402


def phases(cluster: Cluster):
    def nothing():
        pass

    def netem():
        for name in cluster.agent_hosts:
            print(f"multihost: {name}: {cluster.net.shape(name, 0.5, '1gbit')}", flush=True)

    def partition():
        cluster.net.partition("a2")
        time.sleep(10.0)  # the fault's duration
        cluster.net.heal("a2")

    def kill_nats():
        cluster.kill_nats("a1")
        time.sleep(5.0)  # the node stays dead
        cluster.restart_nats("a1")

    return {"baseline": nothing, "shaped 1 Gbit/s (+0.5 ms where netem exists)": netem, "partition a2 10 s": partition,
            "kill-nats a1 5 s": kill_nats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    why = available()
    if why:
        print(f"multihost: {why}", file=sys.stderr)
        return 2
    rows = []
    tmp = tempfile.mkdtemp(prefix="talaria-multihost-")  # kept: the hosts' logs
    if True:
        t0 = time.monotonic()
        cluster = Cluster(Path(tmp) / "hosts").start()
        print(f"multihost: 3 hosts up in {time.monotonic() - t0:.1f}s", flush=True)
        try:
            base_p50 = base_p95 = None
            for seed, (name, fault) in enumerate(phases(cluster).items()):
                load, seen = asyncio.run(under_fault(cluster.gateway_url, cluster.api_key, fault, cluster.executions,
                                                     args.seconds, args.sessions, seed))
                p50, p95 = latency_p(load.calls, 0.5), latency_p(load.calls, 0.95)
                base_p50, base_p95 = base_p50 or p50, base_p95 or p95
                since, until = seen.stall_span
                rows.append(f"| {name} | {seen.answered} | {seen.lost} | {seen.twice} | {seen.longest_stall_s:.1f} | "
                            f"{since:+.1f} to {until:+.1f} | "
                            f"{p50 * 1000:.0f} ({p50 / base_p50:.2f}x) | {p95 * 1000:.0f} ({p95 / base_p95:.2f}x) |")
                print(f"multihost: {rows[-1]}", flush=True)
        finally:
            cluster.stop()
    table = ("| phase | answered | lost | run twice | longest stall (s) | stall from/to (s after the fault began) | "
             "latency p50 ms (vs baseline) | p95 ms (vs baseline) |\n|---|---|---|---|---|---|---|---|\n"
             + "\n".join(rows) + "\n")
    publish(table, args.out, "multihost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
