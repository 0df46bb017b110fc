"""The flatness of `deadlines.MARGIN`, the factor a price must pass the time left by before an
agent measured how far its prices run over (router/deadlines.py). On the prices this CPU's
agents reported on a fresh stack and the times these prompts took here, every refusal and
admission is the same for any factor from 1.25 to 3.4; 2 sits inside, ~1.6x from either end.

Prices: the rate and the slope's prior two fresh agents reported in the long-prompt test
(tests/integration/test_long_prompt_tenant.py, "fresh": seconds per token, the prior on the
probe's linear rate, printed by the test). Times, on this machine (results/faults.md): a
7,638-token prompt served in 7.5-8 s, a 17,433-token one in 41.6 s, a 35,452-token prefill
took ~2 min, a 91,589-token one did not end in 600 s. The deadline: 60 s."""

import pytest

from talaria.services.router import deadlines
from talaria.shared.prefill_cost import prefill_s

DEADLINE_S = 60.0
FRESH_PRICES = [(2.332e-4, 3.13e-7), (4.059e-4, 4.36e-7)]  # (s/token, prior slope), two agents
TOOK_S = {7_638: 8.0, 17_433: 41.6, 35_452: 120.0, 91_589: 600.0}


def decisions(factor: float) -> list[bool]:
    """Refused? for each prompt at each agent's price, refusing past `factor` x the time left."""
    return [prefill_s(a, b, n, 0) > factor * DEADLINE_S for a, b in FRESH_PRICES for n in TOOK_S]


def right() -> list[bool]:
    return [took > DEADLINE_S for _ in FRESH_PRICES for took in TOOK_S.values()]


@pytest.mark.parametrize("factor", [1.25, 1.5, 2.0, 2.5, 3.0, 3.4])
def test_every_decision_is_right_and_the_same_from_1_25_to_3_4(factor):
    assert decisions(factor) == right() == decisions(deadlines.MARGIN)


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_outside_that_range_a_decision_goes_wrong(factor):
    # 1.0: the 17K prompt priced 73 s (it took 41.6) is refused; 4.0: the 35K one priced
    # 205 s (it took ~2 min) is admitted
    assert decisions(factor) != right()
