"""Lease bookkeeping with more than one lease (services/router/leases.py and the fold in
state.py): replacing a lease, removing one from the expiry indexes, the heap's lazy entries,
expiry boundaries, and events about an older lease or applied twice on replay (issue 26)."""

from __future__ import annotations

from router_support import call, core, done, one, snap

from talaria.services.router.leases import LeaseBook, settlement
from talaria.services.router.policy import soft_reservation as sr
from talaria.services.router.policy.base import PolicyConfig
from talaria.services.router.state import RouterState
from talaria.shared.events import (
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    LeaseIssued,
    RoutingDecision,
)
from talaria.shared.wire import replace


def lease(session: str, exp: float, *, instance: str = "a", model: str = "m1", call_id: str | None = None,
          issued: float = 0.0) -> LeaseIssued:
    return LeaseIssued(session, model, instance, call_id or f"c-{session}-{exp}", issued, exp)


# ---- LeaseBook ----------------------------------------------------------------------------


def test_replacing_a_session_lease_moves_its_expiry_in_both_indexes():
    book = LeaseBook()
    book.add(lease("s1", 5.0, instance="a", model="m1"))
    book.add(lease("s1", 8.0, instance="b", model="m2"))  # its successor, elsewhere
    assert book.by_instance == {"b": [8.0]} and book.by_model == {"m2": [8.0]}
    assert book.live_on("a", 1.0) == 0 and book.live_on("b", 1.0) == 1
    assert book.live_for("m1", 1.0) == 0 and book.live_for("m2", 1.0) == 1
    assert [x.expires_at for x in book.due(9.0)] == [8.0]  # the replaced lease never comes due


def test_removing_one_of_several_leases_drops_only_its_expiry():
    book = LeaseBook()
    for s, exp in (("s0", 1.0), ("s1", 2.0), ("s2", 2.0), ("s3", 3.0)):
        book.add(lease(s, exp))
    book.remove("s0")  # the first expiry in the list (position 0)
    assert book.by_instance["a"] == [2.0, 2.0, 3.0] and book.by_model["m1"] == [2.0, 2.0, 3.0]
    book.remove("s2")  # one of two equal expiries: one goes
    assert book.by_instance["a"] == [2.0, 3.0]
    book.remove("s3")  # the last one in the list
    assert book.by_instance["a"] == [2.0] and book.live_on("a", 0.0) == 1
    assert book.remove("nobody") is None and book.by_instance["a"] == [2.0]
    book.remove("s1")
    assert book.by_instance == {} and book.by_model == {}  # no empty lists left behind
    assert book.leases == {} and book.heap == []


def test_removing_a_lease_whose_expiry_is_not_indexed_changes_nothing():
    book = LeaseBook()
    book.add(lease("s0", 2.0))
    ghost = lease("g", 1.0)
    book.leases["g"] = ghost  # held, but its expiry missing from the indexes
    book.remove("g")
    assert book.by_instance == {"a": [2.0]} and book.by_model == {"m1": [2.0]}
    book.leases["g"] = lease("g", 3.0)  # past the only expiry held: bisect lands on 2.0
    book.remove("g")
    assert book.by_instance == {"a": [2.0]} and book.by_model == {"m1": [2.0]}
    book.leases["g"] = lease("g", 3.0, instance="z", model="mz")  # an instance with no index at all
    book.remove("g")
    assert book.by_instance == {"a": [2.0]}


def test_live_counts_exclude_a_lease_expiring_exactly_now():
    book = LeaseBook()
    book.add(lease("s0", 2.0))
    book.add(lease("s1", 3.0, model="m2"))
    assert book.live_on("a", 1.999) == 2 and book.live_on("a", 2.0) == 1 and book.live_on("a", 3.0) == 0
    assert book.live_for("m1", 1.999) == 1 and book.live_for("m1", 2.0) == 0
    assert book.live_on("nowhere", 0.0) == 0 and book.live_for("none", 0.0) == 0


def test_due_includes_a_lease_expiring_exactly_now_and_sorts_ties_by_session():
    book = LeaseBook()
    for s, exp in (("s3", 2.0), ("s1", 2.0), ("s0", 1.0), ("s2", 2.5), ("s4", 4.0), ("s5", 5.0), ("s6", 1.5)):
        book.add(lease(s, exp))
    assert [x.session_id for x in book.due(2.0)] == ["s0", "s6", "s1", "s3"]
    assert [x.session_id for x in book.due(0.5)] == []
    assert [x.session_id for x in book.due(9.0)] == ["s0", "s6", "s1", "s3", "s2", "s4", "s5"]


