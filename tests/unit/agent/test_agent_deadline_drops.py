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
