"""`talaria drain` in the router core (services/router/router_core.py, costs.py): a draining
instance is never chosen, and it is drained once nothing runs, waits or was placed there."""

from __future__ import annotations

import msgspec
from router_support import call, core, done, one, snap

from talaria.services.router.state import SnapshotReceived
from talaria.shared.events import CallRouted, RoutingDecision


def drain_of(r, instance_id, now):
    return r.drain(instance_id, now)[0]


def test_a_draining_instance_takes_no_call_and_is_drained_once_its_calls_end():
    r = core()
    r.handle(SnapshotReceived(snap("a"), 0.0), 0.0)
    r.handle(SnapshotReceived(snap("b", queued={"m1": 1}, running=2), 0.0), 0.0)
    assert drain_of(r, "b", 0.5) == msgspec.structs.replace(drain_of(r, "b", 0.5), drained=False, calls=3)
    for k in range(3):  # b would be free otherwise: every call goes to a
        assert one(r.handle(call(f"c{k}", session=f"s{k}"), 0.1), CallRouted).instance_id == "a"
    r.handle(SnapshotReceived(snap("b", version=2), 0.2), 0.2)
    assert drain_of(r, "b", 0.5).drained and drain_of(r, "b", 0.5).calls == 0
    r.handle(SnapshotReceived(snap("a", version=2, running=9, queued={"m1": 9}), 0.3), 0.3)
    routed = r.handle(call("c9", session="s9"), 0.3)
    assert not any(isinstance(e, CallRouted) and e.instance_id == "b" for e in routed)


def test_an_unknown_instance_is_refused_naming_the_known_ones():
    r = core()
    r.handle(SnapshotReceived(snap("a"), 0.0), 0.0)
    status = drain_of(r, "nope", 0.5)
    assert not status.drained and status.error == "no instance 'nope' is known to this router (known: a)"
    assert r.state.draining == set()


def test_a_session_leased_to_a_draining_instance_returns_elsewhere_its_lease_discarded():
    r = core(lease_timeout_s=60.0)
    r.handle(SnapshotReceived(snap("b"), 0.0), 0.0)
    assert one(r.handle(call("c0"), 0.1), CallRouted).instance_id == "b"
    r.handle(done("c0", "b", at=1.0), 1.0)
    assert r.state.sessions["s1"].lease is not None  # its return is reserved on b
    r.handle(SnapshotReceived(snap("a"), 1.1), 1.1)
    drain_of(r, "b", 0.5)
    events = r.handle(call("c1"), 1.2)
    decision = one(events, RoutingDecision)
    assert one(events, CallRouted).instance_id == "a"
    assert (decision.lease_outcome, decision.discard_reason) == ("discarded", "draining")


def test_a_drained_instance_that_restarts_is_back_in_service():
    r = core()
    r.handle(SnapshotReceived(snap("b", incarnation="one"), 0.0), 0.0)
    drain_of(r, "b", 0.5)
    r.handle(SnapshotReceived(snap("b", incarnation="one", version=2), 0.1), 0.1)
    assert r.state.draining == {"b"}  # the same process: still draining
    r.handle(SnapshotReceived(snap("b", incarnation="two"), 0.2), 0.2)
    assert r.state.draining == set()
    assert one(r.handle(call("c0"), 0.3), CallRouted).instance_id == "b"


def test_sessions_living_on_a_holder_that_serves_no_pages_count_as_lost():
    r = core(lease_timeout_s=0.0)
    r.handle(SnapshotReceived(snap("b"), 0.0), 0.0)
    r.state.model("m1").observe_gap(30.0)  # this model's sessions come back within 30 s
    assert one(r.handle(call("c0"), 0.1), CallRouted).instance_id == "b"
    r.handle(done("c0", "b", at=1.0), 1.0)
    r.handle(SnapshotReceived(snap("a"), 1.1), 1.1)
    r.handle(SnapshotReceived(snap("b", version=2, at=1.1), 1.1), 1.1)
    status, asks = r.drain("b", 2.0)  # b has no page server (migration off there): nothing can move s1
    assert asks == [] and (status.drained, status.sessions, status.lost) == (True, 0, 1)
    assert status.why_lost == "b serves no KV pages (migration off there)"
    assert one(r.handle(call("c1"), 3.0), CallRouted).instance_id == "a"  # it returns elsewhere, recomputing
