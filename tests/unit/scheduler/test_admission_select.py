"""`select` (services/instance_agent/scheduler/admission.py), the one batch-selection rule P,
SP and the hot pool use: each limit alone, its boundary, and the skip-not-stop order."""

from __future__ import annotations

from dataclasses import dataclass

from talaria.services.instance_agent.scheduler.admission import Limits, select


@dataclass(frozen=True)
class C:
    call_id: str
    cost: float = 1.0
    kv: int = 10


def pick(calls, limits: Limits, charge=lambda cost: cost):
    return select(calls, limits, lambda c: c.cost, lambda c: c.kv, charge)


def lim(free_slots=8, batch=8, kv=None, time_s=None, at_least_one=False) -> Limits:
    return Limits(free_slots, batch, kv, time_s, at_least_one)


def test_free_slots_bound_the_batch_and_name_max_batch():
    sel = pick([C("a"), C("b"), C("c")], lim(free_slots=2, batch=8))
    assert sel.ids == ("a", "b") and [r for _, r in sel.left] == ["max_batch"]
    assert sel.left_for("max_batch") == 1 and sel.left_for("batch") == 0


def test_the_batch_bound_names_batch():
    sel = pick([C("a"), C("b"), C("c"), C("d")], lim(free_slots=8, batch=2))
    assert sel.ids == ("a", "b") and [r for _, r in sel.left] == ["batch", "batch"]


def test_zero_free_slots_admit_nothing():
    sel = pick([C("a")], lim(free_slots=0))
    assert sel.ids == () and sel.left_for("max_batch") == 1 and sel.cost_s == 0.0


def test_the_kv_budget_skips_a_call_that_does_not_fit_and_takes_a_later_one_that_does():
    sel = pick([C("a", kv=60), C("big", kv=50), C("c", kv=40)], lim(kv=100))
    assert sel.ids == ("a", "c") and sel.left_for("kv_budget") == 1  # exactly 100: fits


def test_the_time_budget_skips_a_call_that_does_not_fit_and_takes_a_later_one_that_does():
    sel = pick([C("a", 3.0), C("long", 5.0), C("b", 2.0)], lim(time_s=5.0))
    assert sel.ids == ("a", "b") and sel.cost_s == 5.0  # exactly the budget: fits
    assert [(c.call_id, r) for c, r in sel.left] == [("long", "time")]


def test_at_least_one_admits_the_oldest_past_the_time_budget_only_when_nothing_else_is_in():
    sel = pick([C("long", 9.0), C("b", 1.0)], lim(time_s=5.0, at_least_one=True))
    assert sel.ids == ("long",) and sel.left_for("time") == 1
    sel = pick([C("long", 9.0)], lim(time_s=5.0, at_least_one=False))
    assert sel.ids == () and sel.left_for("time") == 1


def test_at_least_one_does_not_lift_the_kv_budget_or_the_slots():
    sel = pick([C("big", kv=200)], lim(kv=100, time_s=5.0, at_least_one=True))
    assert sel.ids == () and sel.left_for("kv_budget") == 1


def test_charge_is_what_the_time_budget_pays():
    sel = pick([C("a", 1.0), C("b", 1.0), C("c", 1.0)], lim(time_s=4.0), charge=lambda cost: 2 * cost)
    assert sel.ids == ("a", "b") and sel.cost_s == 2.0  # the cost itself is not charged


def test_no_budget_admits_up_to_the_slots_and_sums_the_cost():
    sel = pick([C("a", 1.5), C("b", 2.5)], lim())
    assert sel.ids == ("a", "b") and sel.cost_s == 4.0 and sel.left == ()


# ---- P's selection as the scheduler runs it: what it leaves behind is reported ----------------

from sched_driver import Driver, make, work  # noqa: E402

from talaria.services.instance_agent.scheduler import DeadlineRisk  # noqa: E402


def capacity_risks(**config) -> list:
    d = Driver(make(models=("a",), initial_model="a", **config))
    for i in range(3):
        d.submit(work(f"q{i}", "a", prompt=100, max_tokens=3))
    d.step()
    return [r for r in d.of(DeadlineRisk) if r.reason == "capacity"]


def test_calls_p_leaves_for_the_batch_bound_are_a_capacity_risk():
    [risk] = capacity_risks(max_batch=2)
    assert risk.calls == 1


def test_calls_p_leaves_for_the_kv_budget_are_a_capacity_risk():
    [risk] = capacity_risks(kv_budget_bytes=250)  # 100-token prompts + 3 tokens at 1 byte each: two fit
    assert risk.calls == 1


def test_a_p_that_takes_everything_reports_no_capacity_risk():
    assert capacity_risks() == []


def test_the_time_budget_forgives_float_rounding_of_a_sum_that_equals_it():
    # 0.1 + 0.2 is 0.30000000000000004: a batch whose costs add up to the budget must fit,
    # or a slot sized from the same costs would always leave its last call out
    sel = pick([C("a", 0.1), C("b", 0.2)], lim(time_s=0.3))
    assert sel.ids == ("a", "b") and sel.left == ()
