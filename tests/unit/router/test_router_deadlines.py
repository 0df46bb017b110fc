"""A call that cannot finish by its deadline is refused up front (services/router/deadlines.py):
413 when its own work to a first token, on an idle instance at the measured rates, ends past
MARGIN (2) times the time it has left; 503 with Retry-After when only the work queued ahead
does. Rates: router_support.snap (prefill 1e-4 s/token, decode 1e-2 s/token)."""

from __future__ import annotations

from router_support import call, core, one, snap

from talaria.services.router import deadlines

from talaria.shared.events import DEADLINE_UNREACHABLE, CallFailed, RoutingDecision
from talaria.shared.wire import replace

NO_LEASE = dict(lease_timeout_s=0.0)


def with_deadline(c, deadline_at: float):
    return replace(c, deadline_at=deadline_at)


def test_a_prompt_whose_prefill_alone_outlasts_the_deadline_is_a_413_naming_the_work():
    c = core(**NO_LEASE)
    c.observe(snap("a"), 0.0)
    # 200,000 tokens at 1e-4 s/token: 20 s of prefill, with a deadline in 8 s (20 > 2 x 8)
    out = c.handle(with_deadline(call("long", tokens=200_000, at=0.0), 8.0), 0.0)
    decision, failed = one(out, RoutingDecision), one(out, CallFailed)
    assert decision.action == "reject" and decision.status == failed.status == DEADLINE_UNREACHABLE
    assert decision.retry_after_s is None and "20.0 s to prefill 200000 prompt tokens" in decision.reason
    assert "first token" in decision.reason


def test_a_miss_within_the_margin_is_left_to_the_agent():
    c = core(**NO_LEASE)
    c.observe(snap("a"), 0.0)
    # 20 s predicted against 12 s left: the rates may be off by 2x either way
    out = c.handle(with_deadline(call("long", tokens=200_000, at=0.0), 12.0), 0.0)
    assert one(out, RoutingDecision).chosen == "a"


def test_work_queued_ahead_past_the_deadline_is_a_retryable_503():
    c = core(**NO_LEASE, overload="queue")
    c.observe(snap("a", queued={"m1": 3}, queued_prefill_s=8.0), 0.0)
    out = c.handle(with_deadline(call("c", tokens=10_000, at=0.0), 4.0), 0.0)  # 1 s alone, 9 s behind the queue
    decision = one(out, RoutingDecision)
    assert decision.action == "reject" and decision.status == 503 and decision.retry_after_s
    assert "8.0 s of work queued ahead" in decision.reason


def test_a_call_without_a_deadline_is_never_refused_for_time():
    c = core(**NO_LEASE)
    c.observe(snap("a"), 0.0)
    assert one(c.handle(call("long", tokens=200_000, at=0.0), 0.0), RoutingDecision).chosen == "a"


def test_a_long_max_tokens_is_a_cap_not_a_reason_to_refuse():
    c = core(**NO_LEASE)
    c.observe(snap("a"), 0.0)
    # 4,000 tokens at 1e-2 s/token would be 40 s of decode; the call may stop long before
    out = c.handle(with_deadline(call("c", tokens=100, max_tokens=4000, at=0.0), 10.0), 0.0)
    assert one(out, RoutingDecision).chosen == "a"


def test_attention_s_growth_with_context_makes_a_linearly_feasible_prompt_a_413():
    # 50,000 tokens at 1e-4 s/token: 5 s linearly, well within 2 x 8 s. With the slope the
    # agents measured (1e-8 s per token per token attended over: 12.5 s more at a mean
    # context of 25,000), 17.5 s: past it.
    c = core(**NO_LEASE)
    c.observe(replace(snap("a"), prefill_ctx_s_per_tok2=1e-8), 0.0)
    out = c.handle(with_deadline(call("long", tokens=50_000, at=0.0), 8.0), 0.0)
    decision = one(out, RoutingDecision)
    assert decision.action == "reject" and decision.status == DEADLINE_UNREACHABLE
    assert "17.5 s to prefill 50000 prompt tokens" in decision.reason
    # The same prompt, before any slope was measured, is placed.
    c = core(**NO_LEASE)
    c.observe(snap("a"), 0.0)
    assert one(c.handle(with_deadline(call("long", tokens=50_000, at=0.0), 8.0), 0.0), RoutingDecision).chosen == "a"


def test_the_margin_is_each_instances_measured_overstatement_and_MARGIN_before_one():
    # 200,000 tokens at 1e-4 s/token: 20 s of prefill against 12 s left.
    long = with_deadline(call("long", tokens=200_000, at=0.0), 12.0)
    # Its prices were measured right (9 in 10 chunked prefills took at least their price):
    # 20 s is a miss, refused now rather than dropped by the agent later.
    c = core(**NO_LEASE)
    c.observe(replace(snap("a"), prefill_overstatement=1.0), 0.0)
    decision = one(c.handle(long, 0.0), RoutingDecision)
    assert decision.action == "reject" and decision.status == DEADLINE_UNREACHABLE
    # Its prices run 3x over what its prefills took: 20 s priced is ~7 s, within 12 s.
    c = core(**NO_LEASE)
    c.observe(replace(snap("a"), prefill_overstatement=3.0), 0.0)
    assert one(c.handle(long, 0.0), RoutingDecision).chosen == "a"
    # Not measured (0): MARGIN, 2 x 12 s > 20 s.
    assert deadlines.margin(0.0) == deadlines.MARGIN
    c = core(**NO_LEASE)
    c.observe(snap("a"), 0.0)
    assert one(c.handle(long, 0.0), RoutingDecision).chosen == "a"
    # Its prices run under (0.5: prefills took twice their price): 10 s priced is a 20 s miss.
    c = core(**NO_LEASE)
    c.observe(replace(snap("a"), prefill_overstatement=0.5), 0.0)
    short = with_deadline(call("short", tokens=100_000, at=0.0), 12.0)
    assert one(c.handle(short, 0.0), RoutingDecision).status == DEADLINE_UNREACHABLE


def test_each_instance_is_judged_by_its_own_overstatement():
    c = core(**NO_LEASE)
    c.observe(replace(snap("exact"), prefill_overstatement=1.0), 0.0)
    c.observe(replace(snap("over"), prefill_overstatement=3.0), 0.0)
    # 20 s priced on both, 12 s left: only where prices run 3x over does it come in time
    assert one(c.handle(with_deadline(call("long", tokens=200_000, at=0.0), 12.0), 0.0), RoutingDecision).chosen == "over"


def test_a_measured_slope_replaces_the_architectures_prior():
    c = core(**NO_LEASE)
    # an agent that has not established its fit reports the prior: it prices (17.5 s > 2 x 8 s)
    c.observe(replace(snap("a"), prefill_ctx_s_per_tok2=1e-8, prefill_ctx_measured=False), 0.0)
    assert one(c.handle(with_deadline(call("p", tokens=50_000, at=0.0), 8.0), 0.0), RoutingDecision).status == 413
    # another measured the slope 10x lower: 6.25 s, placed, though the first still says its prior
    c.observe(replace(snap("b"), prefill_ctx_s_per_tok2=1e-9, prefill_ctx_measured=True), 0.0)
    c.observe(replace(snap("a", version=2), prefill_ctx_s_per_tok2=1e-8, prefill_ctx_measured=False), 0.0)
    assert one(c.handle(with_deadline(call("q", tokens=50_000, at=0.0), 8.0), 0.0), RoutingDecision).action != "reject"
