"""`least-pressure` (alias `least-loaded`): the paper's least-loaded-worker baseline (§5.3).

Routes every call to the healthy instance that can serve the model with the least work
queued or running there, counting calls routed since its last snapshot. Blind to sessions,
KV and model residency. Issues no leases.
"""

from __future__ import annotations

from talaria.services.router.instances import InstanceView
from talaria.services.router.policy.base import PlacementPolicy
from talaria.services.router.policy.registry import register
from talaria.services.router.state import RouterState
from talaria.shared.events import CallSubmitted, CandidateCost, RoutingDecision


def load_of(view: InstanceView) -> tuple[int, int]:
    """(calls, tokens) queued or running there, including calls routed since the snapshot."""
    return view.queued_calls(), view.snapshot.queued_tokens + view.overlay_tokens


def least_loaded(views: list[InstanceView]) -> InstanceView:
    return min(views, key=lambda v: (load_of(v), v.instance_id))


def load_candidates(views: list[InstanceView], model: str) -> tuple[CandidateCost, ...]:
    """Audit rows for load-only policies: the score is the call count (not seconds)."""
    out = []
    for v in views:
        calls = float(load_of(v)[0])
        out.append(CandidateCost(v.instance_id, total_s=calls, queue_s=calls,
                                 model_state=v.model_state(model)))
    return tuple(out)


@register
class LeastPressure(PlacementPolicy):
    name = "least-pressure"

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        views = self.serving(state, call.model, now)
        if not views:
            return self.reject(state, call, now, f"no healthy instance serves {call.model}")
        return self.route(state, call, now, least_loaded(views).instance_id, load_candidates(views, call.model))


@register
class LeastLoaded(LeastPressure):
    """The same policy under its original name (tests and older configs use it)."""

    name = "least-loaded"
