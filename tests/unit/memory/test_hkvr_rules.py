"""HKVR bookkeeping rules, one per test (services/instance_agent/memory/hkvr_core.py),
tensor-free. Each test breaks when its rule alone is broken (issue 26)."""

from talaria.services.instance_agent.memory.hkvr_core import HkvrCore
from talaria.services.instance_agent.memory.host_pages import LayoutDescriptor, RankReport, agreed_prefix

PS = 16
T = LayoutDescriptor("m", 0, 0, 0, PS, "float32", "gqa", (4, 2, PS, 1, 32))


def reports(hashes, ranks=1, tokens=None):
    tokens = len(hashes) * PS if tokens is None else tokens
    return [RankReport(r, tokens, tuple(hashes)) for r in range(ranks)]


def saved(core, session, hashes, ranks=1, model="m"):
    plan = core.plan_save(model, session, reports(hashes, ranks), T)
    core.complete(plan.job_id)
    return plan


# ---- a multi-rank save that runs out of host capacity part way --------------------------------


def test_a_page_only_some_ranks_could_save_is_never_published():
    core = HkvrCore(3, ranks=2)  # rank 0 takes pages 1, 2; rank 1 gets page 1 only
    plan = core.plan_save("m", "s", reports([1, 2], ranks=2), T)
    assert [(c.rank, c.key[2]) for c in plan.copies] == [(0, 1), (0, 2), (1, 1)]
    assert core.counters.full_saves == 1 and core.counters.saved_pages == 3
    assert core.match("m", [1, 2]) == 0  # nothing before the copies complete
    assert core.complete(plan.job_id) == [1]  # page 2 is whole on rank 0 only
    assert core.match("m", [1, 2]) == 1 and core.session_tokens("s", "m", PS) == PS


def test_a_save_where_the_last_rank_gets_no_page_publishes_nothing():
    core = HkvrCore(2, ranks=2)
    plan = core.plan_save("m", "s", reports([1, 2], ranks=2), T)
    assert [c.rank for c in plan.copies] == [0, 0]
    assert core.complete(plan.job_id) == [] and core.match("m", [1]) == 0
    assert core.session_tokens("s", "m", PS) == 0 and core.session_prefixes(PS) == []


def test_a_full_pool_stops_a_rank_at_its_first_missing_page():
    core = HkvrCore(2, ranks=1)
    saved(core, "a", [1])  # page 1 referenced and committed: the only reclaimable one
    core.begin_restore("m", [1])  # pinned by a restore: nothing reclaimable now
    plan = core.plan_save("m", "b", reports([5, 6, 7]), T)
    assert [c.key[2] for c in plan.copies] == [5]  # 6 had no slot: 7 is useless without it
    assert core.counters.full_saves == 1


# ---- publication ---------------------------------------------------------------------------


def test_publication_needs_every_rank_committed():
    core = HkvrCore(8, ranks=2)
    a = core.plan_save("m", "a", [RankReport(0, PS, (1,))], T)  # rank 0 only
    assert core.complete(a.job_id) == []
    b = core.plan_save("m", "b", [RankReport(1, PS, (1,))], T)  # rank 1's page, copying
    assert core.match("m", [1]) == 0
    assert core.complete(b.job_id) == [1]


def test_already_published_pages_are_not_published_again():
    core = HkvrCore(8, ranks=1)
    saved(core, "a", [1, 2])
    plan = core.plan_save("m", "b", reports([1, 2, 3]), T)
    assert core.complete(plan.job_id) == [3]


def test_match_stops_at_the_first_unpublished_page():
    core = HkvrCore(8, ranks=1)
    saved(core, "a", [1, 2])
    assert core.match("m", [1, 2, 3]) == 2 and core.match("m", [9, 1]) == 0 and core.match("x", [1]) == 0


# ---- save bookkeeping ----------------------------------------------------------------------


def test_saving_held_pages_again_copies_nothing_and_touches_them():
    core = HkvrCore(3, ranks=1)
    saved(core, "a", [1])
    saved(core, "b", [2])
    saved(core, "c", [3])
    core.drop_session("a", "m")
    core.drop_session("b", "m")
    again = core.plan_save("m", "b", reports([2]), T)  # re-saves 2: a touch, no copy
    assert again.copies == () and core.counters.saved_pages == 3
    core.complete(again.job_id)
    core.drop_session("b", "m")
    saved(core, "d", [4])  # the pool is full: the least recently used unreferenced page goes
    assert ("m", 0, 1) not in core.pages and ("m", 0, 2) in core.pages


