"""A drain pushes its sessions' KV ahead of their next calls (services/router/drain_push.py,
RouterCore.drain): whom it asks, what the reports fold into, and what the status counts."""

from __future__ import annotations

import msgspec
from router_support import call, core, done, one, snap

from talaria.services.router.push_book import ATTEMPTS, RETRY_AFTER_S
from talaria.services.router.state import SnapshotReceived
from talaria.shared.events import CallRouted, InstanceLost, KvPushed, KvPushRequested


def msnap(iid, **kw):
    """A snapshot of an agent that serves and pulls KV pages (migration on there)."""
    s = snap(iid, **kw)
    models = [msgspec.structs.replace(m, kv_bytes_per_token=1024) for m in s.models]
    return msgspec.structs.replace(s, models=models, page_address=f"{iid}.host:7000")


def idle_on_b(r, sessions=("s1",)):
    """Sessions whose last call ran on b, idle there."""
    r.handle(SnapshotReceived(msnap("b"), 0.0), 0.0)
    for k, s in enumerate(sessions):
        assert one(r.handle(call(f"c{k}", session=s), 0.1), CallRouted).instance_id == "b"
        r.handle(done(f"c{k}", "b", session=s, at=1.0), 1.0)


def pushed(ask: KvPushRequested, *, listed=4, pages=4, at=3.0, why=""):
    return KvPushed(ask.instance_id, ask.session_id, ask.model, ask.holder, at, listed=listed, pages=pages,
                    tokens=pages * 16, bytes=pages * 16 * 1024, seconds=0.01, why=why)


def test_each_session_on_the_drained_instance_is_pushed_to_where_its_model_is_resident():
    r = core(lease_timeout_s=0.0)
    idle_on_b(r, ("s1", "s2"))
    # c serves m1 but m2 is active there; a has m1 active; d is draining too; e serves no pages
    r.handle(SnapshotReceived(msnap("c", models={"m1": "warm", "m2": "active"}, active="m2"), 1.1), 1.1)
    r.handle(SnapshotReceived(msnap("a"), 1.1), 1.1)
    r.handle(SnapshotReceived(snap("e"), 1.1), 1.1)
    r.handle(SnapshotReceived(msnap("d"), 1.1), 1.1)
    r.state.draining.add("d")
    status, asks = r.drain("b", 2.0)
    assert [(a.session_id, a.instance_id, a.holder, a.holder_address, a.model) for a in asks] == [
        ("s1", "a", "b", "b.host:7000", "m1"), ("s2", "a", "b", "b.host:7000", "m1")]
    assert (status.drained, status.sessions, status.moved, status.lost) == (False, 2, 0, 0)
    assert r.drain("b", 2.5)[1] == []  # asked once: the pushes are pending, not asked again


def _target(r, sessions=("s1",)):
    asks = r.drain("b", 2.0)[1]
    assert [a.session_id for a in asks] == list(sessions)
    return [a.instance_id for a in asks]


def test_the_target_is_priced_a_resident_model_behind_a_long_queue_loses_to_an_idle_staged_one():
    # A ranking by residency would push to a (m1 active); the return would wait 5 s of queue
    # there against 1 s to switch m1 in on c, so the router would place it on c.
    r = core(lease_timeout_s=0.0)
    idle_on_b(r)
    r.handle(SnapshotReceived(msnap("a", queued={"m1": 3}, queued_prefill_s=5.0, running=2), 1.1), 1.1)
    r.handle(SnapshotReceived(msnap("c", models={"m1": "staged"}, active=None, switch_cost_s=1.0), 1.1), 1.1)
    assert _target(r) == ["c"]
    # the same, the queue short: the active model wins (pricing, not a reversed ranking)
    r = core(lease_timeout_s=0.0)
    idle_on_b(r)
    r.handle(SnapshotReceived(msnap("a", queued={"m1": 1}, queued_prefill_s=0.1, running=1), 1.1), 1.1)
    r.handle(SnapshotReceived(msnap("c", models={"m1": "staged"}, active=None, switch_cost_s=1.0), 1.1), 1.1)
    assert _target(r) == ["a"]


