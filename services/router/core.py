"""RouterCore: policy + state, pure. Turns inputs into events and folds them in.

The asyncio service (`service.py`) publishes whatever `handle` returns; the simulator
and the tests call the same methods with a virtual clock.
"""

from __future__ import annotations

import time

from talaria.services.router.policy.base import Decision, PlacementPolicy
from talaria.services.router.state import RouterState
from talaria.shared.messages import (
    CallFailed,
    CallRouted,
    CallSubmitted,
    Event,
    InstanceSnapshot,
    RoutingDecision,
)


class RouterCore:
    """Policy + state. `handle`/`tick` return the events they caused, already folded in."""

    def __init__(self, policy: PlacementPolicy, state: RouterState | None = None) -> None:
        self.policy = policy
        self.state = state or RouterState()

    def observe(self, snapshot: InstanceSnapshot, now: float) -> None:
        self.state.observe(snapshot, now)

    def forget(self, instance_id: str) -> None:
        self.state.forget(instance_id)

    def handle(self, event: Event, now: float) -> list[Event]:
        """Process one input event; return the events it causes (already folded in)."""
        match event:
            case CallSubmitted():
                out = self._route(event, now)
            case _:
                # Fold first, then let the policy react to the updated state (a completion
                # installs its successor lease; a round summary has refreshed the profiles).
                self.state.apply(event)
                out = self.policy.react(self.state, event, now)
        for produced in out:
            self.state.apply(produced)
        return out

    def tick(self, now: float) -> list[Event]:
        out = self.policy.tick(self.state, now)
        for produced in out:
            self.state.apply(produced)
        return out

    def _route(self, call: CallSubmitted, now: float) -> list[Event]:
        if call.call_id in self.state.routed:
            return []  # redelivered after a restart: already routed once, never twice
        entry = self.state.sessions.get(call.session_id)
        call_index = entry.calls if entry is not None else 0
        started = time.perf_counter()  # measures the decision for the audit row; never decides
        decision = self.policy.decide(self.state, call, now)
        decision_us = (time.perf_counter() - started) * 1e6
        audit = _audit(call, call_index, self.policy.name, decision, now, decision_us)
        events: list[Event] = [*decision.extra_events, audit]
        if decision.action == "route" and decision.instance_id is not None:
            events.append(
                CallRouted(
                    call=call,
                    call_index=call_index,
                    instance_id=decision.instance_id,
                    policy=self.policy.name,
                    routed_at=now,
                    lease=decision.lease_outcome,
                    expected_kv=decision.expected_kv,  # type: ignore[arg-type]
                )
            )
        else:
            events.append(
                CallFailed(
                    call_id=call.call_id,
                    session_id=call.session_id,
                    model=call.model,
                    reason=decision.reason or "no instance can serve this call",
                    stage="router",
                    at=now,
                    status=503,
                    call_index=call_index,
                )
            )
        return events


def _audit(
    call: CallSubmitted, call_index: int, policy: str, d: Decision, now: float, decision_us: float
) -> RoutingDecision:
    return RoutingDecision(
        call_id=call.call_id,
        session_id=call.session_id,
        call_index=call_index,
        model=call.model,
        policy=policy,
        action=d.action,
        decided_at=now,
        chosen=d.instance_id,
        lease_outcome=d.lease_outcome,
        lease_instance=d.lease_instance,
        discard_reason=d.discard_reason,
        candidates=list(d.candidates),
        retry_after_s=d.retry_after_s,
        model_opened=d.model_opened,
        avoidable_cold_open=d.avoidable_cold_open,
        decision_us=decision_us,
        reason=d.reason,
    )