def test_truncated_saves_count_only_a_rank_that_committed_past_the_agreed_prefix():
    core = HkvrCore(16, ranks=2)
    core.plan_save("m", "s", [RankReport(0, 2 * PS, (1, 2)), RankReport(1, 2 * PS, (1, 2))], T)
    assert core.counters.truncated_saves == 0
    # rank 1 reports more hashes than it committed: still agreed on 1 page, nothing cut
    core.plan_save("m", "t", [RankReport(0, PS, (1,)), RankReport(1, PS, (1, 2))], T)
    assert core.counters.truncated_saves == 0
    core.plan_save("m", "u", [RankReport(0, 2 * PS, (1, 2)), RankReport(1, PS, (1, 2))], T)
    assert core.counters.truncated_saves == 1


def test_agreed_prefix_rules():
    assert agreed_prefix([], PS) == 0
    assert agreed_prefix([RankReport(0, 3 * PS - 1, (1, 2, 3))], PS) == 2  # a partial page does not count
    assert agreed_prefix([RankReport(0, 5 * PS, (1, 2))], PS) == 2  # no more pages than hashes
    assert agreed_prefix([RankReport(0, 3 * PS, (1, 2, 3)), RankReport(1, 3 * PS, (1, 9, 3))], PS) == 1
    assert agreed_prefix([RankReport(0, 2 * PS, (7, 2)), RankReport(1, 2 * PS, (1, 2))], PS) == 0
    three = [RankReport(r, 2 * PS, (1, 2)) for r in range(2)] + [RankReport(2, 2 * PS, (1, 5))]
    assert agreed_prefix(three, PS) == 1  # the third rank alone disagrees


def test_descriptors_name_each_page_and_its_committed_length():
    core = HkvrCore(8, ranks=2)
    plan = core.plan_save("m", "s", reports([1, 2], ranks=2), T)
    descs = {(c.rank, c.page_index): c.desc for c in plan.copies}
    assert descs[(1, 1)].rank == 1 and descs[(1, 1)].prefix_hash == 2
    assert (descs[(0, 0)].committed_tokens, descs[(0, 1)].committed_tokens) == (PS, 2 * PS)
    assert len({c.slot for c in plan.copies}) == 4  # one slot per page


# ---- restore -------------------------------------------------------------------------------


def test_restore_pins_every_rank_of_the_published_prefix_and_counts_hits_and_misses():
    core = HkvrCore(8, ranks=2)
    saved(core, "a", [1, 2], ranks=2)
    plan = core.begin_restore("m", [1, 2, 3])
    assert plan.hashes == (1, 2) and [len(row) for row in plan.slots] == [2, 2]
    assert all(core.pages[("m", r, h)].pins == 1 for r in (0, 1) for h in (1, 2))
    assert (core.counters.hits, core.counters.misses, core.counters.restored_pages) == (1, 0, 2)
    core.end_restore(plan)
    assert all(core.pages[("m", r, h)].pins == 0 for r in (0, 1) for h in (1, 2))
    assert core.begin_restore("m", [9]).hashes == () and core.counters.misses == 1


# ---- sessions and eviction -----------------------------------------------------------------


def test_a_later_checkpoint_extends_the_session_and_refs_only_new_pages():
    core = HkvrCore(8, ranks=1)
    saved(core, "a", [1])
    saved(core, "a", [1, 2])
    assert (core.pages[("m", 0, 1)].refs, core.pages[("m", 0, 2)].refs) == (1, 1)
    assert core.session_tokens("a", "m", PS) == 2 * PS
    saved(core, "a", [7])  # a different prefix replaces the old one
    assert (core.pages[("m", 0, 1)].refs, core.pages[("m", 0, 7)].refs) == (0, 1)
    assert core.session_tokens("a", "m", PS) == PS


def test_dropping_a_session_unrefs_its_pages_once_and_they_become_reclaimable_first():
    core = HkvrCore(3, ranks=1)
    saved(core, "a", [1])
    saved(core, "b", [1, 2])  # page 1 shared by a and b
    saved(core, "c", [3])
    core.drop_session("b", "m")
    assert core.pages[("m", 0, 1)].refs == 1 and core.pages[("m", 0, 2)].refs == 0
    core.drop_session("b", "m")  # twice: nothing more
    assert core.pages[("m", 0, 1)].refs == 1
    saved(core, "d", [4])
    assert ("m", 0, 2) not in core.pages  # the unreferenced one, though 1 is older
    assert ("m", 0, 1) in core.pages


