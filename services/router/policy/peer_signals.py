"""What the peer routers read, derived from the router state the same way for each of them.

Every function here reads only what a live router of that kind has: its own record of the
calls it routed (in flight per instance, the approximate prefix index over routed prompts),
and the engine telemetry in the latest snapshot (queue depth, KV use, the KV the engine
reports per session, which stands in for KV events). Nothing reads a call's true output.
"""

from __future__ import annotations

import hashlib
from bisect import bisect

from talaria.services.router.instances import InstanceView
from talaria.services.router.prefix_index import INDEXED_TOKENS
from talaria.services.router.state import RouterState
from talaria.shared.events import CallSubmitted


def inflight(view: InstanceView) -> int:
    """Requests the router sent there that have not finished (sgl-router's `worker.load()`)."""
    return len(view.inflight)


def waiting(view: InstanceView) -> int:
    """Requests waiting (not running) there: the engine's queue plus those routed since the
    snapshot (vLLM's num_requests_waiting as a metrics scrape sees it; the overlay stands in
    for the EPP's 50 ms scrape period, which our 0.5 s heartbeats are coarser than)."""
    return sum(view.snapshot.queued.values()) + view.overlay_calls


def kv_utilisation(view: InstanceView) -> float:
    """KV pool in use by running requests, 0..1 (vLLM's kv_cache_usage_perc: cached blocks
    no request holds count as free)."""
    snap = view.snapshot
    if snap.kv_capacity_tokens <= 0:
        return 0.0
    held = snap.kv_pinned_tokens if snap.kv_pinned_tokens >= 0 else snap.kv_used_tokens
    return min(1.0, (held + view.overlay_tokens) / snap.kv_capacity_tokens)


def routed_prefix(state: RouterState, call: CallSubmitted) -> dict[str, int]:
    """instance -> prompt tokens the router's approximate tree would match there.

    The index hashes the first INDEXED_TOKENS of a prompt (prefix_index.py). A full-horizon
    match on the instance the session's previous call went to is extended by the session's
    own context there: a full-text tree (sgl-router)
    holds that whole earlier prompt, so without this every instance holding a shared
    system prompt longer than the horizon would tie with the session's own instance."""
    hits = state.prefix.match(call.model, call.block_hashes)
    out = {i: t for i, (t, _) in hits.items()}
    entry = state.sessions.get(call.session_id)
    if entry is not None and entry.model == call.model and entry.last_instance:
        last = entry.last_instance
        if out.get(last, 0) >= INDEXED_TOKENS:
            out[last] = max(out[last], min(call.prompt_tokens, entry.kv_tokens))
    return {i: min(t, call.prompt_tokens) for i, t in out.items()}


def engine_prefix(view: InstanceView, call: CallSubmitted, hits: dict[str, tuple[int, str]]) -> tuple[int, int]:
    """(device, host) prompt tokens the engine reports cached there (KV events): the
    session's own KV, or a prefix another session left there (`hits`: the prefix index's
    match for the call) that the engine still holds."""
    device = host = 0
    prompt = call.prompt_tokens
    own = view.kv.get((call.session_id, call.model))
    if own is not None and own.state == "device":
        device = min(own.kv_tokens, prompt)
    elif own is not None and own.state == "host":
        host = min(own.kv_tokens, prompt)
    hit = hits.get(view.instance_id)
    if hit is not None:
        tokens, holder = min(hit[0], prompt), hit[1]
        kv = view.kv.get((holder, call.model))
        if kv is not None and kv.state == "device":
            device = max(device, min(tokens, kv.kv_tokens))
        elif kv is not None and kv.state == "host":
            host = max(host, min(tokens, kv.kv_tokens))
    return device, max(0, host - device)


def tie_break(call_id: str, ids: list[str]) -> str:
    """A uniformly random pick among tied instances, seeded by the call id (reproducible)."""
    ids = sorted(ids)
    k = int.from_bytes(hashlib.blake2b(call_id.encode(), digest_size=8).digest(), "big")
    return ids[k % len(ids)]


class HashRing:
    """Consistent hashing with virtual nodes, as uhashring's ketama ring (production-stack's
    SessionRouter uses `uhashring.HashRing` with its defaults: 160 points per node, md5)."""

    VNODES = 160

    def __init__(self, nodes: list[str]) -> None:
        points = sorted((_point(f"{n}-{k}"), n) for n in nodes for k in range(self.VNODES))
        self._keys = [p for p, _ in points]
        self._nodes = [n for _, n in points]

    def get_node(self, key: str) -> str:
        k = bisect(self._keys, _point(key)) % len(self._keys)
        return self._nodes[k]


def _point(key: str) -> int:
    return int.from_bytes(hashlib.md5(key.encode()).digest()[:4], "big")
