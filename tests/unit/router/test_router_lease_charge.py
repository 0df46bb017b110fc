"""A session's own lease and the lease charge (issue 26).

A live lease charges one admission unit (lease_charge_s) against its instance; the session
that holds it is not charged for its own. Only a *live* own lease is left out: one that has
expired but whose LeaseExpired is not folded yet is no longer counted at all, so leaving it
out again made reserved_s negative, and a negative queue skipped round admission.

Every snapshot here is fresh when the call is priced, so staleness cannot mask the charge.
"""

from __future__ import annotations

import pytest
from router_support import call, core, done, one, snap

from talaria.shared.events import CallRouted, LeaseDiscarded, RoutingDecision


def lease_on_a(charge: float = 0.5, **a_snapshot):
    """s1 served on `a` (lease on a expiring at 11.0); at 11.5 both instances report afresh."""
    c = core(lease_charge_s=charge)
    c.observe(snap("a", at=9.0), 9.0)
    c.observe(snap("b", at=9.0), 9.0)
    assert one(c.handle(call("c0", at=9.0), 9.0), CallRouted).instance_id == "a"
    c.handle(done("c0", "a", at=10.0), 10.0)
    assert c.state.sessions["s1"].lease.expires_at == 11.0
    c.observe(snap("a", version=2, at=11.5, **a_snapshot), 11.5)
    c.observe(snap("b", version=2, at=11.5), 11.5)
    return c


def test_an_expired_unfolded_own_lease_is_not_subtracted_from_the_charge():
    c = lease_on_a()
    # c1 comes after tau, before the tick that folds LeaseExpired: the lease is still held.
    assert c.state.sessions["s1"].lease is not None and c.state.leases.live_on("a", 11.5) == 0
    out = c.handle(call("c1", at=11.5), 11.5)
    assert one(out, LeaseDiscarded).reason == "expired"
    by = {x.instance_id: x for x in one(out, RoutingDecision).candidates}
    assert by["a"].feasible and by["a"].reason == ""  # fresh: priced, not ruled out
    assert by["a"].reserved_s == 0.0 and by["b"].reserved_s == 0.0


def test_an_expired_own_lease_does_not_open_round_admission():
    # a has 0.3 s of prefill queued; c1's 100k-token prompt needs 10 s there (budget 9 s):
    # a must fail admission. A reserved_s of -0.5 made the queue -0.2 and skipped the check.
    c = lease_on_a(queued_prefill_s=0.3)
    out = c.handle(call("c1", tokens=100_000, at=11.5), 11.5)
    by = {x.instance_id: x for x in one(out, RoutingDecision).candidates}
    assert by["a"].queue_s == pytest.approx(0.3) and by["a"].reserved_s == 0.0
    assert (by["a"].feasible, by["a"].reason) == (False, "round_admission")
    assert one(out, CallRouted).instance_id == "b"


def test_a_live_own_lease_is_left_out_of_its_own_charge_and_charged_to_others():
    c = core(lease_charge_s=0.5)
    models = {"m1": "active", "m2": "resident"}
    c.observe(snap("a", at=9.0, models=models), 9.0)
    c.observe(snap("b", at=9.0, models=models), 9.0)
    c.handle(call("c0", at=9.0), 9.0)
    c.handle(done("c0", "a", at=10.0), 10.0)  # s1's lease on a, live until 11.0
    # s1 returns with another model: its lease is discarded (model_changed) but, live, it
    # is counted on a, and s1 does not pay for its own lease.
    own = one(c.handle(call("c1", model="m2", at=10.5), 10.5), RoutingDecision)
    assert own.discard_reason == "model_changed"
    assert {x.instance_id: x.reserved_s for x in own.candidates} == {"a": 0.0, "b": 0.0}


def test_another_session_pays_a_live_lease():
    c = lease_on_a()
    c.handle(call("c1", at=11.5), 11.5)
    c.handle(done("c1", "a", index=1, at=12.0), 12.0)  # s1's successor lease, live until 13.0
    other = one(c.handle(call("n1", session="s2", at=12.5), 12.5), RoutingDecision)
    assert {x.instance_id: x.reserved_s for x in other.candidates} == {"a": 0.5, "b": 0.0}


def test_an_own_lease_expiring_exactly_now_is_neither_counted_nor_left_out():
    c = core(lease_charge_s=0.5)
    c.observe(snap("a", at=9.0), 9.0)
    c.observe(snap("b", at=9.0), 9.0)
    c.handle(call("c0", at=9.0), 9.0)
    c.handle(done("c0", "a", at=10.0), 10.0)  # expires at 11.0
    c.observe(snap("a", version=2, at=11.0), 11.0)
    c.observe(snap("b", version=2, at=11.0), 11.0)
    out = c.handle(call("c1", at=11.0), 11.0)
    assert one(out, LeaseDiscarded).reason == "expired"
    by = {x.instance_id: x for x in one(out, RoutingDecision).candidates}
    assert by["a"].feasible and by["a"].reserved_s == 0.0
