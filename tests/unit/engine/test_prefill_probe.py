"""The torch engine times a model's prefill the first time it is active: a pass at no
context and one deep in it, on free pages it gives back; the agent fits the curve on them."""

from talaria.services.instance_agent.engine.prefill_probe import PROBE_DEPTH, PROBE_TOKENS, probe_context
from talaria.services.instance_agent.scheduler.prefill_curve import PrefillCurve
from talaria.shared.attention_prior import attention_ratio


def test_the_probe_times_a_pass_at_no_context_and_one_deep_in_it_once_per_model(make_engine):
    eng = make_engine(["qwen3-tiny", "gpt2-tiny"], kv_pages=512, hkvr=False, staging=False)
    assert eng.probe_prefill() is None  # no model active: nothing to probe
    eng.switch_to("qwen3-tiny")
    free = eng.dev.pool.num_free
    depth = probe_context(eng.dev, eng.page_size)
    # deep enough that attention's work is PROBE_DEPTH times the linear layers' (3,072 here)
    assert depth == round(PROBE_DEPTH / attention_ratio(eng.specs["qwen3-tiny"]))
    model, passes = eng.probe_prefill()
    assert model == "qwen3-tiny" and [(n, c) for n, c, _ in passes] == [(PROBE_TOKENS, c) for c in (depth, 0, 0)]
    deep, *shallow = (t for _, _, t in passes)
    assert deep > max(shallow)  # 5x the work by the architecture: its time shows it
    assert eng.dev.pool.num_free == free  # its pages are given back
    assert eng.probe_prefill() is None  # once per model
    curve = PrefillCurve()
    curve.probed(model, passes)
    _, a, b = curve.fit(model)
    assert a > 0 and b > 0  # a first slope
    # the prior stands on the fastest pass at no context, per token
    assert curve.probe_rate[model] == min(shallow) / PROBE_TOKENS
    assert curve.slope(model, attention_ratio(eng.specs[model]), 1.0) == (
        attention_ratio(eng.specs[model]) * min(shallow) / PROBE_TOKENS, False)


def test_a_pool_too_small_for_the_deep_pass_probes_what_fits(make_engine):
    eng = make_engine(["qwen3-tiny"], kv_pages=64, hkvr=False, staging=False)  # 1,024 tokens of KV
    eng.switch_to("qwen3-tiny")
    assert probe_context(eng.dev, eng.page_size) == 64 * eng.page_size - PROBE_TOKENS
    _, passes = eng.probe_prefill()
    assert [c for _, c, _ in passes] == [64 * eng.page_size - PROBE_TOKENS, 0, 0]
