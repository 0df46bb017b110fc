"""A prefill's predicted seconds, attention included: each of `fresh` prompt tokens costs the
linear rate plus `ctx_s_per_tok2` per token it attends over (the `context` already in KV and
the fresh tokens before it). The agent fits that slope on its chunks
(services/instance_agent/scheduler/prefill_curve.py); the router and the gateway price with it."""

from __future__ import annotations


def prefill_s(s_per_tok: float, ctx_s_per_tok2: float, fresh: int, context: int) -> float:
    """Predicted seconds to prefill `fresh` prompt tokens on top of `context` tokens in KV."""
    return fresh * (s_per_tok + ctx_s_per_tok2 * (context + fresh / 2))
