"""Cold-pool round structure: round-robin slots, P before D1, switches only between slots."""

from __future__ import annotations

import pytest

from sched_driver import Driver, make, work
from talaria.services.instance_agent.scheduler import (
    ActionMismatchError,
    Decode,
    Prefill,
    RoundEnded,
    SchedulerBusyError,
    SlotOpened,
    SwitchModel,
)


def slots_of(trace):
    """Split a trace into (model, [actions]) runs separated by switches."""
    runs = []
    for item in trace:
        if item.startswith("S:"):
            runs.append((item[2:], []))
        elif item != "I":
            runs[-1][1].append(item)
    return runs


def test_round_robin_one_slot_per_active_model_per_round():
    # fill_slot=False: slots end with protected decode, so 60 tokens span several rounds
    d = Driver(make(models=("a", "b", "c"), drain_on_switch=False, fill_slot=False))
    for m in "abc":
        d.submit(work(f"{m}1", m, max_tokens=60))
    d.run()
    rounds = d.of(RoundEnded)
    assert len(rounds) >= 3  # 60 tokens do not fit one slot: the calls come back next round
    assert all(r.slots == ("a", "b", "c") for r in rounds[:3])
    assert [r.round_index for r in rounds] == list(range(len(rounds)))
    switches = [t for t in d.trace if t.startswith("S:")]
    assert switches[:6] == ["S:a", "S:b", "S:c", "S:a", "S:b", "S:c"]


def test_p_comes_before_first_decode_in_every_slot():
    d = Driver(make(models=("a", "b"), drain_on_switch=False, fill_slot=False))
    d.submit(work("a1", "a", max_tokens=30))
    d.submit(work("b1", "b", max_tokens=30))
    d.run()
    runs = slots_of(d.trace)
    assert runs[0] == ("a", runs[0][1]) and runs[0][1][0] == "P:a:a1"
    assert runs[0][1][1] == "D:a:a1"  # D1 follows P directly
    assert runs[1][1][0] == "P:b:b1"
    # later slots have nothing queued: they start straight with decode
    assert runs[2][1][0].startswith("D:a")


def test_actions_between_switches_all_target_the_slot_model():
    d = Driver(make(models=("a", "b", "c")))
    for i, m in enumerate("abcab"):
        d.at(0.3 * i, work(f"{m}{i}", m, max_tokens=25))
    d.run()
    for model, actions in slots_of(d.trace):
        assert actions, "a slot is only opened for a model with work"
        assert all(a.split(":")[1] == model for a in actions)


def test_model_that_becomes_active_after_its_turn_waits_for_next_round():
    d = Driver(make(models=("a", "b", "c")))
    d.submit(work("a1", "a", max_tokens=3))
    d.submit(work("b1", "b", max_tokens=2))  # done after D1: b is not active next round
    d.run_until(lambda d: d.sched.slot is not None and d.sched.slot.model == "b")
    d.submit(work("a2", "a", max_tokens=3))  # a was served this round
    d.submit(work("c1", "c", max_tokens=3))  # c's turn has not come yet
    d.run()
    rounds = d.of(RoundEnded)
    assert rounds[0].slots == ("a", "b", "c")
    assert rounds[1].slots == ("a",)


def test_single_model_never_switches_after_opening():
    d = Driver(make(models=("a", "b"), initial_model="a"))
    for i in range(4):
        d.at(0.05 * i, work(f"a{i}", "a", max_tokens=5))
    d.run()
    assert not [t for t in d.trace if t.startswith("S:")]
    assert all(r.slots == ("a",) for r in d.of(RoundEnded))


def test_first_switch_opens_from_nothing():
    s = make(models=("a", "b"))
    s.submit(work("b1", "b"), 0.0)
    assert s.next_action(0.0) == SwitchModel(None, "b", staged=True)


def test_slot_plan_is_reported():
    d = Driver(make(models=("a", "b")))
    d.submit(work("a1", "a", max_tokens=40))
    d.submit(work("b1", "b", max_tokens=40))
    d.step(), d.step()
    opened = d.of(SlotOpened)
    assert opened and opened[0].model == "a" and opened[0].protected_decode >= 1
    assert opened[0].predicted_round_s <= 0.9 * 10.0


def test_next_action_while_busy_and_mismatched_completion_raise():
    s = make(models=("a",), initial_model="a")
    s.submit(work("a1", "a", max_tokens=3), 0.0)
    action = s.next_action(0.0)
    assert isinstance(action, Prefill)
    with pytest.raises(SchedulerBusyError):
        s.next_action(0.0)
    with pytest.raises(ActionMismatchError):
        s.on_decode_done(Decode(("a1",), "a"), 0.1, set())
    s.on_prefill_done(action, 0.1)
    assert isinstance(s.next_action(0.1), Decode)


