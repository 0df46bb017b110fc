"""The router's online hot-pool controller (services/router/hot_pools.py)."""

from __future__ import annotations

import pytest

from talaria.services.router.hot_pools import HotPools, split

INST = ("i0", "i1", "i2", "i3")


def _sessions(pools: HotPools, model: str, n: int, inst: str, now: float, prefix: str = "") -> None:
    for k in range(n):
        sid = f"{prefix}{model}-{k}"
        pools.routed(f"{sid}#0", sid, model, inst, now, prompt_tokens=1000)
        pools.completed(f"{sid}#0", sid, model, 1000, 0, 100, 0.1, 1.0, now + 1.0)


def test_even_start_and_split():
    pools = HotPools.even(INST, ("a", "b", "c"))
    assert pools.counts() == {"a": 2, "b": 1, "c": 1}
    assert split({"a": 3.0, "b": 1.0}, 4) == {"a": 3, "b": 1}
    assert split({"a": 3.0, "b": 1.0}, 4, floor={"b": 2}) == {"a": 2, "b": 2}
    with pytest.raises(ValueError):
        HotPools.even(("i0",), ("a", "b"))


def test_balanced_demand_moves_nothing():
    pools = HotPools.even(INST, ("a", "b"))
    _sessions(pools, "a", 8, "i0", 0.0)
    _sessions(pools, "b", 8, "i2", 0.0)
    assert pools.decide(10.0, {"a": 1.0, "b": 1.0}, {}) == []


def test_a_model_that_takes_most_sessions_gets_an_instance_from_the_idle_one():
    pools = HotPools.even(INST, ("a", "b"))  # a: i0, i1; b: i2, i3
    _sessions(pools, "b", 30, "i2", 0.0)
    _sessions(pools, "a", 2, "i0", 0.0)
    moves = pools.decide(10.0, {"a": 1.0, "b": 1.0}, {})
    assert [(m.instance_id, m.model, m.previous) for m in moves] == [("i1", "b", "a")]  # i1 holds no a session
    assert pools.counts() == {"a": 1, "b": 3}
    # at most one move per W / N, and never below one instance of a model
    assert pools.decide(10.5, {"a": 1.0, "b": 1.0}, {}) == []
    _sessions(pools, "b", 30, "i3", 20.0, prefix="x")
    assert all(m.model == "b" for m in pools.decide(1000.0, {"a": 1.0, "b": 1.0}, {}))
    assert pools.counts()["a"] >= 1


def test_a_move_that_costs_more_than_it_gains_over_the_window_is_not_made():
    pools = HotPools.even(INST, ("a", "b"))
    _sessions(pools, "b", 30, "i2", 0.0)
    _sessions(pools, "a", 2, "i0", 0.0)
    assert pools.decide(10.0, {"a": 1.0, "b": 1e6}, {}) == []  # loading b costs more than W x imbalance


def test_noise_margin_blocks_a_move_on_a_handful_of_sessions():
    pools = HotPools.even(INST, ("a", "b"), z=2.0)
    _sessions(pools, "b", 3, "i2", 0.0)
    assert pools.decide(10.0, {"a": 0.0, "b": 0.0}, {}) == []  # 3 sessions: share known to ~60 %
    loose = HotPools.even(INST, ("a", "b"), z=0.0)
    _sessions(loose, "b", 3, "i2", 0.0)
    assert loose.decide(10.0, {"a": 0.0, "b": 0.0}, {})


def test_operator_floor_is_kept():
    pools = HotPools.even(INST, ("a", "b"), floor={"a": 2})
    _sessions(pools, "b", 40, "i2", 0.0)
    assert pools.decide(10.0, {"a": 0.0, "b": 0.0}, {}) == []
    assert pools.counts() == {"a": 2, "b": 2}
