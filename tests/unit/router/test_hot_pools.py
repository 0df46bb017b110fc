"""The router's online hot-pool controller (services/router/hot_pools.py) and its events."""

from __future__ import annotations

import pytest

from talaria.services.router.hot_pools import SPAN_MEMORY, HotPools, split

INST = ("i0", "i1", "i2", "i3")


def _sessions(pools: HotPools, model: str, n: int, inst: str, now: float, prefix: str = "") -> None:
    for k in range(n):
        sid = f"{prefix}{model}-{k}"
        pools.routed(sid, model, inst, 1000, now)
        pools.completed(sid, model, 1000, 0, 100, 0.1, 1.0, now + 1.0)


def test_even_start_and_split():
    pools = HotPools.even(INST, ("a", "b", "c"))
    assert pools.counts() == {"a": 2, "b": 1, "c": 1} and not pools.cold_pool
    assert split({"a": 3.0, "b": 1.0}, 4) == {"a": 3, "b": 1}
    assert split({"a": 3.0, "b": 1.0}, 4, floor={"b": 2}) == {"a": 2, "b": 2}
    with pytest.raises(ValueError):
        HotPools.even(("i0",), ("a", "b"))
    cold = HotPools.spare_cold(INST, ("a", "b", "c"))
    assert cold.counts() == {"a": 1, "b": 1, "c": 1} and list(cold.pins.values()).count(None) == 1


def test_balanced_demand_moves_nothing():
    pools = HotPools.even(INST, ("a", "b"))
    _sessions(pools, "a", 8, "i0", 0.0)
    _sessions(pools, "b", 8, "i2", 0.0)
    assert pools.decide(10.0, {"a": 1.0, "b": 1.0}, {}) == []


def test_a_model_that_takes_most_sessions_gets_an_instance_from_the_one_without_sessions():
    pools = HotPools.even(INST, ("a", "b"))  # a: i0, i1; b: i2, i3
    _sessions(pools, "b", 30, "i2", 0.0)
    _sessions(pools, "a", 2, "i0", 0.0)
    moves = pools.decide(10.0, {"a": 1.0, "b": 1.0}, {})
    assert [(m.instance_id, m.model, m.previous) for m in moves] == [("i1", "b", "a")]  # i1 holds no a session
    assert pools.counts() == {"a": 1, "b": 3}
    # at most one move per W / N, and never below one instance of a model
    assert pools.decide(10.5, {"a": 1.0, "b": 1.0}, {}) == []
    _sessions(pools, "b", 30, "i3", 20.0, prefix="x")
    assert pools.decide(1000.0, {"a": 1.0, "b": 1.0}, {}) == []
    assert pools.counts() == {"a": 1, "b": 3}


def test_a_move_that_costs_more_than_it_gains_over_the_window_is_not_made():
    pools = HotPools.even(INST, ("a", "b"))
    _sessions(pools, "b", 30, "i2", 0.0)
    _sessions(pools, "a", 2, "i0", 0.0)
    assert pools.decide(10.0, {"a": 1.0, "b": 1e6}, {}) == []  # loading b costs more than W x imbalance


def test_noise_margin_blocks_a_move_on_a_handful_of_sessions():
    pools = HotPools.even(INST, ("a", "b"), z=2.0)
    _sessions(pools, "b", 3, "i2", 0.0)
    _sessions(pools, "a", 1, "i0", 0.0)
    assert pools.decide(10.0, {"a": 0.0, "b": 0.0}, {}) == []  # 4 sessions: the 3:1 share is not sure
    loose = HotPools.even(INST, ("a", "b"), z=0.0)
    _sessions(loose, "b", 3, "i2", 0.0)
    _sessions(loose, "a", 1, "i0", 0.0)
    assert loose.decide(10.0, {"a": 0.0, "b": 0.0}, {})


def test_operator_floor_and_fixed_instances_are_kept():
    pools = HotPools.even(INST, ("a", "b"), floor={"a": 2})
    _sessions(pools, "b", 40, "i2", 0.0)
    assert pools.decide(10.0, {"a": 0.0, "b": 0.0}, {}) == []
    assert pools.counts() == {"a": 2, "b": 2}
    fixed = HotPools.even(INST, ("a", "b"))
    fixed.instance("i0", "a", ("a",)), fixed.instance("i1", "a", ("a",))  # `--hot a` agents
    _sessions(fixed, "b", 40, "i2", 0.0)
    assert fixed.decide(10.0, {"a": 0.0, "b": 0.0}, {}) == []