def test_due_skips_a_replaced_lease_with_the_same_expiry_and_a_reissued_one():
    book = LeaseBook()
    book.add(lease("s0", 1.0, call_id="first"))  # stays at the heap's top: nothing below is pruned
    book.add(lease("s1", 5.0, call_id="c0"))
    book.add(lease("s1", 5.0, call_id="c1"))  # successor, same expiry: its old heap entry stays
    assert len(book.heap) == 3
    assert [x.call_id for x in book.due(5.0)] == ["first", "c1"]
    book.add(lease("s2", 4.0, call_id="k"))
    book.add(lease("s2", 7.0, call_id="k"))  # the same call's lease again, later expiry
    assert len(book.heap) == 5  # (4.0, s2, k) stays, stale
    assert [x.call_id for x in book.due(6.0)] == ["first", "c1"]


def test_prune_pops_dead_heap_entries_only_up_to_the_first_live_one():
    book = LeaseBook()
    book.add(lease("s1", 1.0, call_id="old"))
    book.add(lease("s2", 2.0))
    book.add(lease("s1", 3.0, call_id="new"))  # replacing s1 leaves (1.0, s1, old) on top
    assert book.heap[0] == (2.0, "s2", "c-s2-2.0")  # remove() pruned the dead top entry
    book.add(lease("s2", 2.0, call_id="again"))  # same session, same expiry, new call: old entry stale
    book.prune()
    assert book.heap[0] == (2.0, "s2", "again") and len(book.heap) == 2
    book.leases.pop("s2")
    book.prune()  # a heap entry whose session holds no lease at all
    assert book.heap == [(3.0, "s1", "new")]


def test_from_list_restores_every_lease_and_its_indexes():
    book = LeaseBook()
    book.add(lease("s0", 2.0))
    book.add(lease("s1", 3.0, instance="b", model="m2"))
    again = LeaseBook.from_list(book.to_list())
    assert again.leases == book.leases and again.by_instance == book.by_instance
    assert again.by_model == book.by_model and sorted(again.heap) == sorted(book.heap)


def test_settlement_names_the_outcome_and_the_deciding_call():
    held = lease("s1", 5.0, instance="a", call_id="c0")
    base = RoutingDecision("c1", "s1", 1, "m1", "talaria", "route", 4.0, chosen="a")
    assert settlement(None, base) == []
    assert settlement(None, replace(base, lease_outcome="consumed")) == []  # no lease: nothing to settle
    assert settlement(held, base) == []  # lease_outcome "none"
    consumed = settlement(held, replace(base, lease_outcome="consumed"))
    assert consumed == [LeaseConsumed("s1", "m1", "a", "c1", 4.0)]
    discarded = settlement(held, replace(base, lease_outcome="discarded", discard_reason="kv_missing"))
    assert discarded == [LeaseDiscarded("s1", "m1", "a", "c1", "kv_missing", 4.0)]
    assert settlement(held, replace(base, lease_outcome="discarded"))[0].reason == ""


# ---- the fold: more than one lease per session over time ----------------------------------


def folded(*events) -> RouterState:
    state = RouterState()
    for e in events:
        state.apply(e)
    return state


def test_a_successor_lease_survives_the_expiry_notice_of_its_predecessor():
    old, new = lease("s1", 11.0, call_id="c0", issued=10.0), lease("s1", 13.0, call_id="c1", issued=12.0)
    state = folded(old, new, LeaseExpired("s1", "m1", "a", 11.0))  # the notice was late
    assert state.sessions["s1"].lease == new and state.leases.live_on("a", 12.5) == 1
    state.apply(LeaseExpired("s1", "m1", "a", 13.0))  # its own, at exactly its expiry
    assert state.sessions["s1"].lease is None and state.leases.by_instance == {}


def test_an_event_about_an_older_lease_elsewhere_leaves_the_successor():
    old, new = lease("s1", 11.0, instance="a", call_id="c0"), lease("s1", 13.0, instance="b", call_id="c1")
    for stale in (LeaseConsumed("s1", "m1", "a", "c9", 12.0), LeaseDiscarded("s1", "m1", "a", "c9", "x", 12.0),
                  LeaseExpired("s1", "m1", "a", 14.0)):
        state = folded(old, new, stale)
        assert state.sessions["s1"].lease == new, stale  # another instance: not this lease
    other_model = lease("s1", 13.0, model="m2", call_id="c1")
    for stale in (LeaseConsumed("s1", "m1", "a", "c9", 12.0), LeaseExpired("s1", "m1", "a", 14.0)):
        state = folded(old, other_model, stale)
        assert state.sessions["s1"].lease == other_model, stale  # same instance, another model


def test_replayed_consumption_of_the_older_lease_leaves_the_successor_on_the_same_instance():
    # c1 consumed L0 and, completing, installed L1 on the same instance and model. A replay (or
    # a completion that reached the stream before the LeaseConsumed) folds the consumption
    # again after L1: it names c1, the call L1 belongs to, so it is about L0.
    l0, l1 = lease("s1", 11.0, call_id="c0"), lease("s1", 13.0, call_id="c1", issued=12.0)
    consumed = LeaseConsumed("s1", "m1", "a", "c1", 10.5)
    superseded = LeaseDiscarded("s1", "m1", "a", "c1", "superseded", 12.0)
    for event in (consumed, superseded):
        state = folded(l0, event, l1, event)
        assert state.sessions["s1"].lease == l1 and state.leases.live_on("a", 12.5) == 1, event
    state = folded(l0, consumed, l1, LeaseConsumed("s1", "m1", "a", "c2", 12.5))
    assert state.sessions["s1"].lease is None and state.leases.by_instance == {}  # c2 consumed L1


