"""Soft reservation, step by step with an injected clock (paper §3.3, §4.1)."""

from __future__ import annotations

import pytest
from router_support import call, core, done, one, snap

from talaria.services.router.leases import LeaseBook
from talaria.shared.events import (
    CallRouted,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    LeaseIssued,
    RoutingDecision,
)

TAU = 1.0


def served_once(t: float = 9.0, **config):
    """Two idle instances heard from at `t`; s1's first call routed to `a` at `t`."""
    c = core(**config)
    c.observe(snap("a", at=t), t)
    c.observe(snap("b", at=t), t)
    routed = one(c.handle(call("c0", at=t), t), CallRouted)
    assert routed.instance_id == "a"
    return c


def test_routing_never_installs_a_lease_only_completion_does():
    c = served_once()
    assert c.state.sessions["s1"].lease is None
    issued = one(c.handle(done("c0", "a", at=10.0), 10.0), LeaseIssued)
    assert (issued.instance_id, issued.issued_at, issued.expires_at) == ("a", 10.0, 10.0 + TAU)
    assert c.state.leases_on("a", 10.0) == 1


def test_return_consumes_lease_even_when_instance_is_busier():
    c = served_once()
    c.handle(done("c0", "a", at=10.0), 10.0)
    # a is now much busier than b, and reports s1's KV on device
    c.observe(snap("a", version=2, at=10.1, queued_tokens=20_000, sessions=[("s1", "m1", "device", 1010)]), 10.1)
    out = c.handle(call("c1", at=10.5), 10.5)
    assert one(out, LeaseConsumed).instance_id == "a"
    assert one(out, CallRouted).instance_id == "a"
    audit = one(out, RoutingDecision)
    assert (audit.lease_outcome, audit.lease_instance) == ("consumed", "a")
    assert audit.candidates[0].kv_state == "device"
    assert c.state.sessions["s1"].lease is None and c.state.leases_on("a", 10.5) == 0


def _rotating_home(b_models, b_active, b_queued=None):
    """s1 served at `a`, lease live; then `a` rotates m2 (active, work queued) with m1 (s1's KV
    on host there), and `b` reports `b_models` with `b_active` active."""
    c = served_once(price_round_sharing=True)
    c.handle(done("c0", "a", at=10.0), 10.0)
    c.observe(snap("a", version=2, at=10.1, models={"m1": "resident", "m2": "active"}, active="m2",
                   queued={"m2": 1}, sessions=[("s1", "m1", "host", 1010)]), 10.1)
    c.observe(snap("b", version=2, at=10.1, models=b_models, active=b_active, queued=b_queued), 10.1)
    return c, c.handle(call("c1", at=10.5), 10.5)


def test_a_lease_does_not_hold_a_session_in_a_rotation_where_its_model_runs_alone_elsewhere():
    # At a, every later call of s1 waits through m2's slot and a switch; b runs m1 alone:
    # recomputing 1,000 tokens there once is cheaper than that stretch, so s1 leaves.
    c, out = _rotating_home({"m1": "active"}, "m1")
    assert one(out, CallRouted).instance_id == "b"
    audit = one(out, RoutingDecision)
    assert (audit.lease_outcome, audit.lease_instance, audit.discard_reason) == \
        ("discarded", "a", "rotation_elsewhere_cheaper")
    assert one(out, LeaseDiscarded).reason == "rotation_elsewhere_cheaper"
    assert {x.instance_id for x in audit.candidates} == {"a", "b"}


def test_a_lease_holds_where_the_other_instance_rotates_more():
    # b runs m1 now but rotates m2 and m3 with it: leaving would stretch every later call more.
    c, out = _rotating_home({"m1": "active", "m2": "resident", "m3": "resident"}, "m1", {"m2": 1, "m3": 1})
    assert one(out, LeaseConsumed).instance_id == "a"
    assert one(out, CallRouted).instance_id == "a"


def test_a_lease_leaves_a_rotation_only_for_an_instance_where_its_model_already_has_a_slot():
    # b holds m1's weights but runs nothing: cheaper for s1, yet moving there would add m1 to
    # b's rounds and trade one rotation for another, so the lease holds (slots consolidate).
    c, out = _rotating_home({"m1": "resident"}, None)
    assert one(out, LeaseConsumed).instance_id == "a"
    assert one(out, CallRouted).instance_id == "a"


def test_host_restorable_prefix_also_consumes():
    c = served_once()
    c.handle(done("c0", "a", at=10.0), 10.0)
    c.observe(snap("a", version=2, at=10.2, sessions=[("s1", "m1", "host", 1010)]), 10.2)
    out = c.handle(call("c1", at=10.4), 10.4)
    assert one(out, LeaseConsumed).instance_id == "a"
    assert one(out, RoutingDecision).expected_kv == "host"


def test_routing_does_not_refresh_lease_successor_comes_from_next_completion():
    c = served_once()
    c.handle(done("c0", "a", at=10.0), 10.0)
    c.handle(call("c1", at=10.5), 10.5)
    assert c.state.sessions["s1"].lease is None  # consumed, not renewed
    assert c.tick(100.0) == []
    issued = one(c.handle(done("c1", "a", index=1, at=12.0), 12.0), LeaseIssued)
    assert issued.expires_at == 13.0