def test_hot_cold_promotes_what_demand_fills_and_demotes_what_it_no_longer_does():
    pools = HotPools()  # live: agents register as they heartbeat, cold
    for i in INST:
        pools.instance(i, None, ("a", "b"))
    _sessions(pools, "b", 40, "i2", 0.0)
    moves = pools.decide(10.0, {"a": 1.0, "b": 1.0}, {})
    assert [(m.instance_id, m.model) for m in moves] == [("i2", "b")]  # b's sessions already run on i2
    for k in range(40):
        pools.expire(10_000.0 + k, lambda m: 60.0)  # b's sessions go idle past the horizon
    _sessions(pools, "a", 40, "i0", 10_100.0)
    _sessions(pools, "b", 1, "i2", 10_100.0, prefix="late")
    moves = pools.decide(10_200.0, {"a": 1.0, "b": 1.0}, {})
    assert [(m.instance_id, m.model) for m in moves] in ([("i0", "a")], [("i2", None)])


def test_sessions_expire_only_when_idle_past_their_models_horizon():
    pools = HotPools.even(INST, ("a", "b"))
    pools.routed("s", "a", "i0", 100, 0.0)
    pools.expire(1000.0, lambda m: 1.0)
    assert pools.live()["a"] == 1  # a call is still running
    pools.completed("s", "a", 100, 0, 10, 0.1, 0.1, 5.0)
    pools.expire(5.5, lambda m: 1.0)
    assert pools.live()["a"] == 1
    pools.expire(6.5, lambda m: 1.0)
    assert pools.live()["a"] == 0 and pools.window_s(7.0) == 5.0


def test_a_model_gets_no_more_instances_than_it_has_live_sessions():
    # 16 instances, 8 each; b holds 3 of the 4 live sessions (share 12 of 16) but can keep at
    # most 3 instances busy: it already has 8, so nothing moves.
    inst = tuple(f"i{k}" for k in range(16))
    pools = HotPools.even(inst, ("a", "b"))
    _sessions(pools, "b", 3, "i8", 0.0)
    _sessions(pools, "a", 1, "i0", 0.0)
    assert pools.decide(10.0, {"a": 1.0, "b": 1.0}, {}) == []
    # with more live sessions than its instances, the same share moves one
    _sessions(pools, "b", 9, "i8", 20.0, prefix="x")
    _sessions(pools, "a", 3, "i0", 20.0, prefix="x")
    moves = pools.decide(30.0, {"a": 1.0, "b": 1.0}, {})
    assert [(m.model, m.previous) for m in moves] == [("b", "a")]


def test_a_peer_routers_pool_move_is_folded_and_paces_this_routers_moves():
    """With router replicas only partition 0's owner decides; the others fold its PoolPinned
    (RouterCore.fold_peer) so a takeover starts from the same pins and the same pace."""
    from talaria.services.router.router_core import PEER_OUTPUTS, RouterCore
    from talaria.services.router.router_service import VIEW_EVENTS
    from talaria.shared.events import PoolPinned
    from router_support import core as router_core

    assert PoolPinned in PEER_OUTPUTS and "pool.pinned" in VIEW_EVENTS
    rc: RouterCore = router_core()
    rc.pools = pools = HotPools.even(INST, ("a", "b"))  # a: i0, i1; b: i2, i3
    rc.fold_peer(PoolPinned("i1", "b", "a", 10.0, "peer"), 10.0)
    assert pools.counts() == {"a": 1, "b": 3}
    # the peer's move counts against the one-move-per-W/N gate here too
    _sessions(pools, "a", 30, "i0", 0.0)
    _sessions(pools, "b", 2, "i2", 0.0)
    assert pools.decide(10.5, {"a": 1.0, "b": 1.0}, {}) == []
    assert [m.model for m in pools.decide(1000.0, {"a": 1.0, "b": 1.0}, {})] == ["a"]


