"""Session-prefill eligibility, each condition alone (paper §3.4; cold_pool `_sp_eligible`):
a continuation, with reusable tokens, whose KV is charged as device or host (host only with
HKVR), that arrived after the slot's P. The other tests mostly break two at once."""

from __future__ import annotations

from sched_driver import Driver, make, ret, work

from talaria.services.instance_agent.scheduler import CallFinished, CallParked, Decode, Prefill

MID_SLOT = 1.05  # mid slot a (see test_sched_sp.py)


def entered_by_sp(the_call, **config) -> bool:
    d = Driver(make(models=("a", "b"), **config))
    d.submit(work("a1", "a", max_tokens=200))
    d.submit(work("b1", "b", max_tokens=200))
    d.at(MID_SLOT, the_call)
    d.run()
    return f"SP:a:{the_call.call_id}" in d.trace


def test_a_return_with_device_kv_enters_by_sp():
    assert entered_by_sp(ret("r1", "a", kv="device", reuse=900))


def test_device_kv_with_nothing_reusable_is_not_eligible():
    assert not entered_by_sp(ret("r1", "a", kv="device", reuse=0))


def test_reusable_tokens_without_kv_are_not_eligible():
    assert not entered_by_sp(ret("r1", "a", kv="none", reuse=900))


def test_host_kv_is_eligible_only_with_hkvr():
    assert entered_by_sp(ret("r1", "a", kv="host", reuse=900), hkvr=True)
    assert not entered_by_sp(ret("r1", "a", kv="host", reuse=900), hkvr=False)


def test_a_call_that_is_no_continuation_is_not_eligible_even_with_kv():
    assert not entered_by_sp(work("n1", "a", kv="device", reuse=900, prompt=1000))


def test_sp_off_admits_nobody_mid_slot_and_parks_nobody():
    assert not entered_by_sp(ret("r1", "a", kv="device", reuse=900), sp=False)
    d = Driver(make(models=("a", "b"), sp=False))
    d.submit(work("a1", "a", max_tokens=200))
    d.submit(work("b1", "b", max_tokens=200))
    d.at(MID_SLOT, ret("r1", "a", kv="device", reuse=900))
    d.run()
    assert d.of(CallParked) == [] and d.sched.sp_parked == 0  # nothing is an SP candidate


def test_sp_fills_only_the_batch_slots_the_running_calls_leave():
    d = Driver(make(models=("a", "b"), max_batch=3, sp_max_batch=8))
    d.submit(work("a1", "a", max_tokens=200))
    d.submit(work("b1", "b", max_tokens=200))
    for k in range(4):
        d.at(MID_SLOT, ret(f"r{k}", "a", session=f"s{k}"))
    d.run()
    sps = [t for t in d.trace[: d.trace.index("S:b")] if t.startswith("SP:")]
    assert sps[0] == "SP:a:r0,r1"  # a1 runs: two of three slots free (the rest once these finish)


def test_without_sp_a_queued_return_contends_so_the_slot_does_not_extend_past_it():
    d = Driver(make(models=("a",), sp=False))
    d.submit(work("a1", "a", max_tokens=300))
    d.at(MID_SLOT, ret("r1", "a", kv="device", reuse=900, max_tokens=2))
    d.run()
    finished = [e.call_id for e in d.of(CallFinished)]
    assert finished.index("r1") < finished.index("a1")  # admitted by the next slot's P, not after a1


def _decode_after_first_sp(sp_max_batch: int, returns: int) -> Decode:
    d = Driver(make(models=("a", "b"), sp_max_batch=sp_max_batch))
    d.max_steps = 8
    d.submit(work("a1", "a", max_tokens=200))
    d.submit(work("b1", "b", max_tokens=200))
    for k in range(returns):
        d.at(MID_SLOT, ret(f"r{k}", "a", session=f"s{k}"))
    d.run()
    i = next(j for j, a in enumerate(d.actions) if isinstance(a, Prefill) and a.session_prefill)
    nxt = d.actions[i + 1]
    assert isinstance(nxt, Decode)
    return nxt


def test_after_an_sp_batch_that_left_returns_behind_decode_single_steps_to_the_next_sp():
    assert _decode_after_first_sp(sp_max_batch=1, returns=2).steps == 1


def test_after_an_sp_batch_that_took_every_return_decode_runs_several_steps():
    assert _decode_after_first_sp(sp_max_batch=8, returns=1).steps > 1
