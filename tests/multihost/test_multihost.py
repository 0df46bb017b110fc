"""talaria on three network hosts (namespaces on this machine): a control host and two agent
hosts, each a node of one NATS cluster. Calls flow across hosts while an agent host is cut off
for 10 s and healed, and while a NATS node is killed and restarted."""

from __future__ import annotations

import time

import pytest

from talaria.shared.bus import FAILOVER_S
from tests.multihost.hosts import Cluster, available
from tests.multihost.load import under_fault

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.skipif(available() is not None, reason=available() or "")]

PARTITION_S, NODE_DEAD_S = 10.0, 5.0
# A cut-off or dead NATS node may hold RAFT leaders (meta, streams, consumers); the majority
# replaces them only after an election timeout (4-9 s, then up to 0.8 s campaigning in
# nats-server's RAFT), a split vote costs a second round (bus.FAILOVER_S, what the services
# wait out), and the node coming back may depose them once more (its term grew meanwhile).
# Calls that wait on those leaders may stall that long past the fault's end; the 10 s is
# met in some runs, not bounded (results/multihost.md has the stalls measured and the bound). The
# properties talaria owns are exact (nothing lost, nothing run twice); this bound is NATS's.
ELECTION_MAX_S = FAILOVER_S + (9.0 + 0.8)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path / "hosts").start()
    yield c
    c.stop()


async def test_calls_flow_across_hosts_through_a_partition_and_a_nats_node_kill(cluster):
    assert {"a1-0", "a2-0"} <= set(cluster.health()["instances"])

    def partition():
        cluster.net.partition("a2")
        time.sleep(PARTITION_S)  # the fault's own duration, not a synchronisation
        cluster.net.heal("a2")

    load, seen = await under_fault(cluster.gateway_url, cluster.api_key, partition, cluster.executions)
    served = cluster.executions()
    assert seen.answered > 20, seen
    assert seen.lost == 0, [c for c in load.calls if c.status != 200]
    assert seen.twice == 0, {k: n for k, n in served.items() if n > 1}
    assert seen.longest_stall_s <= PARTITION_S + ELECTION_MAX_S, seen
    assert {c.call_id for c in load.calls} <= set(served)  # every answer was an agent's execution

    def kill_node():
        cluster.kill_nats("a1")
        time.sleep(NODE_DEAD_S)  # the node stays dead for a while
        cluster.restart_nats("a1")

    load, seen = await under_fault(cluster.gateway_url, cluster.api_key, kill_node, cluster.executions, seed=1)
    assert seen.lost == 0, [c for c in load.calls if c.status != 200]
    assert seen.twice == 0, seen
    assert seen.longest_stall_s <= NODE_DEAD_S + ELECTION_MAX_S, seen
