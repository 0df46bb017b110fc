"""The hot pools are part of the router's state: folded by `RouterState.apply` and saved with
its checkpoint, so a router restarted mid-run resumes the same pools (hot_pools.py)."""

from __future__ import annotations

import json

import pytest

from talaria.services.router.state import RouterState
from talaria.sim.cluster import Cluster
from talaria.sim.matrix import cells, run_config


def _restart(cluster: Cluster, at: float, seen: list) -> None:
    """At `at`, replace the router's state by its checkpoint read back (JSON, as Postgres
    stores it). The prefix index is a soft cache, not checkpointed: it is carried over so
    that only what the checkpoint holds decides what follows."""
    def restart(now: float):
        old = cluster.router.state
        saved = json.loads(json.dumps(old.to_dict()))
        new = RouterState.from_dict(saved)
        new.prefix = old.prefix
        seen.append((old.pools.to_dict(), new.pools.to_dict() if new.pools is not None else None, now))
        cluster.router.state = new
        return None

    cluster.loop.push(at, restart, ())


@pytest.mark.parametrize("cell,policy", [("base@60%", "talaria"), ("base@100%", "talaria-hot-cold")])
def test_a_router_restarted_mid_run_resumes_the_same_pools(cell, policy):
    c = next(x for x in cells() if x.name == cell)
    cfg, _, sessions, _ = run_config(c, policy)
    straight = Cluster(sessions, cfg).run()
    assert straight.router.repins > 0  # the pools move in this run: there is something to resume
    moves_at = sorted(sw.at for inst in straight.instances for sw in inst.switches)
    restarted, seen = Cluster(sessions, cfg), []
    _restart(restarted, moves_at[len(moves_at) // 2], seen)  # mid-run, pools already moved
    result = restarted.run()
    (before, after, _), = seen
    assert after == before
    assert result.router.repins == straight.router.repins
    assert [i.sched.pin_target for i in result.instances] == [i.sched.pin_target for i in straight.instances]
    assert sorted((j.call_id, j.instance, j.done_t) for j in result.jobs) == \
        sorted((j.call_id, j.instance, j.done_t) for j in straight.jobs)


def test_a_state_without_pools_checkpoints_none():
    assert RouterState().to_dict()["pools"] is None and RouterState.from_dict(RouterState().to_dict()).pools is None
