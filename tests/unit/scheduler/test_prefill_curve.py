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


def noisy_chunks(curve: PrefillCurve, a: float, b: float, contexts, chunk: int, noise: float, seed: int = 1):
    """Chunks of `chunk` tokens at `contexts`, each time off by up to `noise` (relative)."""
    import random
    rnd = random.Random(seed)
    for c in contexts:
        curve.observe("m", chunk, c, prefill_s(a, b, chunk, c) * (1 + noise * (2 * rnd.random() - 1)))


def test_the_slope_is_established_only_once_its_context_spread_outweighs_the_noise():
    a, b = 5e-5, 5e-8  # the probe's figures for qwen3-tiny on this CPU
    # Chunks over contexts 0-256, each time off by up to 30%: attention adds at most 38%
    # over the linear part there, and the fit cannot tell it from the noise.
    narrow = PrefillCurve()
    noisy_chunks(narrow, a, b, [0, 64, 128, 192, 256] * 2, 256, 0.3)
    assert not narrow.established("m")
    # The same noise over contexts up to 8K: attention is most of a chunk there.
    wide = PrefillCurve()
    noisy_chunks(wide, a, b, range(0, 8192, 512), 256, 0.3)
    assert wide.established("m") and wide.ctx_s_per_tok2("m") == pytest.approx(b, rel=0.3)
    assert wide.slope("m", 1e-3, 1e-3) == (wide.ctx_s_per_tok2("m"), True)
    assert not PrefillCurve().established("m") and not wide.established(None)


def test_until_established_the_slope_is_the_architectures_prior_on_the_probes_linear_rate():
    ratio = 1024 / 786_432  # qwen3-tiny's (test_attention_prior.py)
    empty = PrefillCurve()
    # nothing measured here: the prior on the engine's rate (which carries a step's fixed cost)
    assert empty.slope("m", ratio, 3e-4) == (pytest.approx(ratio * 3e-4), False)
    assert empty.slope(None, ratio, 3e-4) == (0.0, False) and empty.slope("m", ratio, 0.0) == (0.0, False)
    # a probe: the slope from its two contexts has no residual to judge it by, so the prior
    # stands, on the probe's fastest pass at no context (not the engine's rate): a load spike
    # on the deep pass (here 4x) does not move it
    probed = PrefillCurve()
    probed.probed("m", [(256, 3072, 4 * prefill_s(5e-5, 5e-8, 256, 3072)), (256, 0, 0.0128), (256, 0, 0.0150)])
    assert not probed.established("m")
    assert probed.slope("m", ratio, 3e-4) == (pytest.approx(ratio * 0.0128 / 256), False)


def test_the_overstatement_is_how_far_the_reported_price_runs_over_whole_chunked_prefills():
    curve = PrefillCurve()
    assert curve.overstatement("m", 1e-4, 1e-8) == 0.0  # none ran: the router's MARGIN stands
    # ten 8K-token prefills that took what (1e-4, 1e-8) prices, then one twice as slow
    price = prefill_s(1e-4, 1e-8, 8_000, 0)
    for _ in range(10):
        curve.prefilled("m", 8_000, 0, price)
    curve.prefilled("m", 8_000, 0, 2 * price)
    assert curve.overstatement("m", 1e-4, 1e-8) == pytest.approx(1.0)  # 9 in 10 took their price
    assert curve.overstatement("m", 2e-4, 2e-8) == pytest.approx(2.0)  # a price twice as high: 2x over
    assert curve.overstatement("m", 0.0, 1e-8) == 0.0  # no rate, no price
    for _ in range(50):  # the slow ones fill the memory: the price now runs under the time
        curve.prefilled("m", 8_000, 0, 2 * price)
    assert curve.overstatement("m", 1e-4, 1e-8) == pytest.approx(0.5)
    curve.prefilled("m", 0, 0, 1.0)  # nothing prefilled: ignored
    assert curve.overstatement("m", 1e-4, 1e-8) == pytest.approx(0.5)
    # After a probe, the price is on its linear rate, not the engine's (which carries a step's
    # fixed cost and would read as overstatement on the prefills measured, not on longer ones)
    curve.probed("m", [(256, 0, 256 * 1e-4)])
    assert curve.overstatement("m", 5e-4, 1e-8) == pytest.approx(0.5)


def test_a_few_chunks_need_a_wider_interval_to_establish_the_slope():
    from talaria.services.instance_agent.scheduler.prefill_curve import t975
    assert t975(0.9) is None and t975(1) == 12.71 and t975(11) == 2.23 and t975(100) == 1.96
    # three exact-looking points (one residual degree of freedom) do not establish a slope that
    # a tiny noise would: the probe alone never does
    curve = PrefillCurve()
    curve.probed("m", [(256, 3072, 0.08), (256, 0, 0.0128), (256, 0, 0.0129)])
    assert not curve.established("m")
