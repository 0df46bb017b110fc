"""Staging planner states and the executor's D2D/H2D gather."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.services.instance_agent.memory.staging import StagingExecutor, StagingPlanner


def test_slots_stay_above_the_limit_and_grow_downward():
    p = StagingPlanner(100)
    p.plan("m2", 350, lo_limit=700, hi=1000)
    assert [(c.src_lo, c.src_hi, c.dst_lo, c.dst_hi, c.state) for c in p.chunks] == [
        (0, 100, 900, 1000, "missing"), (100, 200, 800, 900, "missing"),
        (200, 300, 700, 800, "missing"), (300, 350, -1, -1, "unplaced"),
    ]
    p.next_writes(lambda lo, hi: True, limit=9)
    for c in p.chunks[:3]:
        p.write_done(c.index)
    plan = p.gather_plan("m2", 350)
    assert plan.path == "d2d_partial" and plan.h2d == ((300, 350),)


def test_dirty_blocked_and_gather_paths():
    p = StagingPlanner(100)
    p.plan("m2", 300, lo_limit=0, hi=1000)
    writes = p.next_writes(lambda lo, hi: True, limit=2)
    assert [c.index for c in writes] == [0, 1]
    assert p.blocked(850, 860) and not p.blocked(500, 600)  # allocator skips chunk 1's slot
    for c in writes:
        p.write_done(c.index)
    assert p.gather_plan("other", 300).path == "host_only"
    plan = p.gather_plan("m2", 300)
    assert plan.path == "d2d_partial" and plan.staged_bytes == 200 and plan.uncovered_bytes == 100
    p.on_kv_alloc(950, 960)  # a KV page lands on chunk 0
    assert p.chunks[0].state == "dirty"
    plan = p.gather_plan("m2", 300)
    assert [c.index for c in plan.d2d] == [1] and plan.dirty_chunks == 1
    assert p.next_writes(lambda lo, hi: lo != 900, limit=5) == [p.chunks[2]]  # dirty slot still used
    p.write_done(2)
    assert p.gather_plan("m2", 300).path == "d2d_partial"


def test_executor_gathers_exact_bytes():
    buf = torch.zeros(4096, dtype=torch.uint8)
    image = torch.randint(0, 255, (1000,), dtype=torch.uint8)
    ex = StagingExecutor(buf, 256, "cpu", inflight=8)
    ex.stage("m", image, lo_limit=1024, hi=4096)
    ex.pump(lambda lo, hi: True)
    ex.wait_all()
    ex.planner.on_kv_alloc(4096 - 300, 4096 - 290)  # dirty chunk 1
    res = ex.gather("m", image, buf[:1000])
    assert res.plan.path == "d2d_partial" and res.bytes_d2d == 1000 - 256 and res.bytes_h2d == 256
    assert torch.equal(buf[:1000], image)
    ex.close()


@settings(max_examples=200, deadline=None)
@given(weight=st.integers(1, 5000), chunk=st.integers(64, 900), lo_limit=st.integers(0, 3000),
       top=st.integers(0, 6000), steps=st.lists(st.tuples(st.integers(-100, 7000), st.integers(0, 3000),
                                                        st.integers(0, 4)), max_size=12))
def test_counters_and_window_agree_with_a_full_scan(weight, chunk, lo_limit, top, steps):
    p = StagingPlanner(chunk)
    q, bulk = StagingPlanner(chunk), StagingPlanner(chunk)  # writes always complete at once
    for planner in (p, q, bulk):
        planner.plan("b", weight, lo_limit, top)
    for lo, span, writes in steps:
        hi = lo + span
        expect_dirty = {c.index for c in p.chunks if c.state == "clean" and c.overlaps(lo, hi)}
        expect_blocked = any(c.state == "writing" and c.overlaps(lo, hi) for c in p.chunks)
        assert p.blocked(lo, hi) == expect_blocked
        before = {c.index for c in p.chunks if c.state == "dirty"}
        p.on_kv_alloc(lo, hi)
        assert {c.index for c in p.chunks if c.state == "dirty"} == before | expect_dirty
        free = lambda a, b: a >= hi or b <= lo  # noqa: E731
        expect_writes = [c for c in p.chunks if c.state in ("missing", "dirty") and free(c.dst_lo, c.dst_hi)][:writes]
        started = p.next_writes(free, writes)
        assert started == expect_writes
        for c in started[:1]:
            p.write_done(c.index)  # one write finishes, the others stay in flight
        assert p.staged_bytes() == sum(c.nbytes for c in p.chunks if c.state == "clean")
        assert p.writing() == [c for c in p.chunks if c.state == "writing"]
        q.on_kv_alloc(lo, hi)
        written = q.next_writes(free, writes)
        for c in written:
            q.write_done(c.index)  # every write finishes: what write_through does in bulk
        bulk.on_kv_alloc(lo, hi)
        assert bulk.write_through(free, writes) == len(written)
        assert [c.state for c in q.chunks] == [c.state for c in bulk.chunks]
        assert q.staged_bytes() == bulk.staged_bytes()
