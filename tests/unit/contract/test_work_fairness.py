"""Work-fair admission (services/gateway/work_fairness.py): a virtual token counter per
tenant in seconds of prefill work; one tenant's long prompts take at most one share of the
instances while another tenant is active, and all of them when it is alone."""

from __future__ import annotations

from talaria.services.gateway.work_fairness import PrefillRates, WorkFairness
from talaria.shared.messages import CallResult, Timings, Usage


def result(prompt: int, prefill_s: float, decode_s: float = 0.0, cached: int = 0) -> CallResult:
    return CallResult("c", "s", 0, "m", "agent-0", "x", "stop", Usage(prompt, 1, prompt + 1, cached),
                      Timings(prefill_s=prefill_s, decode_s=decode_s))


def test_a_long_prompt_tenant_gets_one_call_in_while_another_tenant_is_active():
    fair = WorkFairness(slack_s=2.0)
    assert fair.admit("b", 0.05, instances=2) is None  # b is active with short calls
    assert fair.admit("a", 60.0, instances=2) is None  # a's first long prompt: a is at b's level
    refused = fair.admit("a", 60.0, instances=2)  # its second: 60 s of work ahead of b
    assert refused is not None and refused.status == 429 and refused.code == "over_fair_share"
    assert "60.0 s of prefill work" in refused.message and refused.retry_after_s >= 1
    for _ in range(50):  # b keeps getting in, however many calls it has in flight
        assert fair.admit("b", 0.05, instances=2) is None


def test_alone_a_tenant_may_use_every_instance():
    fair = WorkFairness(slack_s=2.0)
    for _ in range(4):
        assert fair.admit("a", 60.0, instances=2) is None


def test_uncontended_work_is_never_refused():
    fair = WorkFairness(slack_s=2.0)  # 4 s of work fit two instances' slack
    assert fair.admit("b", 0.5, instances=2) is None
    assert fair.admit("a", 1.0, instances=2) is None
    assert fair.admit("a", 1.0, instances=2) is None  # 2.5 s in flight <= 4 s: not contended


def test_two_heavy_tenants_alternate():
    fair = WorkFairness(slack_s=2.0)
    assert fair.admit("a", 60.0, instances=2) is None
    assert fair.admit("c", 60.0, instances=2) is None  # lifted to a's counter, then charged
    assert fair.admit("a", 60.0, instances=2) is None  # a was 60 s behind c
    assert fair.admit("a", 60.0, instances=2) is None  # a was level with c
    assert fair.admit("a", 60.0, instances=2) is not None  # a is 60 s ahead of c
    assert fair.admit("c", 60.0, instances=2) is None  # c's turn


def test_idle_time_banks_no_credit_and_the_estimate_is_corrected_by_what_was_measured():
    fair = WorkFairness(slack_s=2.0)
    fair.admit("b", 10.0, instances=1)
    fair.done("b", 10.0, result(100, prefill_s=30.0, decode_s=5.0))  # it really took 35 s
    assert fair.counters["b"] == 35.0 and not fair.in_flight
    fair.admit("c", 1.0, instances=1)
    fair.admit("a", 0.0, instances=1)  # a arrives after c has work: lifted to c's counter
    assert fair.counters["a"] == fair.counters["c"] == 1.0


def test_prefill_rates_are_measured_per_model_from_fresh_tokens():
    rates = PrefillRates()
    assert rates.work_s("m", 1000) == 0.0  # nothing measured: nothing charged
    rates.observe("m", result(1100, prefill_s=0.5, cached=100))
    assert rates.work_s("m", 2000) == 1.0
