"""`prefix-aware`: after the SGLang model gateway's (sgl-router) cache-aware policy, 2024.

Transplanted baseline (kept for the old matrix, bench/data/matrix_transplanted.json): the
current gateway's rule and defaults are `sglang-cache-aware` (sglang_cache_aware.py).
Source (sgl-project/sglang `rust/README.md`, "Cache-Aware Load-Balancing Router"), its rule,
defaults and our differences: `PrefixAware`.
"""

from __future__ import annotations

from talaria.services.router.policy.base import PlacementPolicy
from talaria.services.router.policy.least_pressure import load_candidates
from talaria.services.router.policy.registry import register
from talaria.services.router.prefix_index import INDEXED_TOKENS
from talaria.services.router.state import RouterState
from talaria.shared.events import CallSubmitted, RoutingDecision


@register
class PrefixAware(PlacementPolicy):
    """sgl-router's cache-aware rule over our prefix index (the module docstring: which version).

    Source: sgl-project/sglang, `rust/README.md` ("Cache-Aware Load-Balancing Router") and the
    header comment of the router's cache-aware policy; read through the search tools, not
    copied. Their rule, with their defaults (cache_threshold 0.5, balance_abs_threshold 32,
    balance_rel_threshold 1.0001):

        imbalanced = (max_load - min_load) > abs_threshold and max_load > rel_threshold * min_load
        imbalanced            -> the worker with the fewest pending requests (shortest queue)
        else match = longest prefix match / prompt length over the per-worker approximate trees
             match > threshold -> the worker with that match
             otherwise         -> the worker with the smallest tree (most free cache)
        the chosen worker's tree gets the request inserted (here: the fold of CallRouted)

    Differences, on purpose: sgl-router's trees hold raw text characters; ours index
    cumulative block hashes at sampled positions (prefix_index.py), one tree per model.
    The index sees at most the first INDEXED_TOKENS (~12.5K) tokens of a prompt, so the match
    rate is judged over that horizon: a 100K-token continuation whose indexed prefix fully
    matches counts as a full match (sgl-router's full-text tree would see the same).
    Load = calls queued or running plus those routed since the last snapshot. Like the
    original it is blind to model residency; it issues no leases.
    """

    name = "prefix-aware"

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        cfg = self.config
        views = self.serving(state, call.model, now)
        if not views:
            return self.reject(state, call, now, f"no healthy instance serves {call.model}")
        loads = {v.instance_id: v.queued_calls() for v in views}
        lo, hi = min(loads.values()), max(loads.values())
        candidates = load_candidates(views, call.model)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            chosen = min(loads, key=lambda i: (loads[i], i))
            return self.route(state, call, now, chosen, candidates, reason="imbalanced: shortest queue")
        hits = state.prefix.match(call.model, call.block_hashes)
        matched = {i: hits[i][0] for i in loads if i in hits}
        prompt = max(1, min(call.prompt_tokens, INDEXED_TOKENS))
        if matched:
            best = min(matched, key=lambda i: (-matched[i], loads[i], i))
            if matched[best] / prompt > cfg.cache_threshold:
                return self.route(state, call, now, best, candidates, expected_kv="device", reason="prefix match")
        chosen = min(loads, key=lambda i: (state.prefix.size(i), loads[i], i))
        return self.route(state, call, now, chosen, candidates, reason="smallest tree")

