"""`least-loaded`: the first, simplest policy. Picks the serving instance with the least work."""

from __future__ import annotations

from services.router.policy.base import Decision, PlacementPolicy
from services.router.policy.registry import register
from services.router.state import InstanceView, RouterState
from shared.messages import CallSubmitted, CandidateCost


def load_of(view: InstanceView) -> tuple[int, int]:
    """(calls, tokens) queued or running there, including calls routed since the snapshot."""
    snap = view.snapshot
    calls = sum(snap.queued.values()) + snap.running + len(view.inflight)
    return calls, snap.queued_tokens + view.overlay_tokens


@register
class LeastLoaded(PlacementPolicy):
    name = "least-loaded"

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> Decision:
        views = self.serving(state, call.model, now)
        if not views:
            return self.reject(f"no healthy instance serves {call.model}")
        ranked = sorted(views, key=lambda v: (load_of(v), v.instance_id))
        candidates = tuple(
            CandidateCost(v.instance_id, total_s=float(load_of(v)[0]), queue_s=float(load_of(v)[0]))
            for v in ranked
        )
        return Decision(action="route", instance_id=ranked[0].instance_id, candidates=candidates)
