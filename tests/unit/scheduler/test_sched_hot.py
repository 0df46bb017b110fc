"""Hot pool: one pinned model, plain continuous batching, never a switch."""

from __future__ import annotations

import pytest

from sched_driver import Driver, make, ret, work
from talaria.services.instance_agent.scheduler import CallAdmitted, CallFinished, ConfigError, RoundEnded, ModelNotServedError


def hot(**config):
    return make(models=("a", "b"), pool="hot", pinned_model="a", **config)


def test_hot_pool_never_switches_and_prefills_arrivals_at_each_decode_boundary():
    d = Driver(hot())
    d.submit(work("h1", "a", max_tokens=5))
    d.step(), d.step()
    d.submit(work("h2", "a", max_tokens=3))
    d.submit(ret("h3", "a"))
    d.run()
    assert d.trace[:5] == ["P:a:h1", "D:a:h1", "P:a:h2,h3", "D:a:h1,h2,h3", "D:a:h1,h2,h3"]
    assert not [t for t in d.trace if t.startswith(("S:", "SP:"))]
    assert {e.via for e in d.of(CallAdmitted)} == {"hot"}
    assert d.of(RoundEnded) == []


def test_hot_pool_decodes_between_prefills():
    d = Driver(hot())
    d.submit(work("h1", "a", max_tokens=5))
    d.step()
    d.submit(work("h2", "a", max_tokens=5))
    d.step()
    assert d.trace == ["P:a:h1", "D:a:h1"]  # running work is not starved by arrivals


def test_hot_pool_respects_max_batch():
    d = Driver(hot(max_batch=2))
    for i in range(3):
        d.submit(work(f"h{i}", "a", max_tokens=3))
    d.run()
    assert d.trace[0] == "P:a:h0,h1"
    assert d.trace.index("P:a:h2") > d.trace.index("D:a:h0,h1")


def test_hot_pool_refuses_other_models():
    s = hot()
    with pytest.raises(ModelNotServedError):
        s.submit(work("x", "b"), 0.0)


def test_hot_pool_needs_a_served_pinned_model():
    with pytest.raises(ConfigError):
        make(models=("a",), pool="hot")
    with pytest.raises(ConfigError):
        make(models=("a",), pool="hot", pinned_model="z")


# ---- repin: the router's hot-pool decision (services/router/hot_pools.py) ----------------

def test_repin_finishes_the_old_models_calls_then_switches_and_serves_the_new_one_hot():
    d = Driver(hot())
    d.submit(work("a1", "a", max_tokens=3))
    d.step()
    d.sched.repin("b")
    d.submit(work("a2", "a", max_tokens=2))  # routed before the decision reached the agent
    d.submit(work("b1", "b", max_tokens=3))
    d.run()
    done = [t for t in d.trace if t.startswith("S:")]
    assert done and "b" in done[0]  # it switched to the new pinned model
    assert {e.call_id for e in d.of(CallFinished)} == {"a1", "a2", "b1"}  # nothing refused or lost
    assert d.sched.config.pool == "hot" and d.sched.config.pinned_model == "b"
    assert d.sched._hot_now()  # only b left, b on the device: plain continuous batching again


def test_repin_to_cold_and_unknown_model():
    s = hot()
    s.repin(None)
    assert s.config.pool == "cold" and not s._hot_now()
    s.submit(work("x", "b"), 0.0)  # a cold instance serves every model of its catalogue
    with pytest.raises(ConfigError):
        s.repin("z")
