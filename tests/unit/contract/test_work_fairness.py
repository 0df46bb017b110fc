"""Work-fair admission (services/gateway/work_fairness.py): while another tenant is active, a
tenant's long prompts (by predicted prefill work) hold at most its share of the instances;
short calls are never refused by it; alone, a tenant may use every instance."""

from __future__ import annotations

import pytest

from talaria.services.gateway.work_fairness import PrefillRates, WorkFairness
from talaria.shared.messages import CallResult, Timings, Usage


def result(prompt: int, prefill_s: float, decode_s: float = 0.0, cached: int = 0) -> CallResult:
    return CallResult("c", "s", 0, "m", "agent-0", "x", "stop", Usage(prompt, 1, prompt + 1, cached),
                      Timings(prefill_s=prefill_s, decode_s=decode_s))


def test_a_long_prompt_tenant_holds_only_its_share_while_another_tenant_is_active():
    fair = WorkFairness(slack_s=2.0)
    assert fair.admit("b", 0.05, instances=2, now=0.0) is None  # b is active with short calls
    assert fair.admit("a", 30.0, instances=2, now=0.0) is None  # a's first long prompt: its share is 1 of 2
    refused = fair.admit("a", 30.0, instances=2, now=0.0)
    assert refused is not None and refused.status == 429 and refused.code == "over_fair_share"
    assert "~30.0 s of prefill work" in refused.message and "1 of 2" in refused.message
    assert refused.retry_after_s >= 1
    assert fair.admit("a", 0.5, instances=2, now=0.0) is None  # a's short calls still get in
    for _ in range(50):  # and so do b's, however many
        assert fair.admit("b", 0.05, instances=2, now=0.0) is None


def test_the_share_comes_back_when_a_long_call_ends():
    fair = WorkFairness(slack_s=2.0)
    fair.admit("b", 0.05, instances=2, now=0.0)
    fair.admit("a", 30.0, instances=2, now=0.0)
    fair.done("a", 30.0, now=0.0)
    assert fair.admit("a", 30.0, instances=2, now=0.0) is None


def test_alone_a_tenant_may_use_every_instance_and_more():
    fair = WorkFairness(slack_s=2.0)
    for _ in range(4):
        assert fair.admit("a", 60.0, instances=2, now=0.0) is None


def test_shares_grow_with_the_instances():
    fair = WorkFairness(slack_s=2.0)
    fair.admit("b", 0.05, instances=4, now=0.0)
    assert fair.admit("a", 30.0, instances=4, now=0.0) is None
    assert fair.admit("a", 30.0, instances=4, now=0.0) is None  # 2 of 4
    assert fair.admit("a", 30.0, instances=4, now=0.0) is not None


def test_prefill_rates_are_measured_per_model_from_fresh_tokens():
    rates = PrefillRates()
    assert rates.work_s("m", 1000) == 0.0  # nothing measured: nothing charged
    rates.observe("m", result(1100, prefill_s=0.5, cached=100))
    assert rates.work_s("m", 2000) == 1.0


def test_a_tenant_between_two_calls_is_still_active_for_the_window():
    fair = WorkFairness(slack_s=2.0, active_window_s=2.0)
    fair.admit("b", 0.05, instances=2, now=0.0)
    fair.done("b", 0.05, now=1.0)  # b's client sends its next call soon
    fair.admit("a", 30.0, instances=2, now=1.5)
    assert fair.admit("a", 30.0, instances=2, now=2.5) is not None  # b ended 1.5 s ago: still active
    assert fair.admit("a", 30.0, instances=2, now=3.5) is None  # 2.5 s ago: a is alone


def test_the_engines_measured_rate_comes_before_the_answers_average():
    rates = PrefillRates()
    rates.observe("m", result(20, prefill_s=0.1))  # a short call: 5 ms a token, mostly a step's fixed cost
    assert rates.work_s("m", 1000) == pytest.approx(5.0)
    rates.observe_engine("m", 2000.0)  # the engine: 2,000 tokens a second
    assert rates.work_s("m", 1000) == pytest.approx(0.5)
    rates.observe_engine(None, 5000.0)  # a snapshot with no active model says nothing
    assert rates.work_s("m", 1000) == pytest.approx(0.5)


def test_a_long_prompt_is_charged_attention_once_an_engine_measured_its_slope():
    rates = PrefillRates()
    rates.observe_engine("m", 2000.0)
    assert rates.work_s("m", 10_000) == pytest.approx(5.0)
    rates.observe_engine("m", 2000.0, 1e-8)  # 1e-8 s per token per token attended over
    assert rates.work_s("m", 10_000) == pytest.approx(5.0 + 10_000 * 1e-8 * 5_000)


def test_the_slopes_prior_charges_a_long_prompt_until_an_engine_measured_the_slope():
    rates = PrefillRates()
    rates.observe_engine("m", 2000.0, 4e-8, measured=False)  # the architecture's prior
    assert rates.work_s("m", 10_000) == pytest.approx(5.0 + 10_000 * 4e-8 * 5_000)
    rates.observe_engine("m", 2000.0, 1e-8, measured=True)  # a fit replaces it
    rates.observe_engine("m", 2000.0, 4e-8, measured=False)  # another agent's prior: no longer read
    assert rates.work_s("m", 10_000) == pytest.approx(5.0 + 10_000 * 1e-8 * 5_000)
