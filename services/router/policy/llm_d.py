"""`llm-d`: the llm-d inference scheduler (endpoint picker) with its default scoring profile.

Sources: llm-d/llm-d-inference-scheduler (the EPP; `deploy/config/*.yaml` scheduling
profiles) and the llm-d "inference scheduling" well-lit path's profile: prefix-cache-scorer
weight 3, queue-scorer weight 2, kv-cache-utilization-scorer weight 2, max-score-picker; the
scorers themselves are the Gateway API Inference Extension's
(kubernetes-sigs/gateway-api-inference-extension, `pkg/epp/scheduling/framework/plugins/
scorer/{queue,kvcache_utilization,lora_affinity}.go`, `.../plugins/multi/prefix/plugin.go`),
read through the search tools.

    prefix(w)   = blocks of the request's prefix the scorer's LRU index places on w / request blocks
    queue(w)    = (max_q - q_w) / (max_q - min_q) over the candidates (1 when all equal)
    kv(w)       = 1 - KV cache utilisation of w
    model(w)    = 1.0 model active on w, 0.8 a free slot to load it (w idle), 0.6 already
                  loading it, else 0 (the lora-affinity scorer, model for adapter, one model
                  per instance as MaxActiveModels; it only matters where instances load
                  models on demand; weight 1 [asm])
    score(w)    = 3 prefix + 2 queue + 2 kv + 1 model;  max-score picker, ties at random

The prefix index is the approximate one built from routed prompts (the scorer's
"cache_tracking" mode), peer_signals.routed_prefix. Blind to sessions; no leases.
"""

from __future__ import annotations

from talaria.services.router.instances import ON_DEVICE
from talaria.services.router.policy.base import PlacementPolicy
from talaria.services.router.policy.peer_signals import kv_utilisation, routed_prefix, tie_break, waiting
from talaria.services.router.policy.registry import register
from talaria.services.router.state import RouterState
from talaria.shared.events import CallSubmitted, CandidateCost, RoutingDecision

PREFIX_WEIGHT = 3.0
QUEUE_WEIGHT = 2.0
KV_WEIGHT = 2.0
MODEL_WEIGHT = 1.0  # [asm] the affinity scorer at the framework's default weight


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


@register
class LlmD(PlacementPolicy):
    name = "llm-d"

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        views = self.serving(state, call.model, now)
        if not views:
            return self.reject(state, call, now, f"no healthy instance serves {call.model}")
        matched = routed_prefix(state, call)
        queue = {v.instance_id: waiting(v) for v in views}
        lo, hi = min(queue.values()), max(queue.values())
        candidates = []
        for v in views:
            iid = v.instance_id
            prefix = matched.get(iid, 0) / max(1, call.prompt_tokens)
            q = 1.0 if hi == lo else (hi - queue[iid]) / (hi - lo)
            score = (PREFIX_WEIGHT * prefix + QUEUE_WEIGHT * q + KV_WEIGHT * (1.0 - kv_utilisation(v))
                     + MODEL_WEIGHT * model_affinity(v, call.model))
            # the audit's total is a cost (lower wins): the negated score
            candidates.append(CandidateCost(iid, total_s=-score, queue_s=float(queue[iid]),
                                            kv_state="device" if matched.get(iid) else "none",
                                            model_state=v.model_state(call.model)))
        best = min(c.total_s for c in candidates)
        chosen = tie_break(call.call_id, [c.instance_id for c in candidates if c.total_s == best])
        return self.route(state, call, now, chosen, candidates)
