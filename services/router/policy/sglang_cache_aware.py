"""`sglang-cache-aware`: the SGLang model gateway's (sgl-router) cache-aware policy, today's.

Source: sgl-project/sglang, `sgl-model-gateway/src/policies/cache_aware.rs`
(`CacheAwarePolicy::select_worker`) with the gateway's command-line defaults
(`sgl-model-gateway/src/main.rs` CliArgs: cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5, eviction_interval 120 s, max_tree_size 2**26), read through the
search tools. One approximate tree per model (`trees: DashMap<model, Tree>`). The rule, and
where ours differs (the tree is our approximate prefix index): `SglangCacheAware`.
"""

from __future__ import annotations

from talaria.services.router.policy.base import PlacementPolicy
from talaria.services.router.policy.peer_signals import inflight, routed_prefix, tie_break
from talaria.services.router.policy.registry import register
from talaria.services.router.state import RouterState
from talaria.shared.events import CallSubmitted, CandidateCost, RoutingDecision

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


@register
class SglangCacheAware(PlacementPolicy):
    """The gateway's `CacheAwarePolicy::select_worker`, with its defaults (the module docstring: source):

        load(w)     = requests the gateway sent to w that have not finished
        imbalanced  = max - min > balance_abs and max > balance_rel * min
        imbalanced            -> the least-loaded worker
        else match  = longest prefix match of the request in the model's tree / request length
             match > threshold -> the worker holding that match
             otherwise         -> the least-loaded worker (not the smallest tree, as in 2024)
        the request is inserted into the tree under the chosen worker (here: CallRouted's fold)

    The tree is our approximate prefix index (peer_signals.routed_prefix: sampled block hashes,
    a full-horizon match on the session's own instance extended by its context); eviction is
    by size only (2**26 nodes never fill in our runs). Ties among least-loaded workers go to
    the first in order, as `min_by_key` does; among equally deep matches to any one of them
    (the tree returns the first tenant of an unordered map: here a pick seeded by the call id). Blind to model residency; no leases.
    """

    name = "sglang-cache-aware"

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        views = sorted(self.serving(state, call.model, now), key=lambda v: v.instance_id)
        if not views:
            return self.reject(state, call, now, f"no healthy instance serves {call.model}")
        load = {v.instance_id: inflight(v) for v in views}
        matched = routed_prefix(state, call)
        candidates = [CandidateCost(v.instance_id, total_s=float(load[v.instance_id]),
                                    queue_s=float(load[v.instance_id]), model_state=v.model_state(call.model),
                                    kv_state="device" if matched.get(v.instance_id) else "none")
                      for v in views]
        lo, hi = min(load.values()), max(load.values())
        least = min(load, key=lambda i: load[i])  # first of the least loaded, in order
        if hi - lo > BALANCE_ABS_THRESHOLD and hi > BALANCE_REL_THRESHOLD * lo:
            return self.route(state, call, now, least, candidates, reason="imbalanced: least loaded")
        deepest = max((matched[i] for i in load if i in matched), default=0)
        best = tie_break(call.call_id, [i for i in load if matched.get(i) == deepest]) if deepest else None
        if best is not None and matched[best] / max(1, call.prompt_tokens) > CACHE_THRESHOLD:
            return self.route(state, call, now, best, candidates, expected_kv="device", reason="prefix match")
        return self.route(state, call, now, least, candidates, reason="miss: least loaded")
