"""Per-call costs and the EWMA calibration from measured steps."""

from __future__ import annotations

import math

from sched_driver import COSTS, Driver, make, ret, work
from talaria.services.instance_agent.scheduler import CalibratedCosts, StepCostModel, Decode, LinearCosts, Prefill
from talaria.services.instance_agent.scheduler.costs import call_prefill_s, charged_kv


def test_linear_costs_satisfy_the_protocol():
    assert isinstance(COSTS, StepCostModel)
    assert isinstance(CalibratedCosts(COSTS), StepCostModel)


def test_per_call_cost_depends_on_where_the_prefix_lives():
    device = ret("d", kv="device", prompt=10_000, reuse=9_000)
    host = ret("h", kv="host", prompt=10_000, reuse=9_000)
    cold = work("n", prompt=10_000)
    assert math.isclose(call_prefill_s(COSTS, device, True), 1_000 / 100_000)
    assert math.isclose(call_prefill_s(COSTS, host, True), 9_000 / 1_000_000 + 1_000 / 100_000)
    assert math.isclose(call_prefill_s(COSTS, host, False), call_prefill_s(COSTS, cold, True))
    assert charged_kv(host, hkvr=False) == "none" and charged_kv(device, hkvr=False) == "device"


def test_fully_reused_prompt_still_computes_one_token():
    full = ret("f", kv="device", prompt=1_000, reuse=1_000)
    assert call_prefill_s(COSTS, full, True) == COSTS.prefill_s("a", 1, 1_000)


def test_ewma_moves_the_factor_towards_the_measured_ratio():
    costs = CalibratedCosts(LinearCosts(decode_base_s=0.01), alpha=0.5)
    predicted = costs.decode_step_s("a", 1, 0)
    costs.observe("decode", "a", predicted, 2 * predicted)
    assert math.isclose(costs.decode_step_s("a", 1, 0), 0.015)
    costs.observe("decode", "a", costs.decode_step_s("a", 1, 0), 0.02)
    assert math.isclose(costs.decode_step_s("a", 1, 0), 0.0175)
    assert costs.decode_step_s("b", 1, 0) == 0.01  # per model


def test_switch_estimate_follows_measured_switches_per_path():
    costs = CalibratedCosts(LinearCosts(switch_staged_s=1.0, switch_host_s=1.5), alpha=0.5)
    costs.observe_switch("a", "b", True, 0.2)
    assert costs.switch_s("a", "b", True) == 0.2  # first measurement replaces the profile
    costs.observe_switch("a", "b", True, 0.4)
    assert math.isclose(costs.switch_s("a", "b", True), 0.3)
    assert costs.switch_s("a", "b", False) == 1.5 and costs.switch_s("b", "a", True) == 1.0


def test_scheduler_calibrates_from_the_steps_it_is_told_about():
    d = Driver(make(models=("a",), initial_model="a"), slowdown=2.0)
    d.submit(work("a1", "a", max_tokens=40))
    before = d.sched.costs.decode_step_s("a", 1, 100)
    d.run()
    after = d.sched.costs.decode_step_s("a", 1, 100)
    assert 1.8 * before < after <= 2.0 * before
    assert d.sched.costs.factors[("prefill", "a")] > 1.0


def test_estimate_prices_each_action_kind():
    s = make(models=("a",), initial_model="a")
    s.submit(work("a1", "a", prompt=5_000, max_tokens=3), 0.0)
    prefill = s.next_action(0.0)
    assert isinstance(prefill, Prefill) and math.isclose(s.estimate_s(prefill), 0.05)
    s.on_prefill_done(prefill, 0.05)
    decode = s.next_action(0.05)
    assert isinstance(decode, Decode) and math.isclose(s.estimate_s(decode), 0.01)
