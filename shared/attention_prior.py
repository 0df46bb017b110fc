"""Before an agent has measured how prefill slows with context, a prior for that slope from
the model's architecture.

A prompt token costs its linear layers (projections and MLP: fixed multiply-adds per token)
plus attention over every token before it (q.k and p.v: 2 x heads x head_dim per layer per
token attended over). So the slope b (s/token per token attended over) relates to the linear
rate a as their work does: b = a x ratio, assuming attention runs at the linear layers'
efficiency. Measured here: within 0.9-1.6x of the slope the torch engine's probe timed, on
the probe's linear rate (engine/prefill_probe.py); on an engine's step rate, which carries a
step's fixed cost, it runs high. Reported only until the agent's own fit is established
(scheduler/prefill_curve.py). The same for every engine: it reads the architecture.
"""

from __future__ import annotations

from talaria.shared.catalog import ModelSpec


def linear_macs_per_token(spec: ModelSpec) -> int:
    """Multiply-adds of one token through every layer's projections and MLP (the logits of a
    prefill are computed for its last token only, so the LM head is left out)."""
    q_out, kv_out = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    attn_proj = spec.hidden * q_out + 2 * spec.hidden * kv_out + q_out * spec.hidden
    if spec.arch == "gpt2":  # fc and proj, no gate
        mlp = 2 * spec.hidden * spec.intermediate
    elif spec.arch == "moe":  # the top-k experts' SwiGLU, and the router's logits
        mlp = spec.experts_per_token * 3 * spec.hidden * spec.intermediate + spec.hidden * spec.experts
    else:  # SwiGLU: gate, up, down
        mlp = 3 * spec.hidden * spec.intermediate
    return spec.layers * (attn_proj + mlp)


def attention_macs_per_context_token(spec: ModelSpec) -> int:
    """Multiply-adds one token spends per token it attends over: q.k and p.v in every head
    of every layer (grouped KV heads share k and v, not the work)."""
    return spec.layers * 2 * spec.heads * spec.head_dim


def attention_ratio(spec: ModelSpec) -> float:
    """b / a by the arithmetic: attention's work per token attended over relative to a
    token's linear work."""
    linear = linear_macs_per_token(spec)
    if linear <= 0:
        raise ValueError(f"model {spec.name!r} has no linear work per token (hidden={spec.hidden}, "
                         f"layers={spec.layers}): its architecture is not what a transformer has")
    return attention_macs_per_context_token(spec) / linear


def prior_ctx_s_per_tok2(spec: ModelSpec, s_per_tok: float) -> float:
    """The prior slope for a model whose linear rate measured `s_per_tok` (0: no rate, no prior)."""
    return attention_ratio(spec) * s_per_tok if s_per_tok > 0 else 0.0