def test_the_target_prices_the_pull_a_slow_measured_link_loses_to_a_fast_one():
    r = core(lease_timeout_s=0.0)
    idle_on_b(r)
    slow = msgspec.structs.replace(msnap("a"), migrate_bytes_s=1e6, migrate_setup_s=0.5)
    fast = msgspec.structs.replace(msnap("c"), migrate_bytes_s=1e9, migrate_setup_s=0.001)
    r.handle(SnapshotReceived(slow, 1.1), 1.1)
    r.handle(SnapshotReceived(fast, 1.1), 1.1)
    assert _target(r) == ["c"]


def test_sessions_one_drain_pushes_count_where_they_will_live_so_equal_targets_share_them():
    # Each session pushed to a lives there after: the next one's move there is charged for it,
    # as the move term charges the sessions homed there, so two equal targets take one each.
    r = core(lease_timeout_s=0.0)
    idle_on_b(r, ("s1", "s2"))
    r.handle(SnapshotReceived(msnap("a"), 1.1), 1.1)
    r.handle(SnapshotReceived(msnap("c"), 1.1), 1.1)
    assert sorted(_target(r, ("s1", "s2"))) == ["a", "c"]


def test_a_push_that_lands_moves_the_sessions_home_and_its_next_call_lands_there():
    r = core(lease_timeout_s=0.0)
    idle_on_b(r)
    r.handle(SnapshotReceived(msnap("c"), 1.1), 1.1)
    r.handle(SnapshotReceived(msnap("a"), 1.1), 1.1)
    (ask,) = r.drain("b", 2.0)[1]
    r.handle(pushed(ask), 3.0)
    assert r.state.homes.home_of["s1"] == (ask.instance_id, "m1")
    assert r.state.sessions["s1"].last_instance == ask.instance_id
    status = r.drain("b", 3.1)[0]
    assert (status.drained, status.sessions, status.moved, status.lost) == (True, 0, 1, 0)
    # the target's snapshot reports the pages in its host registry: the return restores there
    r.handle(SnapshotReceived(msnap(ask.instance_id, version=2, at=3.2, sessions=[("s1", "m1", "host", 1000)]),
                              3.2), 3.2)
    routed = one(r.handle(call("c9"), 4.0), CallRouted)
    assert routed.instance_id == ask.instance_id and routed.kv_from == ""


def test_a_push_that_moved_fewer_pages_than_listed_counts_the_session_as_lost():
    r = core(lease_timeout_s=0.0)
    idle_on_b(r, ("s1", "s2"))
    r.handle(SnapshotReceived(msnap("a"), 1.1), 1.1)
    a1, a2 = r.drain("b", 2.0)[1]
    r.handle(pushed(a1, listed=4, pages=1, why="page 1 failed its hash check"), 3.0)
    r.handle(pushed(a2, listed=0, pages=0), 3.0)  # the holder had nothing of s2: nothing to move
    status = r.drain("b", 3.1)[0]
    assert (status.drained, status.sessions, status.moved, status.lost) == (True, 0, 1, 1)
    assert status.why_lost == "page 1 failed its hash check"
    assert r.state.homes.home_of["s1"][0] == "b"  # not moved: its next call pulls or recomputes


def test_an_unanswered_push_is_asked_again_then_counted_lost():
    r = core(lease_timeout_s=0.0)
    idle_on_b(r)
    r.handle(SnapshotReceived(msnap("a"), 1.1), 1.1)
    now = 2.0
    for attempt in range(1, ATTEMPTS + 1):
        r.handle(SnapshotReceived(msnap("a", version=attempt + 1, at=now), now), now)
        (ask,) = r.drain("b", now)[1]
        assert ask.attempt == attempt
        now += RETRY_AFTER_S
    r.handle(SnapshotReceived(msnap("a", version=9, at=now), now), now)
    status, asks = r.drain("b", now)
    assert asks == [] and (status.drained, status.lost) == (True, 1)
    assert status.why_lost == f"no report after {ATTEMPTS} asks"


