"""Hot pool: one pinned model, plain continuous batching, never a switch."""

from __future__ import annotations

import pytest

from sched_driver import Driver, make, ret, work
from talaria.services.instance_agent.scheduler import CallAdmitted, ConfigError, RoundEnded, ModelNotServedError


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
