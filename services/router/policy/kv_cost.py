"""`kv-cost`: after NVIDIA Dynamo's KV router (KV-aware worker selection), loosely.

Transplanted baseline (kept for the old matrix, bench/data/matrix_transplanted.json): Dynamo's
router as it is, with its defaults, is `dynamo-kv` (dynamo_kv.py). Source
(ai-dynamo/dynamo `docs/router/kv_cache_routing.md`, "Cost Calculation"), its rule and our
additions, which were NOT verified against Dynamo's code: `KvCost`.
"""

from __future__ import annotations

from talaria.services.router.policy.base import PlacementPolicy
from talaria.services.router.policy.registry import register
from talaria.services.router.state import RouterState
from talaria.shared.events import CallSubmitted, CandidateCost, RoutingDecision
from talaria.shared.tokenizer import HASH_BLOCK_TOKENS as BLOCK


@register
class KvCost(PlacementPolicy):
    """Dynamo's cost rule with the project brief's additions (the module docstring: which version).

    Source: ai-dynamo/dynamo, `docs/router/kv_cache_routing.md` ("Cost Calculation"), read
    through the search tools:

        cost = overlap_score_weight * prefill_blocks + decode_blocks      (lowest wins;
        prefill_blocks = blocks of the prompt the worker has not cached    temperature 0 =
        decode_blocks  = blocks of the worker's active sequences           deterministic)

    Our additions follow the project brief and were NOT verified against Dynamo's code:
    - tiered cache: a block the worker holds in host memory counts `host_hit_weight` of a
      miss (device hit 0, host hit 0.5 by default, miss 1);
    - session affinity with an idle TTL: a session seen within `affinity_ttl_s` goes back to
      the instance that served its last call while that instance is healthy.

    Cached blocks come from two signals: the instance's reported session KV (device or host,
    like Dynamo's KV events) and the router's approximate prefix index over routed calls
    (like Dynamo's ApproxKvIndexer). Active blocks: the instance's KV in use plus the overlay.
    Blind to model residency; issues no leases.
    """

    name = "kv-cost"

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        cfg = self.config
        views = self.serving(state, call.model, now)
        if not views:
            return self.reject(state, call, now, f"no healthy instance serves {call.model}")
        entry = state.sessions.get(call.session_id)
        if entry is not None and entry.last_instance and now - entry.last_used < cfg.affinity_ttl_s:
            for v in views:
                if v.instance_id == entry.last_instance:
                    return self.route(state, call, now, v.instance_id, reason="session affinity")
        prompt = call.prompt_tokens
        request_blocks = -(-prompt // BLOCK)
        hits = state.prefix.match(call.model, call.block_hashes)
        candidates = []
        for v in views:
            device, host = 0, 0
            kv = v.kv.get((call.session_id, call.model))
            if kv is not None and kv.state == "device":
                device = min(kv.kv_tokens, prompt)
            elif kv is not None and kv.state == "host":
                host = min(kv.kv_tokens, prompt)
            approx = hits.get(v.instance_id)
            if approx is not None:
                device = max(device, min(approx[0], prompt))
            host = max(0, host - device)
            prefill_blocks = request_blocks - device // BLOCK - (1.0 - cfg.host_hit_weight) * (host // BLOCK)
            active = v.snapshot.kv_used_tokens + v.overlay_tokens
            decode_blocks = -(-active // BLOCK)
            cost = cfg.overlap_score_weight * prefill_blocks + decode_blocks
            kv_state = "device" if device else ("host" if host else "none")
            candidates.append(CandidateCost(v.instance_id, total_s=cost, prefill_s=prefill_blocks,
                                            decode_s=float(decode_blocks), kv_state=kv_state,
                                            model_state=v.model_state(call.model)))
        best = min(candidates, key=lambda c: (c.total_s, c.instance_id))
        return self.route(state, call, now, best.instance_id, candidates, expected_kv=best.kv_state)