def test_the_same_lease_events_twice_fold_to_the_same_state():
    l0 = lease("s1", 11.0, call_id="c0")
    once = folded(l0, LeaseExpired("s1", "m1", "a", 11.0))
    twice = folded(l0, l0, LeaseExpired("s1", "m1", "a", 11.0), LeaseExpired("s1", "m1", "a", 11.0))
    assert once.to_dict() == twice.to_dict() and twice.sessions["s1"].lease is None
    state = folded(l0, l0)
    assert state.leases.by_instance == {"a": [11.0]} and len(state.leases.heap) == 1


def test_an_expiry_notice_before_the_lease_expires_is_ignored_and_one_exactly_at_it_is_not():
    l0 = lease("s1", 11.0)
    assert folded(l0, LeaseExpired("s1", "m1", "a", 10.99)).sessions["s1"].lease == l0
    assert folded(l0, LeaseExpired("s1", "m1", "a", 11.0)).sessions["s1"].lease is None


def test_lease_events_for_a_session_without_a_lease_change_nothing():
    state = folded(LeaseConsumed("s1", "m1", "a", "c1", 1.0), LeaseExpired("s9", "m1", "a", 1.0))
    assert state.sessions.get("s9") is None and state.leases.leases == {}


# ---- expiry through the policy -------------------------------------------------------------


def test_tick_expires_exactly_at_tau_every_due_lease_once():
    c = core()
    c.observe(snap("a", at=9.0), 9.0)
    for k, s in enumerate(("s1", "s2")):
        c.handle(call(f"c{k}", session=s, at=9.0), 9.0)
        c.handle(done(f"c{k}", "a", session=s, at=10.0 + k), 10.0 + k)  # expiries 11.0, 12.0
    assert c.tick(10.99) == []
    assert [(e.session_id, e.at) for e in c.tick(11.0)] == [("s1", 11.0)]
    assert [(e.session_id, e.at) for e in c.tick(12.5)] == [("s2", 12.5)]
    assert c.tick(20.0) == [] and c.state.leases.heap == []


def test_lease_timeout_prefers_session_gaps_then_model_gaps_then_tau():
    cfg = PolicyConfig(adaptive_lease=True, lease_timeout_s=0.7, lease_quantile=1.0, lease_margin_s=0.1,
                       lease_min_s=0.2, lease_max_s=9.0)
    state = RouterState()
    entry = state.session("s1")
    assert sr.lease_timeout(state, "s1", "m1", cfg) == 0.7  # nothing measured
    state.model("m1").gaps.extend([3.0] * (sr.MIN_MODEL_GAPS - 1))
    assert sr.lease_timeout(state, "s1", "m1", cfg) == 0.7  # too few model gaps
    state.model("m1").gaps.append(3.0)
    assert sr.lease_timeout(state, "s1", "m1", cfg) == 3.1  # the model's
    entry.gaps.extend([1.0] * (sr.MIN_SESSION_GAPS - 1))
    assert sr.lease_timeout(state, "s1", "m1", cfg) == 3.1  # too few session gaps
    entry.gaps.append(1.0)
    assert sr.lease_timeout(state, "s1", "m1", cfg) == 1.1  # the session's own
    assert sr.lease_timeout(state, "s2", "m1", cfg) == 3.1  # another session: the model's
    fixed = PolicyConfig(adaptive_lease=False, lease_timeout_s=0.7)
    assert sr.lease_timeout(state, "s1", "m1", fixed) == 0.7
    entry.gaps[:] = [0.01] * 3
    assert sr.lease_timeout(state, "s1", "m1", cfg) == 0.2  # clamped up to lease_min_s
    entry.gaps[:] = [50.0] * 3
    assert sr.lease_timeout(state, "s1", "m1", cfg) == 9.0  # clamped down to lease_max_s


def test_prune_pops_a_stale_entry_of_a_replaced_lease_once_it_reaches_the_top():
    book = LeaseBook()
    book.add(lease("s0", 1.0, call_id="top"))
    book.add(lease("s1", 5.0, call_id="c0"))
    book.add(lease("s1", 5.0, call_id="c1"))  # same expiry, new call: (5.0, s1, c0) is stale
    book.add(lease("s2", 4.0, call_id="k"))
    book.add(lease("s2", 7.0, call_id="k"))  # same call, new expiry: (4.0, s2, k) is stale
    assert len(book.heap) == 5
    book.remove("s0")  # the stale entries now reach the top, one after the other
    assert book.heap[0] == (5.0, "s1", "c1") and len(book.heap) == 2
