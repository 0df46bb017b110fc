"""The router's state checkpoint (router_service._save_loop): its pace and its size."""

from __future__ import annotations

import pytest

from talaria.services.router.router_service import SAVE_EVERY_S, SAVE_SHARE, save_interval


def test_checkpoints_space_out_once_a_save_takes_more_than_its_share_of_the_routers_time():
    assert save_interval(0.0) == SAVE_EVERY_S  # a small state: every SAVE_EVERY_S
    assert save_interval(SAVE_SHARE * SAVE_EVERY_S / 2) == SAVE_EVERY_S
    # a save of 0.5 s (a table of ~100,000 sessions) comes at most every 10 s: 5 % of the time
    assert save_interval(0.5) == pytest.approx(0.5 / SAVE_SHARE)
    assert 0.5 / save_interval(0.5) == pytest.approx(SAVE_SHARE)
