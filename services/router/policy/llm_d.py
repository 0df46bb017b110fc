"""`llm-d`: the llm-d inference scheduler (endpoint picker) as shipped, its default scoring profile.

Sources: llm-d/llm-d-inference-scheduler (the EPP; `deploy/config/*.yaml` scheduling
profiles) and the llm-d "inference scheduling" well-lit path's profile: prefix-cache-scorer
weight 3, queue-scorer weight 2, kv-cache-utilization-scorer weight 2, max-score-picker; the
scorers themselves are the Gateway API Inference Extension's
(kubernetes-sigs/gateway-api-inference-extension, `pkg/epp/scheduling/framework/plugins/
scorer/{queue,kvcache_utilization,lora_affinity}.go`, `.../plugins/multi/prefix/plugin.go`),
read through the search tools. The scores are `LlmD`'s docstring; `llm-d-affinity` is a
labelled variant (`LlmDAffinity`), not the shipped default.
"""

from __future__ import annotations

from talaria.services.router.instances import ON_DEVICE
from talaria.services.router.policy.base import PlacementPolicy
from talaria.services.router.policy.peer_signals import kv_utilisation, tie_break, waiting
from talaria.services.router.policy.registry import register
from talaria.services.router.state import RouterState
from talaria.shared.events import CallSubmitted, CandidateCost, RoutingDecision
from talaria.shared.tokenizer import HASH_BLOCK_TOKENS

PREFIX_WEIGHT = 3.0
QUEUE_WEIGHT = 2.0
KV_WEIGHT = 2.0
MAX_PREFIX_BLOCKS = 256  # GIE prefix plugin defaultMaxPrefixBlocks (maxPrefixBlocksToMatch)
HORIZON_TOKENS = MAX_PREFIX_BLOCKS * HASH_BLOCK_TOKENS  # 256 x vLLM's 16-token blocks


def model_affinity(view, model: str) -> float:
    """The lora-affinity scorer's levels, with the base model in the adapter's place."""
    state = view.model_state(model)
    if state in ON_DEVICE:
        return 1.0
    if model in view.overlay_models or view.snapshot.queued.get(model):
        return 0.6  # requests for it already wait there: it is being loaded
    if view.queued_calls() == 0:
        return 0.8  # a free slot: nothing runs or waits there
    return 0.0


def horizon_prefix(state: RouterState, call: CallSubmitted) -> tuple[dict[str, int], int]:
    """(instance -> matched tokens, tokens hashed): the scorer's match over the prompt's
    first MAX_PREFIX_BLOCKS blocks only."""
    hits = state.prefix.match(call.model, call.block_hashes[:MAX_PREFIX_BLOCKS])
    hashed = min(call.prompt_tokens, HORIZON_TOKENS)
    return {i: min(t, hashed) for i, (t, _) in hits.items()}, hashed


@register
class LlmD(PlacementPolicy):
    """The shipped default profile's scores:

        prefix(w)   = blocks of the request's first 256 the scorer's LRU index places on w
                      / min(request blocks, 256)
        queue(w)    = (max_q - q_w) / (max_q - min_q) over the candidates (1 when all equal)
        kv(w)       = 1 - KV cache utilisation of w
        score(w)    = 3 prefix + 2 queue + 2 kv;  max-score picker, ties at random

    The prefix scorer hashes at most `maxPrefixBlocksToMatch` = 256 blocks (the GIE default,
    `prefix/plugin.go` defaultMaxPrefixBlocks, kept by every llm-d guide's EndpointPickerConfig)
    of the model server's block size (with the default autoTune, `GetBlockSize` reads the
    engine's reported CacheBlockSize: vLLM's 16 tokens), so past 4,096 tokens every instance holding a prompt's head scores 1: the scorer
    cannot tell a session's own instance from one that holds only the shared system prompt.
    Its index is the approximate one built from routed prompts (the "cache_tracking" mode),
    state.prefix, cut to that horizon. Blind to sessions; no leases.

    `llm-d-affinity` (a labelled variant, not the shipped default) adds the lora-affinity scorer
    with the base model in the adapter's place, weight 1 [asm]: 1.0 model active on w, 0.8 a free
    slot to load it (w idle), 0.6 already loading it, else 0; it only matters where instances
    load models on demand (serverless cells). The inference-scheduling guide's profile has no
    such scorer.
    """

    name = "llm-d"
    model_weight = 0.0  # the shipped profile has no model-affinity scorer

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        views = self.serving(state, call.model, now)
        if not views:
            return self.reject(state, call, now, f"no healthy instance serves {call.model}")
        matched, hashed = horizon_prefix(state, call)
        queue = {v.instance_id: waiting(v) for v in views}
        lo, hi = min(queue.values()), max(queue.values())
        candidates = []
        for v in views:
            iid = v.instance_id
            prefix = matched.get(iid, 0) / max(1, hashed)
            q = 1.0 if hi == lo else (hi - queue[iid]) / (hi - lo)
            score = (PREFIX_WEIGHT * prefix + QUEUE_WEIGHT * q + KV_WEIGHT * (1.0 - kv_utilisation(v))
                     + (self.model_weight * model_affinity(v, call.model) if self.model_weight else 0.0))
            # the audit's total is a cost (lower wins): the negated score
            candidates.append(CandidateCost(iid, total_s=-score, queue_s=float(queue[iid]),
                                            kv_state="device" if matched.get(iid) else "none",
                                            model_state=v.model_state(call.model)))
        best = min(c.total_s for c in candidates)
        chosen = tie_break(call.call_id, [c.instance_id for c in candidates if c.total_s == best])
        return self.route(state, call, now, chosen, candidates)


@register
class LlmDAffinity(LlmD):
    """The labelled variant: the shipped profile plus the model-affinity scorer (module doc)."""

    name = "llm-d-affinity"
    model_weight = 1.0  # [asm] the affinity scorer at the framework's default weight
