"""The online output-length estimate: what the router prices and admits calls by, never max_tokens."""

import pytest

from talaria.services.router.output_estimate import KV_QUANTILE, MODEL_KEEP, OutputEstimator
from talaria.services.router.state import RouterState
from talaria.shared.events import RoutingDecision

from tests.unit.router.router_support import call, core, done, one, snap

NO_LEASE = dict(lease_timeout_s=0.0)


def by_instance(audit):
    return {c.instance_id: c for c in audit.candidates}


def test_before_any_completion_the_cap_is_all_there_is():
    est = OutputEstimator()
    assert est.expected("s", "m", 256) == 256.0
    assert est.kv_tokens("s", "m", 32_000) == 32_000


def test_a_new_session_is_priced_by_its_model_s_history_capped_by_its_max_tokens():
    est = OutputEstimator()
    for n in (10, 20, 30, 40):
        est.observe("old", "m", n)
    assert est.expected("new", "m", 32_000) == pytest.approx(25.0)  # the model's mean
    assert est.expected("new", "m", 16) == 16.0  # never above the cap
    assert est.expected("new", "other", 500) == 500.0  # another model's history says nothing


def test_a_session_s_own_outputs_outweigh_the_model_prior():
    est = OutputEstimator()
    for k in range(50):
        est.observe(f"o{k}", "m", 20)
    for _ in range(3):
        est.observe("long", "m", 1000)
    # the session's 3 outputs plus the model's mean as one more observation
    prior = (50 * 20 + 3 * 1000) / 53
    assert est.expected("long", "m", 32_000) == pytest.approx((3000 + prior) / 4)
    assert est.expected("fresh", "m", 32_000) == pytest.approx(prior)


def test_kv_is_admitted_for_a_high_quantile_not_the_mean():
    est = OutputEstimator()
    for n in range(1, 101):  # outputs 1..100
        est.observe(f"s{n}", "m", n)
    q = est.kv_tokens("new", "m", 32_000)
    assert q == round(KV_QUANTILE * 100) and q > est.expected("new", "m", 32_000)
    est.observe("big", "m", 400)  # a session that once produced more is admitted for that
    assert est.kv_tokens("big", "m", 32_000) == 400
    assert est.kv_tokens("big", "m", 300) == 300  # ... never beyond its cap


def test_the_model_window_forgets_old_outputs():
    est = OutputEstimator()
    for k in range(MODEL_KEEP):
        est.observe(f"a{k}", "m", 1000)
    for k in range(MODEL_KEEP):
        est.observe(f"b{k}", "m", 10)
    assert est.expected("new", "m", 32_000) == pytest.approx(10.0)


def test_an_empty_output_is_not_evidence():
    est = OutputEstimator()
    est.observe("s", "m", 0)
    assert est.expected("s", "m", 64) == 64.0


def test_the_estimate_survives_the_projection_round_trip():
    state = RouterState()
    for k, n in enumerate((5, 50, 500)):
        state.outputs.observe("s", "m", n)
    back = RouterState.from_dict(state.to_dict())
    assert back.outputs.to_dict() == state.outputs.to_dict()
    assert back.outputs.expected("s", "m", 10_000) == state.outputs.expected("s", "m", 10_000)


def test_the_router_folds_completions_into_the_estimate_and_prices_decode_by_it():
    c = core(**NO_LEASE)
    c.observe(snap("a"), 0.0)
    c.handle(call("c0", session="s1"), 0.0)
    c.handle(done("c0", "a", session="s1", output=40, decode_s=0.4, at=1.0), 1.0)  # 10 ms / token
    audit = one(c.handle(call("c1", session="s2", max_tokens=32_000, at=1.0), 1.0), RoutingDecision)
    assert by_instance(audit)["a"].decode_s == pytest.approx(40 * 1e-2)  # not 32,000 tokens


def test_a_32k_cap_on_a_131k_context_is_admitted_for_what_it_will_use():
    # KV pool of 131,072 tokens with 80,000 held by running calls: prompt + 32,000 would not
    # fit, but the model's calls produce ~100 tokens, so the call is placed, not refused.
    c = core(**NO_LEASE)
    c.observe(snap("a", kv_capacity_tokens=131_072, kv_used_tokens=80_000, running=2), 0.0)
    for k in range(20):
        c.handle(call(f"w{k}", session=f"w{k}"), 0.0)
        c.handle(done(f"w{k}", "a", session=f"w{k}", output=100, at=0.5), 0.5)
    c.observe(snap("a", version=2, kv_capacity_tokens=131_072, kv_used_tokens=80_000, running=2), 0.5)
    routed = c.handle(call("big", session="cc", tokens=25_000, max_tokens=32_000, at=0.5), 0.5)
    audit = one(routed, RoutingDecision)
    assert audit.action == "route" and audit.chosen == "a"
    assert by_instance(audit)["a"].feasible
    placed = [e for e in routed if type(e).__name__ == "CallRouted"][0]
    assert placed.kv_output_tokens == 100  # the agent reserves KV for this many, not 32,000
