"""Soft-reservation rules at their boundaries (services/router/policy/soft_reservation.py):
`lease_problem`'s checks each alone, and `successor`'s guards (issue 26)."""

from __future__ import annotations

from router_support import done, snap

from talaria.services.router.policy import soft_reservation as sr
from talaria.services.router.policy.base import PolicyConfig
from talaria.services.router.state import RouterState, SnapshotReceived
from talaria.shared.events import CallSubmitted, LeaseDiscarded, LeaseIssued
from talaria.shared.wire import replace

CFG = PolicyConfig(stale_after_s=2.0)
LEASE = LeaseIssued("s1", "m1", "a", "c0", issued_at=10.0, expires_at=20.0)


def ask(model: str = "m1") -> CallSubmitted:
    return CallSubmitted(call_id="c1", session_id="s1", model=model, prompt_ids=[1] * 10, block_hashes=[],
                         max_tokens=4, submitted_at=0.0)


def state_with(received_at: float = 10.0, **snapshot) -> RouterState:
    state = RouterState()
    snapshot = {"at": 10.5, "sessions": [("s1", "m1", "device", 100)], **snapshot}
    state.apply(SnapshotReceived(snap("a", **snapshot), received_at))
    return state


def problem(state: RouterState, now: float = 11.0, lease: LeaseIssued = LEASE, model: str = "m1"):
    return sr.lease_problem(state, lease, ask(model), now, CFG)


def test_a_lease_with_its_kv_on_device_or_host_is_consumable():
    assert problem(state_with()) is None
    assert problem(state_with(sessions=[("s1", "m1", "host", 100)])) is None


def test_expiry_is_checked_first_and_is_exclusive():
    assert problem(state_with(received_at=19.9), now=19.99) is None  # heard from just now
    assert problem(state_with(received_at=19.9), now=20.0) == "expired"
    assert problem(RouterState(), now=20.0, model="m2") == "expired"  # before model_changed, instance_gone


def test_model_changed_before_the_instance_is_looked_up():
    assert problem(RouterState(), model="m2") == "model_changed"
    assert problem(RouterState()) == "instance_gone"


def test_an_instance_answers_up_to_twice_the_staleness_bound():
    assert problem(state_with(received_at=7.0), now=11.0) is None  # exactly 2 * 2.0 old
    assert problem(state_with(received_at=6.99), now=11.0) == "instance_unhealthy"


def test_an_unhealthy_snapshot_discards_the_lease_whatever_its_age():
    state = state_with()
    view = state.instances["a"]
    state.apply(SnapshotReceived(replace(view.snapshot, version=2, healthy=False), 10.9))
    assert problem(state) == "instance_unhealthy"


def test_a_hot_instance_pinned_to_another_model_refuses_the_lease():
    hot = state_with(pool="hot", active="m2", models={"m2": "active", "m1": "resident"})
    assert problem(hot) == "hot_pool_pinned"
    own = state_with(pool="hot")  # pinned to m1 itself
    assert problem(own) is None


def test_kv_missing_only_when_a_snapshot_newer_than_the_lease_lacks_it():
    for kv in ([], [("s1", "m1", "none", 0)], [("s1", "m1", "recompute", 100)], [("s1", "m2", "device", 100)]):
        assert problem(state_with(sessions=kv, at=10.5)) == "kv_missing", kv
    assert problem(state_with(sessions=[], at=9.9)) is None  # predates the completion: no judgement
    assert problem(state_with(sessions=[], at=10.0)) == "kv_missing"  # as new as the lease: it judges


# ---- successor ------------------------------------------------------------------------------


def completed_state(calls: int, lease: LeaseIssued | None = None, instances=("a",)) -> RouterState:
    state = RouterState()
    for iid in instances:
        state.apply(SnapshotReceived(snap(iid), 0.0))
    entry = state.session("s1")
    entry.calls = calls
    if lease is not None:
        state.apply(lease)
    return state


def test_the_latest_call_s_completion_issues_a_lease_an_overtaken_one_does_not():
    assert sr.successor(completed_state(calls=1), done("c0", "a", index=0, at=5.0), CFG)
    assert sr.successor(completed_state(calls=2), done("c0", "a", index=0, at=5.0), CFG) == []
    assert sr.successor(RouterState(), done("c0", "a", index=0, at=5.0), CFG) == []  # unknown session


def test_a_completion_on_an_instance_the_router_no_longer_knows_issues_nothing():
    assert sr.successor(completed_state(calls=1, instances=("b",)), done("c0", "a", at=5.0), CFG) == []


def test_the_issued_lease_runs_tau_from_the_completion_and_names_the_kv():
    [issued] = sr.successor(completed_state(calls=1), done("c0", "a", at=5.0, prompt=100, output=7), CFG)
    assert (issued.session_id, issued.model, issued.instance_id, issued.call_id) == ("s1", "m1", "a", "c0")
    assert (issued.issued_at, issued.expires_at, issued.kv_tokens) == (5.0, 5.0 + CFG.lease_timeout_s, 107)
    [reported] = sr.successor(completed_state(calls=1), done("c0", "a", at=5.0, kv_tokens=90), CFG)
    assert reported.kv_tokens == 90  # the agent's own count wins


def test_a_new_lease_supersedes_the_old_one_and_a_redelivered_completion_issues_none():
    old = LeaseIssued("s1", "m1", "b", "c0", 1.0, 2.0)
    events = sr.successor(completed_state(calls=2, lease=old), done("c1", "a", index=1, at=5.0), CFG)
    assert [type(e) for e in events] == [LeaseDiscarded, LeaseIssued]
    discard = events[0]
    assert (discard.instance_id, discard.call_id, discard.reason, discard.at) == ("b", "c1", "superseded", 5.0)
    same = LeaseIssued("s1", "m1", "a", "c1", 5.0, 6.0)
    assert sr.successor(completed_state(calls=2, lease=same), done("c1", "a", index=1, at=5.0), CFG) == []


def test_a_zero_tau_issues_nothing():
    zero = PolicyConfig(lease_timeout_s=0.0)
    assert sr.successor(completed_state(calls=1), done("c0", "a", at=5.0), zero) == []


def test_expiries_name_each_dead_lease_at_now():
    state = completed_state(calls=1, lease=LeaseIssued("s1", "m1", "a", "c0", 1.0, 2.0))
    assert sr.expiries(state, 1.99) == []
    [expired] = sr.expiries(state, 2.5)
    assert (expired.session_id, expired.model, expired.instance_id, expired.at) == ("s1", "m1", "a", 2.5)
