"""Session-prefill: who may enter a slot mid-way, when, and how many."""

from __future__ import annotations

from sched_driver import Driver, make, ret, work
from talaria.services.instance_agent.scheduler import CallAdmitted, CallParked

# Slot a opens at t=1.0 (after the 1 s switch); its P (a1) ends at 1.001 and decodes
# take 10 ms each, so t=1.05 is mid-slot, well before the slot's protected decode ends.
MID_SLOT = 1.05


def two_model_driver(**config):
    d = Driver(make(models=("a", "b"), **config))
    d.submit(work("a1", "a", max_tokens=200))
    d.submit(work("b1", "b", max_tokens=200))
    return d


def admitted(d, call_id):
    [event] = [e for e in d.of(CallAdmitted) if e.call_id == call_id]
    return event


def slot_end(d):
    """Index of the first switch after slot a opened (the end of slot a in round 0)."""
    return d.trace.index("S:b")


def test_return_with_device_kv_enters_at_the_next_decode_boundary():
    d = two_model_driver()
    d.at(MID_SLOT, ret("r1", "a", kv="device"))
    d.run()
    i = d.trace.index("SP:a:r1")
    assert d.trace[i - 1].startswith("D:a")  # an SP opportunity is a decode boundary
    assert i < slot_end(d)  # within the same slot
    assert d.trace[i + 1] == "D:a:a1,r1"  # decode resumes for everyone, the new call too
    assert admitted(d, "r1").via == "SP"
    assert d.sched.sp_admitted == 1


def test_return_with_host_kv_is_restored_through_sp():
    d = two_model_driver()
    d.at(MID_SLOT, ret("r1", "a", kv="host"))
    d.run()
    assert "SP:a:r1" in d.trace
    assert admitted(d, "r1").kv_state == "host"


def test_new_session_waits_for_the_next_slot_p():
    d = two_model_driver()
    d.at(MID_SLOT, work("n1", "a", max_tokens=2))
    d.run()
    i = d.trace.index("P:a:n1")
    assert i > slot_end(d)
    assert not [t for t in d.trace if t.startswith("SP:")]
    assert admitted(d, "n1").via == "P"


def test_continuation_without_reusable_kv_is_not_sp_eligible():
    d = two_model_driver()
    d.at(MID_SLOT, ret("r1", "a", kv="none", reuse=0))
    d.run()
    assert d.trace.index("P:a:r1") > slot_end(d)
    assert d.sched.sp_parked == 0  # never eligible, so never parked


def test_return_for_another_model_waits_for_that_models_p():
    d = two_model_driver()
    d.at(MID_SLOT, ret("rb", "b", kv="device"))
    d.run()
    assert "P:b:b1,rb" in d.trace
    assert admitted(d, "rb").via == "P"


def test_return_during_p_waits_for_d1_before_sp():
    d = two_model_driver()
    d.at(1.0005, ret("r1", "a"))  # arrives while P (1.000-1.001) runs
    d.run()
    i = d.trace.index("SP:a:r1")
    assert d.trace[i - 2 : i] == ["P:a:a1", "D:a:a1"]


def test_sp_batch_is_bounded_and_the_rest_are_parked_for_the_next_opportunity():
    d = two_model_driver(sp_max_batch=2)
    for k in range(5):
        d.at(MID_SLOT, ret(f"r{k}", "a", session=f"s{k}"))
    d.run()
    sps = [t for t in d.trace[: slot_end(d)] if t.startswith("SP:")]
    assert sps == ["SP:a:r0,r1", "SP:a:r2,r3", "SP:a:r4"]
    first = d.trace.index(sps[0])
    assert d.trace[first + 1].startswith("D:a") and d.trace[first + 2] == sps[1]
    parked = d.of(CallParked)
    assert sorted(p.call_id for p in parked) == ["r2", "r3", "r4"]  # once each
    assert {p.reason for p in parked} == {"sp_batch"}
    assert d.sched.sp_parked == 3 and d.sched.sp_admitted == 5


