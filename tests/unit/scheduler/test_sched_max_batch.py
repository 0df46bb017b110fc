"""A later slot's P counts the calls still running on its model: max_batch bounds what runs,
not only what one prefill takes (ColdPool._select_p's free slots)."""

from __future__ import annotations

from tests.unit.scheduler.sched_driver import Driver, make, work


def test_a_later_p_admits_only_into_the_places_running_calls_left():
    d = Driver(make(models=("a",), initial_model="a", max_batch=2))
    d.submit(work("a1", max_tokens=400))
    d.submit(work("a2", max_tokens=400))
    d.at(0.05, work("a3", max_tokens=4))  # arrives after the first P, while a1 and a2 decode
    most = 0
    for _ in range(10_000):
        d.step()
        most = max(most, len(d.sched.calls.running["a"]))
        if not d._arrivals and not d.sched.calls.queued["a"] and not d.sched.calls.running["a"]:
            break
    assert most == 2  # a3 waited for a place instead of running third
    assert d.trace.index("P:a:a3") > d.trace.index("P:a:a1,a2")
