"""The prefill curve: attention's slope is fitted from the chunks of long prefills, and a long
prompt is priced with it far above its linear estimate."""

import pytest

from talaria.services.instance_agent.scheduler.prefill_curve import PrefillCurve
from talaria.shared.prefill_cost import prefill_s


def chunks(curve: PrefillCurve, a: float, b: float, prompt: int, chunk: int, fixed_s: float = 0.0) -> None:
    for done in range(0, prompt, chunk):
        n = min(chunk, prompt - done)
        curve.observe("m", n, done, fixed_s + prefill_s(a, b, n, done))


def test_the_slope_and_rate_of_chunked_prefills_are_recovered():
    curve = PrefillCurve()
    chunks(curve, 2e-4, 1e-8, 8_192, 512)
    _, a, b = curve.fit("m")
    assert a == pytest.approx(2e-4, rel=1e-4) and b == pytest.approx(1e-8, rel=1e-4)
    # One chunk size: a step's fixed cost cannot be told from a, and leaves b as it is.
    fixed = PrefillCurve()
    chunks(fixed, 2e-4, 1e-8, 8_192, 512, fixed_s=0.05)
    assert fixed.fit("m")[2] == pytest.approx(1e-8, rel=1e-4)
    # Chunks of many sizes (a driver ends one early when a call arrives): s0 is told apart,
    # and a tiny chunk's fixed cost is not read as attention.
    varied = PrefillCurve()
    done = 0
    for n in [700, 40, 900, 300, 800, 12, 1000, 500, 650] * 2:
        varied.observe("m", n, done, 0.05 + prefill_s(2e-4, 1e-8, n, done))
        done += n
    assert varied.fit("m") == pytest.approx((0.05, 2e-4, 1e-8), rel=1e-3)


def test_nothing_is_learned_without_a_spread_of_contexts():
    curve = PrefillCurve()
    assert curve.fit("m") == (0.0, 0.0, 0.0) and curve.ctx_s_per_tok2(None) == 0.0
    for _ in range(5):
        curve.observe("m", 1_000, 0, 0.2)
    assert curve.ctx_s_per_tok2("m") == 0.0
    curve.observe("m", 0, 10, 1.0)  # nothing computed: ignored
    assert curve.ctx_s_per_tok2("m") == 0.0


def test_a_slope_that_falls_with_context_is_noise_not_a_discount():
    curve = PrefillCurve()
    curve.observe("m", 1_000, 0, 0.3)
    curve.observe("m", 1_000, 4_000, 0.2)
    assert curve.ctx_s_per_tok2("m") == 0.0


def test_a_long_prompt_costs_far_more_than_its_linear_estimate():
    # Measured here (results/faults.md): ~0.3 ms per token at no context, 8e-5 of that per
    # context token: 91K tokens are ~27 s linearly, minutes with attention.
    a, b = 3e-4, 3e-4 * 8e-5
    assert prefill_s(a, 0.0, 91_581, 0) == pytest.approx(27.5, rel=0.01)
    assert prefill_s(a, b, 91_581, 0) > 120.0
