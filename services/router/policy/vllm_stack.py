"""`vllm-stack-session`: vLLM production-stack's session router.

Source: vllm-project/production-stack, `src/vllm_router/routers/routing_logic.py`
(`SessionRouter.route_request`, `RoutingInterface._qps_routing`), read through the search
tools. The router is started with `--routing-logic session --session-key <header>`:

    session key present -> uhashring.HashRing over the current endpoints, get_node(key)
    no session key      -> the endpoint with the lowest QPS (one with no requests first)

The key is the session id the client named; a call that named none (its session_origin is
not "named": the client sent no header) takes the keyless path. The ring is rebuilt from the
healthy instances serving the model (production-stack updates it from service discovery
on each request). QPS, for the keyless path: requests routed there and not finished.
Blind to KV and model residency; no leases.
"""

from __future__ import annotations

from talaria.services.router.policy.base import PlacementPolicy
from talaria.services.router.policy.peer_signals import HashRing, inflight
from talaria.services.router.policy.registry import register
from talaria.services.router.state import RouterState
from talaria.shared.events import CallSubmitted, RoutingDecision


@register
class VllmStackSession(PlacementPolicy):
    name = "vllm-stack-session"

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self._rings: dict[tuple[str, ...], HashRing] = {}  # a cache: a pure function of the nodes

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        views = self.serving(state, call.model, now)
        if not views:
            return self.reject(state, call, now, f"no healthy instance serves {call.model}")
        if not call.session_id or call.session_origin != "named":
            chosen = min(views, key=lambda v: (inflight(v), v.instance_id)).instance_id
            return self.route(state, call, now, chosen, reason="no session key: lowest qps")
        nodes = tuple(sorted(v.instance_id for v in views))
        ring = self._rings.get(nodes)
        if ring is None:
            ring = self._rings[nodes] = HashRing(list(nodes))
        return self.route(state, call, now, ring.get_node(call.session_id), reason="session hash")
