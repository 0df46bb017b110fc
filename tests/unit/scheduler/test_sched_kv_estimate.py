"""The scheduler charges a call's KV by the router's output estimate, not its max_tokens cap."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sched_driver import make, work
from talaria.services.instance_agent.scheduler import Decode, InvalidWorkError, Prefill


def test_a_large_cap_is_charged_its_expected_output():
    s = make(models=("a",), kv_budget_bytes=1000, initial_model="a")  # 1 byte per token in the test costs
    with pytest.raises(InvalidWorkError):  # by its cap, 100 + 32,000 tokens: more than the budget
        s.submit(work("cap", "a", prompt=100, max_tokens=32_000), 0.0)
    for k in range(8):  # by the estimate, 100 + 50 tokens each
        s.submit(replace(work(f"c{k}", "a", prompt=100, max_tokens=32_000), kv_output_tokens=50), 0.0)
    action = s.next_action(0.0)
    assert isinstance(action, Prefill)
    assert len(action.call_ids) == 1000 // 150  # as many as their expected KV fits, not zero


def test_a_call_the_engine_could_not_step_generated_nothing():
    s = make(models=("a",), initial_model="a")
    s.submit(work("x", "a", max_tokens=3), 0.0)
    s.submit(work("y", "a", max_tokens=3), 0.0)
    pre = s.next_action(0.0)
    assert isinstance(pre, Prefill)
    s.on_prefill_done(pre, 0.1)  # first tokens: 1 each
    dec = s.next_action(0.1)
    assert isinstance(dec, Decode) and set(dec.call_ids) == {"x", "y"}
    s.on_decode_done(dec, 0.2, stalled=["y"])  # `y` waited for a KV page
    assert (s.generated("x"), s.generated("y")) == (2, 1)
    dec = s.next_action(0.2)
    s.on_decode_done(dec, 0.3, stalled=["y"])
    assert s.calls.holding("x") is None and s.generated("y") == 1  # `x` reached max_tokens; `y` did not
