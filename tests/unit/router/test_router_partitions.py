"""RouterCore with partitions (router replicas): two cores fed the same stream decide the same
calls as one core would, each acting only for its own sessions; another router's outputs,
folded in, charge its placements and leases on the instances."""

from __future__ import annotations

from router_support import call, core, done, of_type, one, snap

from talaria.services.router.ownership import Partitioning, partition_of
from talaria.services.router.router_core import LOST_AFTER_BEATS, RouterCore
from talaria.shared.events import (
    CallFailed, CallRouted, InstanceLost, LeaseExpired, LeaseIssued, RoutingDecision,
)

P = 2


def session_in(partition: int, tag: str = "s") -> str:
    return next(f"{tag}{i}" for i in range(1000) if partition_of(f"{tag}{i}", P) == partition)


def pair(**config) -> tuple[RouterCore, RouterCore]:
    a, b = core(**config), core(**config)
    a.partitioning, b.partitioning = Partitioning(P, frozenset({0})), Partitioning(P, frozenset({1}))
    for c in (a, b):
        c.observe(snap("i1"), 0.0)
        c.observe(snap("i2"), 0.0)
    return a, b


def peer_outputs(events):
    return [e for e in events if not isinstance(e, (RoutingDecision, CallFailed))]


def test_a_peers_placements_and_leases_are_charged_like_ones_own():
    a, b = pair(lease_timeout_s=5.0)
    s0 = session_in(0)
    out = a.handle(call("c1", session=s0), 0.1)
    routed = one(out, CallRouted)
    for e in peer_outputs(out):
        b.fold_peer(e, 0.1)
    assert "c1" in b.state.inflight_calls and "c1" in b.state.instances[routed.instance_id].overlay
    lease = one(a.handle(done("c1", routed.instance_id, session=s0, at=1.0), 1.0), LeaseIssued)
    b.handle(done("c1", routed.instance_id, session=s0, at=1.0), 1.0)  # b reads the completion too
    b.fold_peer(lease, 1.0)
    assert b.state.leases_on(routed.instance_id, 1.5) == a.state.leases_on(routed.instance_id, 1.5) == 1


def test_only_the_owner_reacts_and_expires():
    a, b = pair(lease_timeout_s=1.0)
    s0 = session_in(0)
    routed = one(a.handle(call("c1", session=s0), 0.1), CallRouted)
    for e in peer_outputs([routed]):
        b.fold_peer(e, 0.1)
    completion = done("c1", routed.instance_id, session=s0, at=1.0)
    lease = one(a.handle(completion, 1.0), LeaseIssued)
    assert of_type(b.handle(completion, 1.0), LeaseIssued) == []  # not b's session: no successor lease
    b.fold_peer(lease, 1.0)
    assert of_type(b.tick(5.0), LeaseExpired) == []  # a expires its own
    assert one(a.tick(5.0), LeaseExpired).session_id == s0


def test_the_same_view_gives_the_same_decision_as_one_router():
    single = core()
    a, b = pair()
    single.observe(snap("i1"), 0.0)
    single.observe(snap("i2"), 0.0)
    for k in range(12):
        session = f"s{k}"
        owner = a if a.partitioning.owns(session) else b
        other = b if owner is a else a
        mine = owner.handle(call(f"c{k}", session=session, at=0.1 * k), 0.1 * k)
        for e in peer_outputs(mine):
            other.fold_peer(e, 0.1 * k)
        alone = single.handle(call(f"c{k}", session=session, at=0.1 * k), 0.1 * k)
        assert one(mine, CallRouted).instance_id == one(alone, CallRouted).instance_id


def test_a_lost_instance_fails_each_call_once_by_its_owner():
    a, b = pair()
    calls = {}
    for k, part in enumerate((0, 1, 0, 1)):
        s = session_in(part, f"x{k}-")
        owner = a if part == 0 else b
        out = owner.handle(call(f"c{k}", session=s), 0.1)
        calls[f"c{k}"] = (owner, one(out, CallRouted).instance_id)
        for e in peer_outputs(out):
            (b if owner is a else a).fold_peer(e, 0.1)
    dead = calls["c0"][1]
    a.observe(snap("i1" if dead == "i2" else "i2", version=2, at=10.0), 10.0)
    out = a.check_liveness(LOST_AFTER_BEATS * 0.5 + 0.2, since=0.0)
    lost = [e for e in out if isinstance(e, InstanceLost) and e.instance_id == dead]
    assert lost
    failed_by_a = {e.call_id for e in of_type(out, CallFailed)}
    assert failed_by_a == {c for c, (o, i) in calls.items() if o is a and i == dead}
    # b hears a's InstanceLost first: it fails its own calls there, a's are not its to answer
    failed_by_b = {e.call_id for e in b.fold_peer(lost[0], 2.5)}
    assert failed_by_b == {c for c, (o, i) in calls.items() if o is b and i == dead}
    assert not any(c in b.state.inflight_calls for c, (_, i) in calls.items() if i == dead)


def test_a_call_already_routed_by_a_dead_peer_is_not_routed_again_by_its_successor():
    """The call-id fence: the taker has folded the dead router's CallRouted before consuming."""
    a, b = pair()
    s0 = session_in(0)
    out = a.handle(call("c1", session=s0), 0.1)
    for e in peer_outputs(out):
        b.fold_peer(e, 0.1)
    b.partitioning = Partitioning(P, frozenset({0, 1}))  # a died; b took partition 0 over
    assert b.handle(call("c1", session=s0), 3.0) == []  # redelivered: decided once, never twice


def test_a_routed_call_carries_its_routers_claim_on_the_sessions_partition():
    from talaria.services.router.ownership import Ownership
    from talaria.shared.events import DispatchFence

    a, _ = pair()
    claims = Ownership("router-a", P, ttl_s=3.0)
    claims.claimed(0, 41)
    claims.renewed(0, 45)
    a.partitioning = claims.fenced({0}, P)
    routed = one(a.handle(call("c1", session=session_in(0)), 0.1), CallRouted)
    assert routed.fence == DispatchFence("router-a", 0, 41)
    assert routed.by_reference(7).fence == routed.fence  # the stream's copy carries it too
