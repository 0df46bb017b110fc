"""A chunked prefill that, at the rate measured on it so far, cannot end before its deadline
is dropped (services/instance_agent/call_drops.py): the measure is a floor, judged only after
JUDGE_AFTER_S of it ran."""

from __future__ import annotations

import pytest

from talaria.services.instance_agent.call_drops import JUDGE_AFTER_S, prefill_left_s
from tests.unit.scheduler.sched_driver import work


def prefilling(prompt: int, left: int, first_chunk_at: float | None):
    call = work("c", prompt=prompt)
    call.prefill_left, call.first_chunk_at = left, first_chunk_at
    return call


def test_the_rest_is_priced_at_the_rate_measured_so_far():
    # 10,000 of 40,000 tokens in 5 s: the other 30,000 need at least 15 s
    assert prefill_left_s(prefilling(40_000, 30_000, 100.0), hkvr=True, now=105.0) == pytest.approx(15.0)


def test_nothing_is_judged_too_early_or_without_progress():
    assert prefill_left_s(prefilling(40_000, 30_000, 100.0), True, 100.0 + JUDGE_AFTER_S / 2) is None
    assert prefill_left_s(prefilling(40_000, 40_000, 100.0), True, 110.0) is None  # nothing done yet
    assert prefill_left_s(prefilling(40_000, 30_000, None), True, 110.0) is None  # not started
    assert prefill_left_s(prefilling(40_000, 0, 100.0), True, 110.0) is None  # done: decoding


def test_a_wait_behind_another_calls_prefill_is_not_read_as_its_pace():
    # Admitted at 100 s, it waited while another prompt was prefilled until 110 s (500 of its
    # 40,000 tokens done then), then did 9,500 more in 5 s: the rest at that pace, not at
    # 10,000 in 15 s.
    call = prefilling(40_000, 30_000, 100.0)
    call.paced_from = (110.0, 39_500)
    assert prefill_left_s(call, True, 115.0) == pytest.approx(30_000 * 5 / 9_500)
    assert prefill_left_s(call, True, 110.0 + JUDGE_AFTER_S / 2) is None  # too soon after the wait
