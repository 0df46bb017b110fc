"""Restarts and dead agents: a new incarnation replaces the old view at once, heartbeat
loss fails a dead agent's in-flight calls with a retryable 503 (never waits for the call
timeout), and a call whose client already has its error is never placed later."""

from __future__ import annotations

from router_support import call, core, of_type, one, snap

from talaria.services.router.router_core import LOST_AFTER_BEATS
from talaria.shared.events import CallFailed, CallRouted, InstanceLost
from talaria.shared.health import BusHearing


def test_a_restarted_agent_serves_at_once_although_its_version_restarts():
    c = core()
    c.observe(snap("a", version=900, incarnation="old"), 0.0)
    c.observe(snap("a", version=1, incarnation="new", queued={"m1": 7}), 0.1)
    view = c.state.instances["a"]
    assert view.snapshot.incarnation == "new" and view.snapshot.queued == {"m1": 7}
    assert one(c.handle(call("c1", at=0.2), 0.2), CallRouted).incarnation == "new"
    # the same process's out-of-order heartbeat is still dropped
    c.observe(snap("a", version=0, incarnation="new", queued={"m1": 1}), 0.3)
    assert c.state.instances["a"].snapshot.queued == {"m1": 7}


def test_a_restart_fails_the_calls_the_old_process_held_with_a_retryable_503():
    c = core()
    c.observe(snap("a", incarnation="old"), 0.0)
    routed = one(c.handle(call("c1", at=0.1), 0.1), CallRouted)
    assert routed.incarnation == "old"
    out = c.observe(snap("a", version=1, incarnation="new"), 0.5)
    lost = one(out, InstanceLost)
    assert (lost.instance_id, lost.incarnation, lost.calls) == ("a", "old", ["c1"])
    failed = one(out, CallFailed)
    assert (failed.call_id, failed.status, failed.instance_id) == ("c1", 503, "a")
    assert "c1" not in c.state.inflight_calls and not c.state.instances["a"].inflight


def test_heartbeat_loss_fails_in_flight_calls_within_the_bound():
    c = core()
    c.observe(snap("a", heartbeat_s=0.5), 0.0)
    c.observe(snap("b", heartbeat_s=0.5), 0.0)
    routed = one(c.handle(call("c1", at=0.0), 0.0), CallRouted)
    bound = LOST_AFTER_BEATS * 0.5
    assert bound < 5.0  # the re-route/fail goal
    c.observe(snap("a" if routed.instance_id == "b" else "b", version=2, at=bound), bound)  # the other lives
    assert c.check_liveness(bound - 0.01, since=0.0) == []
    out = c.check_liveness(bound + 0.01, since=0.0)
    assert one(out, InstanceLost).instance_id == routed.instance_id
    assert one(out, CallFailed).call_id == "c1"
    assert routed.instance_id not in c.state.instances
    # the next call goes to the survivor
    assert one(c.handle(call("c2", session="s2", at=bound + 0.1), bound + 0.1), CallRouted).instance_id \
        != routed.instance_id


def test_views_restored_from_a_checkpoint_get_a_grace_from_the_restart():
    c = core()
    c.observe(snap("a"), 0.0)  # heard long ago, before the router restarted at 100
    assert c.check_liveness(101.0, since=100.0) == []
    assert one(c.check_liveness(100.0 + LOST_AFTER_BEATS * 0.5 + 0.1, since=100.0), InstanceLost)


def test_a_call_failed_elsewhere_before_it_was_placed_is_never_placed():
    c = core()
    c.observe(snap("a"), 0.0)
    # the gateway gave up (its client got 503/504) while the router was down; on restart the
    # submission is consumed after the failure was folded in by the replay
    c.state.apply(CallFailed("c1", "s1", "m1", "gateway stopping", "gateway", 0.5, status=503))
    assert c.handle(call("c1", at=0.0), 1.0) == []
    # a router rejection is not final: the simulator retries the same call id
    c.state.apply(CallFailed("c2", "s1", "m1", "no capacity", "router", 0.5, status=503))
    assert of_type(c.handle(call("c2", at=0.0), 1.0), CallRouted)


def test_a_decision_after_the_router_was_deaf_does_not_find_every_view_stale():
    """The router blocked on the stream (a broker's leader election) while snapshots queued
    behind it: its first decision after must not refuse the call as if no instance answered.
    A view already stale when the router went deaf (a dead instance) stays stale."""
    c = core()
    c.observe(snap("a"), 5.0)
    c.observe(snap("dead"), 0.0)  # last heard at 0: stale (2 s) before the deaf spell
    assert one(c.handle(call("c1", at=14.0), 14.0), CallFailed).status == 503  # 9 s unheard: stale
    c.state.excuse_silence(6.0, 13.5, c.policy.config.stale_after_s)  # deaf 6.0-13.5
    assert one(c.handle(call("c2", session="s2", at=14.0), 14.0), CallRouted).instance_id == "a"
    assert c.state.instances["a"].received_at == 13.5 and c.state.instances["dead"].received_at == 0.0


def test_a_decision_while_nothing_answers_the_router_counts_that_silence_as_its_own():
    """A decision can come before the tick that would excuse a deaf spell (the connection
    back, or this process too busy to read its socket): the spell under way is excused too.
    The spell ends only when a PING is answered again; an agent's silence since then is its own."""
    c = core()
    c.observe(snap("a"), 5.0)
    hearing = BusHearing(None, every_s=0.05, gap_s=0.5)
    hearing.heard_at = 5.2  # the last PONG: nothing answered since
    assert one(c.handle(call("c1", at=9.0), 9.0), CallFailed).status == 503  # unexcused: 4 s unheard
    assert hearing.own_silence(5.8) == [(5.2, 5.8)] and hearing.own_silence(5.6) == []  # gap_s: 0.5
    for deaf_from, until in hearing.own_silence(9.0):
        c.state.excuse_silence(deaf_from, until, c.policy.config.stale_after_s)
    assert one(c.handle(call("c2", session="s2", at=9.0), 9.0), CallRouted).instance_id == "a"
    # heard again at 9.1 (the spell 5.2-9.1 is over): from then on, silence counts again
    hearing.deaf_from, hearing.deaf_until, hearing.heard_at = 5.2, 9.1, 9.1
    assert hearing.own_silence(9.3) == [(5.2, 9.1)]
    hearing.heard_at = 13.4  # PINGs answered all along since
    for deaf_from, until in hearing.own_silence(13.5):
        c.state.excuse_silence(deaf_from, until, c.policy.config.stale_after_s)
    assert one(c.handle(call("c3", session="s3", at=13.5), 13.5), CallFailed).status == 503
