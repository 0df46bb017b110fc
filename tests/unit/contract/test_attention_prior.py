"""The slope's prior from a model's architecture: attention's multiply-adds per token attended
over relative to a token's linear multiply-adds (shared/attention_prior.py)."""

import pytest

from talaria.shared.attention_prior import (
    attention_macs_per_context_token, attention_ratio, linear_macs_per_token, prior_ctx_s_per_tok2,
)
from talaria.shared.catalog import BUILTIN_MODELS, ModelSpec


def test_the_ratio_counts_qwen3_tinys_projections_mlp_and_attention_by_hand():
    spec = BUILTIN_MODELS["qwen3-tiny"]  # hidden 128, 4 layers, 4 heads, 2 KV heads of 32, MLP 384
    per_layer = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 384  # q, k+v, o, gate+up+down
    assert linear_macs_per_token(spec) == 4 * per_layer == 786_432
    assert attention_macs_per_context_token(spec) == 4 * 2 * 4 * 32  # q.k and p.v, every head and layer
    assert attention_ratio(spec) == pytest.approx(1024 / 786_432)


def test_moe_counts_the_experts_a_token_runs_and_gpt2_has_no_gate():
    moe = BUILTIN_MODELS["qwen3-moe-tiny"]
    attn = 128 * 128 + 2 * 128 * 64 + 128 * 128
    assert linear_macs_per_token(moe) == 4 * (attn + 2 * 3 * 128 * 192 + 128 * 8)
    gpt2 = BUILTIN_MODELS["gpt2-tiny"]
    assert linear_macs_per_token(gpt2) == 4 * (4 * 128 * 128 + 2 * 128 * 512)


def test_a_big_model_attends_relatively_cheaper_and_no_rate_means_no_prior():
    # Llama-3-8B's shapes: the ratio is ~35x smaller than the tiny models' (wide MLPs)
    big = ModelSpec("llama-8b", "llama", 4096, 32, 32, 8, 128, 14336, 8192, seed=0)
    assert attention_ratio(big) == pytest.approx(2 * 32 * 128 / (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336))
    assert prior_ctx_s_per_tok2(big, 0.0) == 0.0
    assert prior_ctx_s_per_tok2(big, 1e-4) == pytest.approx(1e-4 * attention_ratio(big))


def test_an_architecture_without_linear_work_is_a_clear_error():
    with pytest.raises(ValueError, match="no linear work"):
        attention_ratio(ModelSpec("empty", "dense", 0, 0, 4, 2, 32, 0, 1024, seed=0))
