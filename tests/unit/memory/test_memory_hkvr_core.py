"""HKVR bookkeeping invariants, tensor-free (the simulator's view)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.services.instance_agent.memory.hkvr_core import HkvrCore
from talaria.services.instance_agent.memory.host_pages import LayoutDescriptor, RankReport, agreed_prefix

PS = 16
T = LayoutDescriptor("m", 0, 0, 0, PS, "float32", "gqa", (4, 2, PS, 1, 32))


def reports(hashes, ranks=2, tokens=None):
    tokens = len(hashes) * PS if tokens is None else tokens
    return [RankReport(r, tokens, tuple(hashes)) for r in range(ranks)]


def test_unpublished_until_copy_completes():
    core = HkvrCore(16, ranks=2)
    plan = core.plan_save("m", "s", reports([1, 2, 3]), T)
    assert len(plan.copies) == 6 and plan.agreed_pages == 3
    assert core.match("m", [1, 2, 3]) == 0  # copies in flight: nothing published
    assert core.session_tokens("s", "m", PS) == 0
    assert core.complete(plan.job_id) == [1, 2, 3]
    assert core.match("m", [1, 2, 3, 4]) == 3
    assert core.session_tokens("s", "m", PS) == 3 * PS


def test_pinned_pages_are_never_reclaimed():
    core = HkvrCore(4, ranks=1)
    first = core.plan_save("m", "a", reports([1, 2, 3, 4], ranks=1), T)  # fills the pool, pinned
    second = core.plan_save("m", "b", reports([7, 8], ranks=1), T)
    assert second.copies == () and core.counters.evictions == 0  # nothing reclaimable
    assert all(core.pages[("m", 0, h)].pins == 1 for h in (1, 2, 3, 4))
    core.complete(first.job_id)
    core.complete(second.job_id)
    restore = core.begin_restore("m", [1, 2])  # restore pins 1 and 2
    third = core.plan_save("m", "c", reports([9, 10, 11], ranks=1), T)
    evicted = {h for h in (1, 2, 3, 4) if ("m", 0, h) not in core.pages}
    assert evicted == {3, 4} and len(third.copies) == 2  # pins outlive cache refs
    core.end_restore(restore)


def test_unreferenced_pages_reclaimed_before_referenced():
    core = HkvrCore(3, ranks=1)
    core.complete(core.plan_save("m", "a", reports([1, 2], ranks=1), T).job_id)
    lag = [RankReport(0, PS, (5, 6))]  # committed only 1 page: page 6 stays private
    core.complete(core.plan_save("m", "b", lag, T).job_id)
    assert core.pages[("m", 0, 5)].refs == 1
    core.drop_session("a", "m")  # pages 1, 2 lose their cache refs
    core.complete(core.plan_save("m", "c", reports([9], ranks=1), T).job_id)
    assert ("m", 0, 5) in core.pages and ("m", 0, 1) not in core.pages
    assert core.counters.evictions == 1


def test_rank_disagreement_truncates_publication():
    core = HkvrCore(32, ranks=2)
    good = [1, 2, 3, 4]
    bad = RankReport(1, 4 * PS, (1, 2, 99, 100))  # rank 1 diverges at page 2
    assert agreed_prefix([RankReport(0, 4 * PS, tuple(good)), bad], PS) == 2
    plan = core.plan_save("m", "s", [RankReport(0, 4 * PS, tuple(good)), bad], T)
    assert plan.agreed_pages == 2
    core.complete(plan.job_id)
    assert core.match("m", good) == 2  # the rest is recomputed, never restored
    assert core.session_tokens("s", "m", PS) == 2 * PS
    assert core.counters.truncated_saves == 1
    lag = [RankReport(0, 4 * PS, tuple(good)), RankReport(1, 3 * PS - 1, tuple(good[:2]))]
    assert agreed_prefix(lag, PS) == 2
    fixed = core.plan_save("m", "s", reports(good), T)  # a later checkpoint agrees
    core.complete(fixed.job_id)
    assert core.match("m", good) == 4


def test_drain_is_scoped_to_a_model():
    core = HkvrCore(32, ranks=1)
    a = core.plan_save("a", "s1", reports([1], ranks=1), T)
    b = core.plan_save("b", "s2", reports([2], ranks=1), T)
    assert core.pending_jobs("a") == [a.job_id]
    assert core.pending_jobs("b") == [b.job_id]
    assert sorted(core.pending_jobs()) == sorted([a.job_id, b.job_id])


def test_lru_eviction_and_counters():
    core = HkvrCore(4, ranks=1)
    core.complete(core.plan_save("m", "a", reports([1, 2], ranks=1), T).job_id)
    core.complete(core.plan_save("m", "b", reports([3, 4], ranks=1), T).job_id)
    core.begin_restore("m", [1, 2])  # hit, touches 1 and 2
    core.end_restore(core.begin_restore("m", [42]))  # miss
    core.complete(core.plan_save("m", "c", reports([5], ranks=1), T).job_id)
    assert ("m", 0, 3) not in core.pages  # least recently used went first
    assert (core.counters.hits, core.counters.misses, core.counters.evictions) == (1, 1, 1)
    assert core.session_tokens("b", "m", PS) == 0  # hole at the first page: nothing restorable


# The indexes must always agree with a walk: restorable prefixes, and the eviction victim.
_op = st.one_of(
    st.tuples(st.just("save"), st.integers(0, 3), st.integers(0, 1), st.integers(0, 6), st.booleans()),
    st.tuples(st.just("drop"), st.integers(0, 3), st.integers(0, 1)),
    st.tuples(st.just("restore"), st.integers(0, 3), st.integers(0, 1)),
    st.tuples(st.just("complete"),),
)


def _victim_by_scan(core):
    """The eviction rule read literally: in LRU order, the first reclaimable unreferenced page,
    else the first reclaimable one."""
    reclaimable = [p for p in core.pages.values() if p.pins == 0 and p.state == "committed"]
    unreferenced = [p for p in reclaimable if p.refs <= 0]
    return (unreferenced or reclaimable or [None])[0]


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, max_size=40), capacity=st.integers(2, 12), ranks=st.integers(1, 2))
def test_restorable_prefix_index_matches_a_walk(ops, capacity, ranks):
    core = HkvrCore(capacity, ranks=ranks)
    core.changes, mirror = set(), {}  # a consumer of the change feed
    for op in ops:
        if op[0] == "save":
            _, s, m, pages, lag = op
            # sessions 0 and 1 share their first pages, so publications and evictions cross
            hashes = tuple(hash(("shared" if s < 2 and j < 3 else s, j)) for j in range(pages))
            reps = [RankReport(r, (pages - (lag and r == ranks - 1)) * PS, hashes) for r in range(ranks)]
            core.plan_save(f"m{m}", f"s{s}", reps, T)
        elif op[0] == "drop":
            core.drop_session(f"s{op[1]}", f"m{op[2]}")
        elif op[0] == "restore":
            pre = core.sessions.get((f"s{op[1]}", f"m{op[2]}"))
            if pre is not None:
                core.end_restore(core.begin_restore(f"m{op[2]}", pre.hashes))
        elif core.jobs:
            core.complete(next(iter(core.jobs)))
        for (sid, model), pre in core.sessions.items():
            walk = core.match(model, pre.hashes)
            assert core.session_tokens(sid, model, PS) == walk * PS
        assert core._victim() is _victim_by_scan(core)
        for skey in core.changes:
            pre = core.sessions.get(skey)
            mirror[skey] = pre.published if pre is not None else 0
        core.changes.clear()
        assert {k: v for k, v in mirror.items() if v} == {k: p.published for k, p in core.sessions.items() if p.published}
    assert sorted(core.session_prefixes(PS)) == sorted(
        (sid, model, core.match(model, pre.hashes) * PS)
        for (sid, model), pre in core.sessions.items() if core.match(model, pre.hashes))


# ---- pinned by issue 15 (a hand mutation run left these alive) ------------------------------


def test_a_page_whose_copy_is_in_flight_is_never_published_by_another_save():
    core = HkvrCore(16, ranks=1)
    first = core.plan_save("m", "a", reports([1, 2], ranks=1), T)  # copies of 1, 2 in flight
    second = core.plan_save("m", "b", reports([1, 2, 3], ranks=1), T)  # shares them; copies 3
    assert [c.key[2] for c in second.copies] == [3]
    assert core.complete(second.job_id) == []  # 3 is whole, but 1 and 2 are still copying
    assert core.match("m", [1, 2, 3]) == 0 and core.session_tokens("b", "m", PS) == 0
    core.complete(first.job_id)
    assert core.match("m", [1, 2, 3]) == 3


def test_shared_prefix_saves_completing_out_of_order_publish_the_later_ones_page():
    # The later save's copy completes first: its new page is committed, and must be
    # published once the earlier save commits the shared prefix (it was never, before).
    core = HkvrCore(16, ranks=2)
    first = core.plan_save("m", "a", reports([1, 2]), T)
    second = core.plan_save("m", "b", reports([1, 2, 3, 4]), T)
    core.complete(second.job_id)
    assert sorted(core.complete(first.job_id)) == [1, 2, 3, 4]
    assert core.match("m", [1, 2, 3, 4]) == 4
    assert core.session_tokens("b", "m", PS) == 4 * PS and core.session_tokens("a", "m", PS) == 2 * PS


def test_end_restore_releases_the_transfer_pin_and_keeps_the_cache_ref():
    core = HkvrCore(2, ranks=1)
    core.complete(core.plan_save("m", "a", reports([1, 2], ranks=1), T).job_id)
    plan = core.begin_restore("m", [1, 2])
    assert [core.pages[("m", 0, h)].pins for h in (1, 2)] == [1, 1]
    core.end_restore(plan)
    assert [(core.pages[("m", 0, h)].pins, core.pages[("m", 0, h)].refs) for h in (1, 2)] == [(0, 1), (0, 1)]
    # Unpinned, the pages are reclaimable again: a new save under pressure may take them.
    assert len(core.plan_save("m", "b", reports([7], ranks=1), T).copies) == 1


def test_a_leased_export_keeps_its_pages_through_saves_that_evict_and_only_the_sessions_own():
    """vLLM's export (issue 40): the agent copies leased pages out of the shared pool after the
    lease returns, while the engine saves on; a leased page is never the slot a save reuses."""
    core = HkvrCore(4, ranks=1)
    core.complete(core.plan_save("m", "a", reports([1, 2, 3], ranks=1), T).job_id)
    assert core.lease_shareable("b", "m", [1, 2, 3]).slots == ()  # another session's pages: none
    assert core.lease_shareable("a", "m", [1, 9]).hashes == (1,)  # stops where the prefix differs
    lease = core.lease_shareable("a", "m", [1, 2, 3])
    core.end_restore(core.lease_shareable("a", "m", [1]))
    assert lease.hashes == (1, 2, 3) and [row[0].slot for row in lease.slots] == [0, 1, 2]
    core.drop_session("a", "m")  # unreferenced now, but pinned by the lease
    later = core.plan_save("m", "c", reports([7, 8, 9], ranks=1), T)
    assert len(later.copies) == 1 and {c.slot for c in later.copies} == {3}  # the free slot only
    core.complete(later.job_id)
    core.end_restore(lease)  # the export is done: its pages are reclaimable again
    again = core.plan_save("m", "d", reports([5, 6], ranks=1), T)
    assert len(again.copies) == 2 and core.counters.hits == 0