def test_expiry_is_exclusive_at_exactly_tau():
    c = served_once()
    c.handle(done("c0", "a", at=10.0), 10.0)
    lease = c.state.sessions["s1"].lease
    assert lease.live(10.999) and not lease.live(11.0)
    assert c.tick(10.999) == []
    expired = one(c.tick(11.0), LeaseExpired)
    assert (expired.session_id, expired.instance_id, expired.at) == ("s1", "a", 11.0)
    assert c.state.sessions["s1"].lease is None and c.state.leases_on("a", 11.0) == 0
    assert c.tick(12.0) == []  # expired once only


def test_return_at_exactly_tau_discards_as_expired_and_places_normally():
    c = served_once()
    c.handle(done("c0", "a", at=10.0), 10.0)
    c.observe(snap("a", version=2, at=10.5, queued_tokens=50_000), 10.5)
    out = c.handle(call("c1", at=11.0), 11.0)  # no tick in between
    assert one(out, LeaseDiscarded).reason == "expired"
    audit = one(out, RoutingDecision)
    assert (audit.lease_outcome, audit.discard_reason) == ("discarded", "expired")
    assert one(out, CallRouted).instance_id == "b"  # normal placement: a is loaded


def test_discard_model_changed():
    c = served_once()
    c.handle(done("c0", "a", at=10.0), 10.0)
    c.observe(snap("a", version=2, at=10.1, models={"m1": "active", "m2": "resident"}), 10.1)
    out = c.handle(call("c1", model="m2", at=10.2), 10.2)
    assert one(out, LeaseDiscarded).reason == "model_changed"
    assert one(out, RoutingDecision).lease_outcome == "discarded"


def test_discard_instance_gone():
    c = served_once()
    c.handle(done("c0", "a", at=10.0), 10.0)
    c.lose(c.state.instances["a"], "gone", 10.1)
    out = c.handle(call("c1", at=10.2), 10.2)
    assert one(out, LeaseDiscarded).reason == "instance_gone"
    assert one(out, CallRouted).instance_id == "b"


def test_discard_instance_unhealthy_beyond_twice_stale():
    c = served_once(0.0, stale_after_s=2.0, lease_timeout_s=10.0)
    c.handle(done("c0", "a", at=1.0), 1.0)
    c.observe(snap("b", version=2, at=4.5), 4.5)
    out = c.handle(call("c1", at=4.5), 4.5)  # a last heard at 0.0: 4.5 > 2 * 2.0
    assert one(out, LeaseDiscarded).reason == "instance_unhealthy"
    assert one(out, CallRouted).instance_id == "b"


def test_stale_instance_still_answering_honours_its_lease():
    c = served_once(0.0, stale_after_s=2.0, lease_timeout_s=10.0)
    c.handle(done("c0", "a", at=1.0), 1.0)
    c.observe(snap("b", version=2, at=3.0), 3.0)
    out = c.handle(call("c1", at=3.0), 3.0)  # a is 3.0 s old: stale (> 2) but answers (<= 4)
    assert one(out, LeaseConsumed).instance_id == "a"
    # ... while a new session is not placed there
    audit = one(c.handle(call("n1", session="s2", at=3.0), 3.0), RoutingDecision)
    assert audit.chosen == "b"
    assert {x.instance_id: x.reason for x in audit.candidates}["a"] == "stale"


def test_discard_kv_missing_when_fresh_snapshot_no_longer_lists_prefix():
    c = served_once()
    c.handle(done("c0", "a", at=10.0), 10.0)
    c.observe(snap("a", version=2, at=10.3, sessions=[]), 10.3)  # after completion, KV evicted
    out = c.handle(call("c1", at=10.4), 10.4)
    assert one(out, LeaseDiscarded).reason == "kv_missing"


def test_discard_hot_pool_pinned_elsewhere():
    c = served_once()
    c.handle(done("c0", "a", at=10.0), 10.0)
    c.observe(snap("a", version=2, at=10.1, pool="hot", active="m2", models={"m2": "active", "m1": "absent"},
                   sessions=[("s1", "m1", "host", 1010)]), 10.1)
    out = c.handle(call("c1", at=10.2), 10.2)
    assert one(out, LeaseDiscarded).reason == "hot_pool_pinned"
    assert one(out, CallRouted).instance_id == "b"


def test_live_lease_charges_one_admission_unit():
    c = served_once(lease_charge_s=0.5)
    c.handle(done("c0", "a", at=10.0), 10.0)
    audit = one(c.handle(call("n1", session="s2", at=10.1), 10.1), RoutingDecision)
    by = {x.instance_id: x for x in audit.candidates}
    assert by["a"].reserved_s == pytest.approx(0.5) and by["b"].reserved_s == 0.0
    assert by["a"].queue_s == 0.0  # reserved, not queued: the audit compares queue_s with the queue met
    assert audit.chosen == "b"