def test_a_session_that_returned_elsewhere_before_its_push_landed_keeps_its_new_home():
    r = core(lease_timeout_s=0.0)
    idle_on_b(r)
    r.handle(SnapshotReceived(msnap("a"), 1.1), 1.1)
    r.handle(SnapshotReceived(msnap("c", running=5), 1.1), 1.1)
    (ask,) = r.drain("b", 2.0)[1]
    assert ask.instance_id == "a"
    r.handle(SnapshotReceived(msgspec.structs.replace(msnap("a", version=2, at=2.1), healthy=False), 2.1), 2.1)
    routed = one(r.handle(call("c9"), 2.2), CallRouted)  # it came back first (and pulled at its call)
    assert routed.instance_id == "c"
    late = KvPushed(ask.instance_id, "s1", "m1", "b", 3.0, listed=4, pages=4)
    r.handle(late, 3.0)
    assert r.state.homes.home_of["s1"][0] == routed.instance_id


def test_sessions_the_holder_reports_in_its_registry_are_pushed_too_and_a_stale_report_is_ignored():
    r = core(lease_timeout_s=0.0)
    r.handle(SnapshotReceived(msnap("b", sessions=[("old", "m1", "host", 4096), ("gone", "m1", "none", 0)]), 0.0), 0.0)
    r.handle(SnapshotReceived(msnap("a"), 0.0), 0.0)
    (ask,) = r.drain("b", 1.0)[1]
    assert (ask.session_id, ask.instance_id) == ("old", "a")
    r.handle(msgspec.structs.replace(pushed(ask), instance_id="z"), 2.0)  # not the agent asked: ignored
    assert r.drain("b", 2.1)[0].sessions == 1
    r.handle(pushed(ask), 2.2)
    assert r.drain("b", 2.3)[0].drained


def test_a_session_with_a_call_running_on_the_holder_is_pushed_once_it_ends():
    r = core(lease_timeout_s=0.0)
    r.handle(SnapshotReceived(msnap("b"), 0.0), 0.0)
    assert one(r.handle(call("c0"), 0.1), CallRouted).instance_id == "b"
    r.handle(SnapshotReceived(msnap("a"), 0.1), 0.1)
    status, asks = r.drain("b", 0.2)
    assert asks == [] and not status.drained
    r.handle(done("c0", "b", at=1.0), 1.0)
    r.handle(SnapshotReceived(msnap("b", version=2, at=1.0), 1.0), 1.0)
    r.handle(SnapshotReceived(msnap("a", version=2, at=1.0), 1.0), 1.0)
    assert [a.session_id for a in r.drain("b", 1.1)[1]] == ["s1"]


def test_a_restarted_holder_forgets_its_drains_pushes():
    r = core(lease_timeout_s=0.0)
    idle_on_b(r)
    r.handle(SnapshotReceived(msnap("a"), 1.1), 1.1)
    (ask,) = r.drain("b", 2.0)[1]
    r.handle(pushed(ask), 2.5)
    r.handle(SnapshotReceived(msgspec.structs.replace(msnap("b", version=5, at=3.0), incarnation="two"), 3.0), 3.0)
    assert r.state.pushes.moved == {} and r.state.draining == set()


def test_a_drained_holder_lost_then_restarted_is_back_in_service():
    # The operator's stop is noticed first (heartbeats stop: the view is dropped), then the
    # supervisor's restart comes back as a new process: a rolling restart's usual order.
    r = core(lease_timeout_s=0.0)
    r.handle(SnapshotReceived(msgspec.structs.replace(msnap("b"), incarnation="one"), 0.0), 0.0)
    r.handle(SnapshotReceived(msnap("a", running=3, queued={"m1": 2}, queued_prefill_s=3.0), 0.0), 0.0)
    assert r.drain("b", 1.0)[0].drained
    r.handle(InstanceLost("b", "one", "no heartbeat", 2.0), 2.0)
    assert "b" not in r.state.instances
    r.handle(SnapshotReceived(msgspec.structs.replace(msnap("b", version=1, at=3.0), incarnation="two"), 3.0), 3.0)
    assert r.state.draining == set()
    assert one(r.handle(call("c1", session="new"), 3.1), CallRouted).instance_id == "b"
    # the same process heard again (a stall, not a restart) stays drained
    r.drain("b", 4.0)
    r.handle(SnapshotReceived(msgspec.structs.replace(msnap("b", version=2, at=4.1), incarnation="two"), 4.1), 4.1)
    assert r.state.draining == {"b"}