def test_an_instance_moves_only_to_a_model_that_is_short_of_instances():
    """b's instances are idle, but a's two live sessions already have an instance each: moving
    one serves nothing. A third a session makes a short, and then one moves."""
    pools = HotPools.even(INST, ("a", "b"))  # a: i0, i1; b: i2, i3
    _sessions(pools, "a", 2, "i0", 0.0)
    assert pools.decide(10.0, {"a": 0.0, "b": 0.0}, {}) == []
    _sessions(pools, "a", 1, "i1", 1.0, prefix="x")
    assert [(m.model, m.previous) for m in pools.decide(20.0, {"a": 0.0, "b": 0.0}, {})] == [("a", "b")]


def test_the_last_cold_instance_stays_cold_while_a_model_has_no_hot_instance():
    # One agent, two models, every session on a: pinning it to a would leave b's calls
    # nowhere to run.
    pools = HotPools()
    pools.instance("i0", None, ("a", "b"))
    _sessions(pools, "a", 40, "i0", 0.0)
    assert pools.decide(10.0, {"a": 1.0, "b": 1.0}, {}) == []
    # with a second agent, one of them turns hot for a and the other stays cold for b
    pools.instance("i1", None, ("a", "b"))
    moves = pools.decide(20.0, {"a": 1.0, "b": 1.0}, {})
    assert [m.model for m in moves] == ["a"]
    assert pools.decide(1000.0, {"a": 1.0, "b": 1.0}, {}) == [] and list(pools.pins.values()).count(None) == 1


def test_an_instance_turns_hot_only_if_the_cold_pool_left_carries_the_other_models():
    # 4 instances, i3 hot for b (its floor). a: 60 sessions (2.4 instances of demand), c: 36
    # (1.44), b: 4. a gets i0; then c is the most short, but pinning a second cold instance
    # would leave one for a's 1.4 instances past its hot one: refused, both stay cold.
    pools = HotPools()
    for i in INST:
        pools.instance(i, None, ("a", "b", "c"))
    pools.pinned("i3", "b", -1000.0)
    _sessions(pools, "a", 60, "i0", 0.0)
    _sessions(pools, "c", 36, "i1", 0.0)
    _sessions(pools, "b", 4, "i3", 0.0)
    cost = {"a": 1.0, "b": 1.0, "c": 1.0}
    assert [m.model for m in pools.decide(10.0, cost, {})] == ["a"]
    _sessions(pools, "b", 1, "i3", 500.0, prefix="late")  # demand moved: a decision is due
    assert pools.due(1000.0) and pools.decide(1000.0, cost, {}) == []
    assert pools.counts() == {"a": 1, "b": 1, "c": 0}


def _history(pools: HotPools, per_model: dict[str, int], span: float = 100.0, until: float = 900.0) -> None:
    """Sessions that started evenly over [0, until), each lasting `span` s, all over by now."""
    for model, n in per_model.items():
        for k in range(n):
            t = k * until / n
            sid = f"h-{model}-{k}"
            pools.routed(sid, model, "i0" if model == "a" else "i2", 1000, t)
            pools.completed(sid, model, 1000, 0, 100, 0.1, 1.0, t + span)
    pools.expire(until + span + 2.0, lambda m: 1.0)


def test_the_stay_share_is_the_mean_residual_life_of_the_measured_sessions():
    pools = HotPools.even(INST, ("a", "b"))
    assert pools.stay_share(0.0) == 1.0  # nothing has ended: the live sessions are all there is
    _history(pools, {"a": 5, "b": 5})
    # every session lasts exactly W: on average half of the live ones remain over the next W
    assert pools.window_s(1000.0) == pytest.approx(100.0)
    assert pools.stay_share(1000.0) == pytest.approx(0.5)


def test_a_surge_of_live_sessions_that_the_arrival_rates_say_will_pass_moves_nothing():
    # a and b have started sessions at the same rate; right now b has 4 live, a 1. Counting
    # only the live sessions moves an instance to b (the rule before the forecast); the
    # forecast over the next W (half of the live ones remain, the rest arrive evenly) does not.
    surge = HotPools.even(INST, ("a", "b"))
    _history(surge, {"a": 20, "b": 20})
    _sessions(surge, "b", 4, "i2", 1003.0)
    _sessions(surge, "a", 1, "i0", 1003.0)
    assert surge.decide(1010.0, {"a": 1.0, "b": 1.0}, {}) == []
    live_only = HotPools.even(INST, ("a", "b"))
    _sessions(live_only, "b", 4, "i2", 1003.0)
    _sessions(live_only, "a", 1, "i0", 1003.0)
    assert [(m.model, m.previous) for m in live_only.decide(1010.0, {"a": 1.0, "b": 1.0}, {})] == [("b", "a")]
    # the same live sessions after b has been arriving four times as fast: b gets the instance
    sustained = HotPools.even(INST, ("a", "b"))
    _history(sustained, {"a": 10, "b": 40})
    _sessions(sustained, "b", 4, "i2", 1003.0)
    _sessions(sustained, "a", 1, "i0", 1003.0)
    assert [(m.model, m.previous) for m in sustained.decide(1010.0, {"a": 1.0, "b": 1.0}, {})] == [("b", "a")]


