"""Bad input fails loudly at the boundary, with the data that explains it."""

from __future__ import annotations

import pytest

from sched_driver import make, work
from talaria.services.instance_agent.scheduler import (
    CallFinished,
    ConfigError,
    Decode,
    DuplicateCallError,
    InvalidWorkError,
    SchedulerConfig,
    UnknownCallError,
    ModelNotServedError,
)
from talaria.services.instance_agent.scheduler.calls import AgentCall


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt_tokens": 0},
        {"reusable_tokens": 200},
        {"kv_state": "disk"},
        {"max_tokens": 0},
    ],
)
def test_invalid_work_is_refused(fields):
    base = dict(call_id="c", session_id="s", model="a", prompt_tokens=100, reusable_tokens=0)
    s = make(models=("a",))
    with pytest.raises(InvalidWorkError) as info:
        s.submit(AgentCall(**{**base, **fields}), 0.0)
    assert info.value.call_id == "c" and not s.calls  # refused before it joins the table


def test_unknown_model_and_duplicate_calls_are_refused():
    s = make(models=("a", "b"))
    with pytest.raises(ModelNotServedError) as info:
        s.submit(work("x", "z"), 0.0)
    assert info.value.served == ("a", "b")
    s.submit(work("x", "a"), 0.0)
    with pytest.raises(DuplicateCallError):
        s.submit(work("x", "a"), 0.0)


def test_call_larger_than_the_kv_budget_is_refused():
    s = make(kv_budget_bytes=50)
    with pytest.raises(InvalidWorkError):
        s.submit(work("x", "a", prompt=100), 0.0)


@pytest.mark.parametrize(
    "fields",
    [{"pool": "warm"}, {"gamma": 1.5}, {"tpot_target_s": 0}, {"max_batch": 0}, {"min_slot_s": 2, "max_slot_s": 1}],
)
def test_bad_config_is_refused(fields):
    with pytest.raises(ConfigError):
        SchedulerConfig(**fields)


def test_bad_model_lists_are_refused():
    with pytest.raises(ConfigError):
        make(models=())
    with pytest.raises(ConfigError):
        make(models=("a", "a"))
    with pytest.raises(ConfigError):
        make(models=("a",), initial_model="b")


def test_finished_ids_must_belong_to_the_completed_action():
    s = make(models=("a",), initial_model="a")
    s.submit(work("a1", "a", max_tokens=5), 0.0)
    s.on_prefill_done(s.next_action(0.0), 0.01)
    decode = s.next_action(0.01)
    with pytest.raises(UnknownCallError):
        s.on_decode_done(decode, 0.02, {"ghost"})
    s.on_decode_done(decode, 0.02, set())  # the failed report changed nothing
    assert s.generated("a1") == 2


def test_abort_while_in_flight_is_safe():
    s = make(models=("a",), initial_model="a")
    s.submit(work("a1", "a", max_tokens=5), 0.0)
    s.submit(work("a2", "a", max_tokens=5), 0.0)
    s.on_prefill_done(s.next_action(0.0), 0.01)
    decode = s.next_action(0.01)
    [aborted] = s.abort("a1", 0.015)
    assert isinstance(aborted, CallFinished) and aborted.reason == "aborted"
    s.on_decode_done(decode, 0.02, set())
    assert s.next_action(0.02) == Decode(("a2",), "a")
    with pytest.raises(UnknownCallError):
        s.abort("a1", 0.03)