def test_return_over_the_sp_budget_is_parked_and_admitted_by_the_next_slot_p():
    d = two_model_driver()
    d.at(MID_SLOT, ret("big", "a", prompt=400_000, reuse=100))  # ~4 s of prefill
    d.at(MID_SLOT, ret("small", "a", session="s-small"))
    d.run()
    [parked] = d.of(CallParked)
    assert (parked.call_id, parked.reason) == ("big", "sp_budget")
    assert d.trace.index("SP:a:small") < slot_end(d)  # skipped, not blocked, by the big one
    assert d.trace.index("P:a:big") > slot_end(d)
    assert admitted(d, "big").via == "P"


def test_kv_budget_bounds_the_sp_batch():
    # a1 holds 100 + 200 bytes of KV; each return needs 1000 + 4.
    d = two_model_driver(kv_budget_bytes=1400, max_batch=8)
    d.at(MID_SLOT, ret("r1", "a", session="s1"))
    d.at(MID_SLOT, ret("r2", "a", session="s2"))
    d.run()
    assert "SP:a:r1" in d.trace
    assert [(p.call_id, p.reason) for p in d.of(CallParked)] == [("r2", "kv_budget")]


def test_return_in_the_final_decode_is_parked_until_the_next_slot():
    d = two_model_driver(fill_slot=False)  # the slot ends with its protected decode
    d.run_until(
        lambda d: d.sched.slot is not None
        and d.sched.slot.model == "a"
        and d.sched.slot.decode_left == 1
    )
    d.at(d.now + 0.005, ret("late", "a"))  # during the last protected decode (Dfin)
    d.run()
    assert [(p.call_id, p.reason) for p in d.of(CallParked)] == [("late", "slot_closed")]
    assert d.trace.index("P:a:late") > slot_end(d)


def test_parked_return_gets_the_next_opportunity_in_the_same_slot():
    d = two_model_driver(sp_max_batch=1)
    d.at(MID_SLOT, ret("r1", "a", session="s1"))
    d.at(MID_SLOT, ret("r2", "a", session="s2"))
    d.run()
    assert d.trace.index("SP:a:r2") < slot_end(d)
    assert admitted(d, "r2").via == "SP"


def test_sp_extends_protected_decode_to_keep_the_decode_share():
    d = two_model_driver()
    d.at(MID_SLOT, ret("r1", "a"))
    d.run_until(lambda d: "SP:a:r1" in d.trace)
    slot = d.sched.slot
    assert slot.protected > slot.plan.protected_decode
    assert slot.sp_left_s < slot.plan.sp_budget_s


def test_update_kv_can_take_a_return_out_of_sp():
    d = two_model_driver()
    d.at(MID_SLOT, ret("r1", "a", session="sr"))
    d.run_until(lambda d: "r1" in d.sched.calls)
    assert d.sched.update_kv("sr", "a", "none") == 1  # the engine lost the prefix
    d.run()
    assert "SP:a:r1" not in d.trace
    assert admitted(d, "r1").kv_state == "none"


def test_a_return_that_arrived_before_p_never_enters_by_sp():
    # Paper §3.4: SP serves continuations that arrive *after* the slot's P. r0 was queued
    # before P, which had no room for it (max_batch); when a2 finishes mid-slot a place
    # frees up, but r0 still waits for the next slot's P.
    d = Driver(make(models=("a", "b"), max_batch=2))
    d.submit(work("a1", "a", max_tokens=200))
    d.submit(work("a2", "a", max_tokens=3))
    d.submit(ret("r0", "a"))
    d.submit(work("b1", "b", max_tokens=200))
    d.run()
    assert not [t for t in d.trace if t.startswith("SP:")]
    assert admitted(d, "r0").via == "P" and d.trace.index("P:a:r0") > slot_end(d)