def test_the_window_follows_the_most_recent_sessions_and_its_memory_is_bounded():
    # A router runs for weeks: W and the stay share come from the last SPAN_MEMORY session
    # durations, so they follow today's sessions, and a decision (run after every event)
    # costs the same on day 30 as on day 1.
    pools = HotPools.even(INST, ("a", "b"))
    for batch, (start, span) in enumerate(((0.0, 10.0), (1000.0, 100.0))):
        for k in range(SPAN_MEMORY):
            sid = f"s{batch}-{k}"
            pools.routed(sid, "a", "i0", 1000, start)
            pools.completed(sid, "a", 1000, 0, 100, 0.1, 1.0, start + span)
        pools.expire(start + span + 2.0, lambda m: 1.0)
    assert pools.window_s(2000.0) == pytest.approx(100.0)  # all 2 x SPAN_MEMORY: 55 s
    assert pools.stay_share(2000.0) == pytest.approx(0.5)


def test_a_session_whose_call_failed_ends_like_one_whose_call_completed():
    # The controller counts a session live while a call of it runs. A call that fails (timed
    # out, cancelled, its instance lost) runs no more: before, its session stayed live for
    # ever, one more with every failure, and the pools followed sessions that had ended.
    from talaria.shared.events import CallFailed
    from router_support import call, core as router_core, snap

    rc = router_core(lease_timeout_s=0.0)
    rc.pools = pools = HotPools.even(INST, ("m1", "m2"))
    rc.observe(snap("i0", at=0.0, models={"m1": "active"}), 0.0)
    rc.handle(call("c1", session="s1"), 0.1)
    rc.handle(call("c2", session="s2"), 0.2)
    assert pools.live()["m1"] == 2
    rc.handle(CallFailed("c1", "s1", "m1", "deadline passed", "gateway", 5.0), 5.0)
    lost = rc.lose(rc.state.instances["i0"], "gone", 6.0)  # fails c2 on the lost instance
    assert [e.call_id for e in lost if isinstance(e, CallFailed)] == ["c2"]
    rc.tick(100.0)
    assert pools.live()["m1"] == 0
    # a call refused before placement was never routed: failing it ends nothing
    pools.routed("s3", "m1", "i0", 1000, 200.0, "c3")
    pools.failed("never-routed", 201.0)
    pools.expire(300.0, lambda m: 1.0)
    assert pools.live()["m1"] == 1


def test_a_lost_agent_leaves_the_pools_and_registers_again_when_it_comes_back():
    # Before, a lost agent stayed pinned for ever: its model looked an instance richer than it
    # was (agents restart under new ids by default), and the controller moved a live one away.
    from talaria.shared.events import InstanceLost
    from router_support import core as router_core, snap

    rc = router_core()
    rc.pools = pools = HotPools.even(INST, ("a", "b"))  # a: i0, i1; b: i2, i3
    for iid in INST:
        rc.observe(snap(iid, at=0.0, models={"a": "active", "b": "absent"}), 0.0)
    rc.lose(rc.state.instances["i1"], "no heartbeat", 5.0)
    assert pools.counts() == {"a": 1, "b": 2} and "i1" not in pools.pins
    # another router noticed i3 first: its InstanceLost, folded here, does the same
    rc.fold_peer(InstanceLost("i3", rc.state.instances["i3"].snapshot.incarnation, "gone", 6.0, []), 6.0)
    assert pools.counts() == {"a": 1, "b": 1}
    # i1 back (a new process): registered again as its snapshot says, cold here
    rc.observe(snap("i1", at=7.0, models={"a": "active", "b": "absent"}), 7.0)
    assert "i1" in pools.pins and pools.counts() == {"a": 1, "b": 1}