def test_uncontended_slot_decodes_on_without_round_churn_or_false_risk():
    from talaria.services.instance_agent.scheduler import DeadlineRisk

    d = Driver(make(models=("a", "b"), initial_model="a", ttft_target_s=0.5))  # cap 0.45 s
    d.submit(work("long", "a", max_tokens=300))  # 3 s of decode, alone
    d.run()
    assert len(d.of(RoundEnded)) == 1  # the round ends when the slot starts decoding on
    assert d.of(DeadlineRisk) == []
    assert d.trace.count("P:a:long") == 1 and len(d.trace) == 301


def extended_driver(**config):
    d = Driver(make(models=("a", "b"), initial_model="a", **config))
    d.submit(work("long", "a", max_tokens=300))
    d.run_until(lambda d: d.sched.slot is not None and d.sched.slot.extended)
    return d, len(d.trace)


def test_return_during_an_extended_slot_enters_through_sp():
    d, before = extended_driver()
    d.at(d.now + 0.005, work("ret", "a", prompt=1000, reuse=900, kv="device", cont=True, max_tokens=2))
    d.run()
    assert d.trace[before : before + 3] == ["D:a:long", "SP:a:ret", "D:a:long,ret"]


def test_new_session_ends_an_extended_slot_at_the_next_boundary():
    d, before = extended_driver()
    d.at(d.now + 0.005, work("new", "a", max_tokens=2))
    d.run()
    assert d.trace[before : before + 3] == ["D:a:long", "P:a:new", "D:a:long,new"]
    assert len(d.of(RoundEnded)) >= 2  # the P opened a new round


def test_other_model_ends_an_extended_slot_at_the_next_boundary():
    d, before = extended_driver(drain_on_switch=False)
    d.at(d.now + 0.005, work("other", "b", max_tokens=2))
    d.run()
    assert d.trace[before : before + 3] == ["D:a:long", "S:b", "P:b:other"]


def test_drain_mode_switches_only_once_the_outgoing_model_is_empty():
    d = Driver(make(models=("a", "b")))  # drain_on_switch is the default (torch engine contract)
    d.submit(work("a1", "a", max_tokens=120))
    d.submit(work("b1", "b", max_tokens=5))
    d.at(1.05, work("ret", "a", prompt=1000, reuse=900, kv="device", cont=True, max_tokens=3))
    d.run()
    slot_a = d.trace[: d.trace.index("S:b")]
    assert sum("a1" in t for t in slot_a if t.startswith("D:")) == 119  # a1 ran to its end
    assert "SP:a:ret" in slot_a  # SP still works inside the slot
    protected = d.of(SlotOpened)[0].protected_decode
    assert protected < 119  # decode beyond the protected budget is the drain (Dfin)


def test_paper_mode_leaves_running_calls_for_the_next_slot():
    d = Driver(make(models=("a", "b"), drain_on_switch=False, fill_slot=False))
    d.submit(work("a1", "a", max_tokens=120))
    d.submit(work("b1", "b", max_tokens=5))
    d.run()
    first_switch = d.trace.index("S:b")
    assert first_switch < d.trace.index("P:a:a1") + 120
    assert d.trace[first_switch + 1 :].count("S:a") >= 1  # a1 resumes in a's next slot


def test_fill_slot_decodes_on_until_the_slot_budget_is_spent():
    # Paper §3.4: a slot closes when the round budget is exhausted, not right after the
    # protected decode (Eq. 4's minimum); otherwise cheap switches make rounds of a few
    # decode steps per model and the instance thrashes between models.
    def run(fill):
        d = Driver(make(models=("a", "b"), drain_on_switch=False, fill_slot=fill))
        d.submit(work("a1", "a", max_tokens=400))
        d.submit(work("b1", "b", max_tokens=400))
        d.run()
        return d
    filled, minimal = run(True), run(False)
    switches = lambda d: sum(t.startswith("S:") for t in d.trace)
    assert switches(filled) < switches(minimal)
    opened = filled.of(SlotOpened)[1]
    slot_a = slots_of(filled.trace)[0][1]
    assert sum(t.startswith("D:") for t in slot_a) > opened.protected_decode
    # the slot stays within its time budget (one decode step of slack)
    for r in filled.of(RoundEnded)[:-1]:
        assert r.wall_s <= 9.0 + 2 * 1.0 + 0.05  # the cap, plus switch estimate drift