def test_a_router_asks_only_for_its_own_sessions_but_counts_every_sessions_loss():
    r = core(lease_timeout_s=0.0)
    idle_on_b(r, ("s1", "s2"))
    r.handle(SnapshotReceived(msnap("a"), 1.1), 1.1)
    r.partitioning = _Only("s1")
    status, asks = r.drain("b", 2.0)
    assert [a.session_id for a in asks] == ["s1"] and status.sessions == 2  # s2 is another router's to ask
    r.handle(SnapshotReceived(msgspec.structs.replace(msnap("a", version=2, at=2.1), healthy=False), 2.1), 2.1)
    status = r.drain("b", 2.2)[0]  # no instance can take s2 now: every router counts it lost
    assert (status.sessions, status.lost) == (1, 1)


class _Only:
    """A router that owns one session."""

    def __init__(self, session_id):
        self.session_id = session_id

    def owns(self, session_id):
        return session_id == self.session_id


def test_a_drained_holder_lost_mid_push_ends_the_drain_counting_what_died_with_it():
    # b dies while its drain's pushes pull from it (issue 40's kill mid-transfer): the drain
    # still answers (not "no instance b"), waits for the pushes' reports, and counts as lost
    # the partial one, the unreported one and the session no push had been asked for yet.
    r = core(lease_timeout_s=0.0)
    idle_on_b(r, ("s1", "s2", "s3"))
    r.handle(SnapshotReceived(msnap("a"), 1.1), 1.1)
    a1, a2, a3 = r.drain("b", 2.0)[1]
    r.handle(pushed(a1), 2.5)  # s1 moved before the kill
    # s4 shows up in b's registry after the asks: the next ask would have pushed it
    r.handle(SnapshotReceived(msnap("b", version=2, at=2.6, sessions=[("s4", "m1", "host", 64)]), 2.6), 2.6)
    r.handle(InstanceLost("b", "", "instance b lost: no heartbeat for 2.1s", 3.0), 3.0)
    status = r.drain("b", 3.1)[0]
    assert (status.drained, status.sessions, status.moved, status.lost) == (False, 2, 1, 1)
    assert status.why_lost == "b was lost while draining (instance b lost: no heartbeat for 2.1s)"
    r.handle(pushed(a2, listed=4, pages=2, why="transfer broke: IncompleteReadError"), 3.2)
    assert (r.drain("b", 3.3)[0].sessions, r.drain("b", 3.3)[0].lost) == (1, 2)
    status, asks = r.drain("b", 2.0 + RETRY_AFTER_S)  # s3's report never comes (its target died too)
    assert (status.drained, status.calls, status.sessions, status.moved, status.lost) == (True, 0, 0, 1, 3)
    assert a3.session_id == "s3" and asks == []  # nothing is asked of a dead holder
    # An instance lost without a drain is unknown, as before.
    r.handle(InstanceLost("a", "", "instance a lost", 40.0), 40.0)
    assert r.drain("a", 40.1)[0].error.startswith("no instance 'a' is known")


def test_a_push_whose_listing_failed_counts_the_session_as_lost_not_moved():
    r = core(lease_timeout_s=0.0)
    idle_on_b(r)
    r.handle(SnapshotReceived(msnap("a"), 1.1), 1.1)
    (ask,) = r.drain("b", 2.0)[1]
    r.handle(pushed(ask, listed=0, pages=0, why="listing broke: ConnectionRefusedError"), 3.0)
    status = r.drain("b", 3.1)[0]
    assert (status.drained, status.moved, status.lost) == (True, 0, 1)
    assert status.why_lost == "listing broke: ConnectionRefusedError"
