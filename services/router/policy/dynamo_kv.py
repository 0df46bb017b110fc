"""`dynamo-kv`: NVIDIA Dynamo's KV router (aggregated serving, KV events on).

Source: ai-dynamo/dynamo, `lib/kv-router/src/scheduling/selector.rs`
(`DefaultWorkerSelector::select_worker`), the router's own request tracking
(`lib/llm/src/kv_router/sequence.rs`, ActiveSequences) and `docs/router/kv_cache_routing.md`,
read through the search tools. Its cost (`DynamoKv`'s docstring): the prefill tokens a worker
would compute, weighted, plus its in-flight blocks deduplicated by block hash; argmin.
No session affinity, no leases, blind to model residency.
"""

from __future__ import annotations

from talaria.services.router.policy.base import PlacementPolicy
from talaria.services.router.policy.peer_signals import engine_prefix, tie_break
from talaria.services.router.policy.registry import register
from talaria.services.router.state import RouterState
from talaria.shared.events import CallSubmitted, CandidateCost, RoutingDecision
from talaria.shared.tokenizer import HASH_BLOCK_TOKENS as BLOCK

OVERLAP_SCORE_WEIGHT = 1.0
DEVICE_HIT_WEIGHT = 1.0
HOST_HIT_WEIGHT = 0.75


@register
class DynamoKv(PlacementPolicy):
    """Defaults: kv-overlap-score-weight 1.0, router-temperature 0
    (argmin, ties broken at random), KV events on (the engine's own cache state, no TTL guess),
    tiered overlap weights device 1.0 / host 0.75 / disk 0.25 (KVBM).

        cached(w)          = device blocks + 0.75 * host blocks of the request's prefix on w
        prefill_tokens(w)  = w's pending prefill tokens + request tokens - cached(w) * block
        decode_blocks(w)   = distinct blocks of w's in-flight requests + the request's blocks not
                             among them (deduplicated by block hash, as ActiveSequences counts
                             `active_blocks` = its unique_blocks and `new_blocks` = the request's
                             hashes not in unique_blocks: `lib/llm/src/kv_router/sequence.rs`,
                             potential_blocks_and_tokens)
        logit(w)           = overlap_weight * prefill_tokens(w) / block + decode_blocks(w)
        choose argmin logit; ties: uniformly at random

    Pending prefill: the engine's queued prefill (queued_prefill_s x its measured prefill
    rate, i.e. the uncached tokens of what waits there) plus what was routed since the
    snapshot. In-flight blocks: the prompts of the calls the router sent there and has not
    seen finish (retained KV of idle sessions is not load, as in ActiveSequences): calls that
    share a prefix (a model's system prompt) count its blocks once. The router's own record of
    the hashes it routed (`_routed`, lost on a restart as ActiveSequences is) dedups them; a
    prompt's blocks past the hashes it carries, or a call routed before a restart, count in full.
    No session affinity, no leases, blind to model residency. The disk tier does not exist here.
    """

    name = "dynamo-kv"

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self._routed: dict[str, list[int]] = {}  # call id -> its block hashes (ActiveSequences' record)
        self._active: dict[str, tuple[frozenset, set[int], int]] = {}  # instance -> (calls, hashes, blocks)

    def active_blocks(self, state: RouterState, view) -> tuple[set[int], int]:
        """(distinct hashes, distinct blocks) of the router's in-flight calls on `view`."""
        calls = frozenset(c for c in view.inflight if c in state.inflight_calls)
        got = self._active.get(view.instance_id)
        if got is not None and got[0] == calls:
            return got[1], got[2]
        hashes: set[int] = set()
        beyond = 0
        for c in calls:
            blocks = -(-state.inflight_calls[c].tokens // BLOCK)
            known = self._routed.get(c, ())
            hashes.update(known)
            beyond += max(0, blocks - len(known))
        self._active[view.instance_id] = (calls, hashes, len(hashes) + beyond)
        return hashes, len(hashes) + beyond

    def _remember(self, state: RouterState, call: CallSubmitted) -> None:
        self._routed[call.call_id] = call.block_hashes
        if len(self._routed) > 2 * len(state.inflight_calls) + 64:  # finished calls leave the record
            self._routed = {c: h for c, h in self._routed.items()
                            if c in state.inflight_calls or c == call.call_id}

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        views = self.serving(state, call.model, now)
        if not views:
            return self.reject(state, call, now, f"no healthy instance serves {call.model}")
        isl = call.prompt_tokens
        request_blocks = -(-isl // BLOCK)
        hits = state.prefix.match(call.model, call.block_hashes)
        candidates = []
        for v in views:
            device, host = engine_prefix(v, call, hits)
            cached_blocks = DEVICE_HIT_WEIGHT * (device // BLOCK) + HOST_HIT_WEIGHT * (host // BLOCK)
            snap = v.snapshot
            pending = (snap.queued_prefill_s * snap.prefill_tok_s if snap.queued_prefill_s >= 0
                       else snap.queued_tokens) + v.overlay_new_tokens
            prefill_tokens = pending + max(0.0, isl - cached_blocks * BLOCK)
            active, active_blocks = self.active_blocks(state, v)
            new_hashed = sum(1 for h in call.block_hashes if h not in active)
            decode_blocks = active_blocks + new_hashed + max(0, request_blocks - len(call.block_hashes))
            logit = OVERLAP_SCORE_WEIGHT * prefill_tokens / BLOCK + decode_blocks
            candidates.append(CandidateCost(v.instance_id, total_s=logit, prefill_s=prefill_tokens / BLOCK,
                                            decode_s=float(decode_blocks),
                                            kv_state="device" if device else ("host" if host else "none"),
                                            model_state=v.model_state(call.model)))
        best = min(c.total_s for c in candidates)
        chosen = tie_break(call.call_id, [c.instance_id for c in candidates if c.total_s == best])
        kv = next(c.kv_state for c in candidates if c.instance_id == chosen)
        self._remember(state, call)
        return self.route(state, call, now, chosen, candidates, expected_kv=kv)
