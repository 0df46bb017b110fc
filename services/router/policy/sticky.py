"""Two simple baselines: `session-sticky` (paper §5.3) and `round-robin`.

`session-sticky` pins a session to the first instance it was routed to and sends every
later call there while that instance is healthy and can serve the model; otherwise it falls
back to least-pressure for that call (the pin itself never moves). `round-robin` cycles
through the healthy instances that serve the model, ordered by id, using the count of
routed calls folded into the state (so a replayed router continues the same cycle).
Both are blind to KV and model residency and issue no leases.
"""

from __future__ import annotations

from talaria.services.router.policy.base import PlacementPolicy
from talaria.services.router.policy.least_pressure import least_loaded, load_candidates
from talaria.services.router.policy.registry import register
from talaria.services.router.state import RouterState
from talaria.shared.events import CallSubmitted, RoutingDecision


@register
class SessionSticky(PlacementPolicy):
    name = "session-sticky"

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        views = self.serving(state, call.model, now)
        if not views:
            return self.reject(state, call, now, f"no healthy instance serves {call.model}")
        entry = state.sessions.get(call.session_id)
        pinned = entry.first_instance if entry is not None else None
        chosen = next((v for v in views if v.instance_id == pinned), None) or least_loaded(views)
        return self.route(state, call, now, chosen.instance_id, load_candidates(views, call.model))


@register
class RoundRobin(PlacementPolicy):
    name = "round-robin"

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        views = sorted(self.serving(state, call.model, now), key=lambda v: v.instance_id)
        if not views:
            return self.reject(state, call, now, f"no healthy instance serves {call.model}")
        chosen = views[state.routed_total % len(views)]
        return self.route(state, call, now, chosen.instance_id, load_candidates(views, call.model))