def test_session_own_lease_is_not_charged_against_itself_when_discarded():
    c = served_once(lease_charge_s=0.5)
    c.handle(done("c0", "a", at=10.0), 10.0)
    # Fresh snapshots: a stale `a` would be priced infeasible with reserved_s 0 whatever the
    # lease rule (issue 26: this test once passed that way while the rule was broken).
    c.observe(snap("a", version=2, at=11.5), 11.5)
    c.observe(snap("b", version=2, at=11.5), 11.5)
    out = c.handle(call("c1", model="m1", at=11.5), 11.5)  # expired: discarded, not yet ticked
    by = {x.instance_id: x for x in one(out, RoutingDecision).candidates}
    assert by["a"].feasible  # priced, not ruled out
    assert by["a"].reserved_s == 0.0  # the lease was dead anyway; nothing charged


def test_no_lease_for_a_completion_overtaken_by_a_newer_call_or_redelivered():
    c = served_once()
    c.handle(call("c1", at=9.5), 9.5)  # a second call of s1 already routed
    assert c.handle(done("c0", "a", at=10.0), 10.0) == []
    events = c.handle(done("c1", "a", index=1, at=11.0), 11.0)
    assert one(events, LeaseIssued).call_id == "c1"
    assert c.handle(done("c1", "a", index=1, at=11.0), 11.0) == []  # redelivered


def test_tau_zero_issues_no_lease():
    c = served_once(lease_timeout_s=0.0)
    assert c.handle(done("c0", "a", at=10.0), 10.0) == []


def test_adaptive_lease_uses_p90_of_session_gaps_clamped():
    c = core(adaptive_lease=True, lease_margin_s=0.0, lease_min_s=0.25, lease_max_s=5.0)
    c.observe(snap("a"), 0.0)
    t, gaps = 0.0, [0.3, 0.5, 0.7, 2.0]
    for i, gap in enumerate([0.0, *gaps]):
        t += gap
        c.observe(snap("a", version=i + 2, at=t), t)
        one(c.handle(call(f"c{i}", at=t), t), CallRouted)
        t += 1.0
        issued = one(c.handle(done(f"c{i}", "a", index=i, at=t), t), LeaseIssued)
    # nearest-rank p90 of [0.3, 0.5, 0.7, 2.0] is 2.0
    assert issued.expires_at - issued.issued_at == pytest.approx(2.0)
    assert c.state.sessions["s1"].gaps == pytest.approx(gaps)


def test_adaptive_lease_falls_back_to_fixed_tau_without_history():
    c = core(adaptive_lease=True, lease_timeout_s=0.8)
    c.observe(snap("a"), 0.0)
    c.handle(call("c0"), 0.0)
    issued = one(c.handle(done("c0", "a", at=1.0), 1.0), LeaseIssued)
    assert issued.expires_at == pytest.approx(1.8)


def test_adaptive_lease_clamps_to_bounds():
    c = core(adaptive_lease=True, lease_margin_s=0.0, lease_min_s=0.25, lease_max_s=1.5)
    c.observe(snap("a"), 0.0)
    t = 0.0
    for i in range(5):
        c.observe(snap("a", version=i + 2, at=t), t)
        one(c.handle(call(f"c{i}", at=t), t), CallRouted)
        t += 1.0
        issued = one(c.handle(done(f"c{i}", "a", index=i, at=t), t), LeaseIssued)
        t += 9.0  # gaps of 9 s
    assert issued.expires_at - issued.issued_at == pytest.approx(1.5)


def test_lease_book_due_is_read_only_and_prunes_consumed_entries():
    book = LeaseBook()
    for i, exp in enumerate([3.0, 1.0, 2.0, 5.0]):
        book.add(LeaseIssued(f"s{i}", "m1", "a", f"c{i}", 0.0, exp))
    assert [lease.session_id for lease in book.due(2.0)] == ["s1", "s2"]
    assert len(book.heap) == 4 and book.live_on("a", 2.0) == 2  # due() changed nothing
    book.remove("s1")
    assert book.live_on("a", 0.5) == 3 and book.live_for("m1", 0.5) == 3
    assert [lease.session_id for lease in book.due(10.0)] == ["s2", "s0", "s3"]
    assert len(book.heap) == 3  # the consumed entry was at the top and got pruned


def test_a_discarded_lease_is_gone_from_the_state_and_charges_nothing():
    # Pinned by issue 15: a fold that kept the discarded lease went unnoticed.
    c = served_once()
    c.handle(done("c0", "a", at=10.0), 10.0)
    assert c.state.leases.live_on("a", 10.0) == 1
    c.observe(snap("a", version=2, at=10.1, models={"m1": "active", "m2": "resident"}), 10.1)
    out = c.handle(call("c1", model="m2", at=10.2), 10.2)
    assert one(out, LeaseDiscarded).reason == "model_changed"
    assert c.state.sessions["s1"].lease is None
    assert c.state.leases.live_on("a", 10.2) == 0 and c.state.leases.live_for("m1", 10.2) == 0
    # The session's next call finds no lease to consume or discard again.
    audit = one(c.handle(call("c2", model="m1", at=10.3), 10.3), RoutingDecision)
    assert audit.lease_outcome == "none"