def test_the_oldest_referenced_page_goes_when_none_is_unreferenced():
    core = HkvrCore(2, ranks=1)
    saved(core, "a", [1])
    saved(core, "b", [2])
    core.end_restore(core.begin_restore("m", [1]))  # 1 is now the most recently used
    saved(core, "c", [3])
    assert ("m", 0, 2) not in core.pages and ("m", 0, 1) in core.pages
    assert core.counters.evictions == 1


def test_evicting_a_published_page_cuts_every_session_back_to_it():
    core = HkvrCore(3, ranks=1)
    saved(core, "a", [1, 2])
    core.end_restore(core.begin_restore("m", [1, 2]))  # touch 1, 2 after...
    saved(core, "b", [9])
    core.end_restore(core.begin_restore("m", [1]))  # ... and 1 again: 2 is the oldest of a's
    core.end_restore(core.begin_restore("m", [9]))
    saved(core, "c", [5])  # evicts 2
    assert core.match("m", [1, 2]) == 1 and core.session_tokens("a", "m", PS) == PS
    assert ("m", 2) not in core.published
    # a later save of 2 (b's next checkpoint) extends a again (it waits on 2)
    saved(core, "b", [1, 2])
    assert core.session_tokens("a", "m", PS) == 2 * PS


def test_past_capacity_over_ranks_sessions_the_least_recently_saved_are_dropped():
    # 3 pages: a session holds at least one (one per rank), so past 3 sessions some hold
    # nothing of their own (here they share page 1, a system prompt). The least recently
    # saved goes, and its refs with it; before, every session ever saved stayed.
    core = HkvrCore(3, ranks=1)
    core.changes = set()
    for sid, hashes in (("a", [1]), ("b", [1, 2]), ("a", [1, 3]), ("c", [1])):  # a saved again
        saved(core, sid, hashes)
    assert list(core.sessions) == [("b", "m"), ("a", "m"), ("c", "m")]
    core.changes.clear()
    saved(core, "d", [1])
    assert list(core.sessions) == [("a", "m"), ("c", "m"), ("d", "m")] and core.changes >= {("b", "m")}
    assert core.session_tokens("b", "m", PS) == 0 and core.session_tokens("a", "m", PS) == 2 * PS
    assert core.pages[("m", 0, 2)].refs == 0  # b's own page: reclaimed first from now on


def test_a_dropped_session_leaves_the_restorable_index():
    core = HkvrCore(4, ranks=1)
    core.changes = set()
    saved(core, "a", [1, 2])
    assert core.changes == {("a", "m")}
    core.changes.clear()
    core.drop_session("a", "m")
    assert core.changes == {("a", "m")} and core.session_tokens("a", "m", PS) == 0
    assert core._readers == {} and core._waiting == {}


def test_pending_jobs_end_with_completion():
    core = HkvrCore(4, ranks=1)
    assert core.capacity == 4  # reported as the host pool's size (engine/report.py)
    plan = core.plan_save("m", "a", reports([1]), T)
    assert core.pending_jobs("m") == [plan.job_id] and core.pending_jobs("other") == []
    core.complete(plan.job_id)
    assert core.pending_jobs() == [] and core.used_pages == 1


def test_a_disagreeing_rank_s_private_pages_are_reclaimed_before_the_published_prefix():
    core = HkvrCore(4, ranks=2)
    reps = [RankReport(0, 2 * PS, (1, 2)), RankReport(1, 2 * PS, (1, 99))]  # agree on page 1 only
    core.complete(core.plan_save("m", "s", reps, T).job_id)
    assert core.match("m", [1, 2]) == 1
    assert (core.pages[("m", 0, 2)].refs, core.pages[("m", 1, 99)].refs) == (0, 0)  # nobody's prefix
    core.complete(core.plan_save("m", "t", [RankReport(0, PS, (7,)), RankReport(1, PS, (7,))], T).job_id)
    assert ("m", 0, 2) not in core.pages and ("m", 1, 99) not in core.pages  # the private tail went
    assert core.match("m", [1]) == 1 and core.match("m", [7]) == 1


def test_the_change_feed_names_only_sessions_whose_restorable_length_changed():
    core = HkvrCore(4, ranks=1)
    core.changes = set()
    core.plan_save("m", "a", reports([1]), T)  # in flight: nothing restorable yet
    assert core.changes == set()
    core.drop_session("a", "m")  # dropped before anything was restorable: no change to report
    assert core.changes == set()
