"""The placement-policy contract: `(state, event, now) -> decision`, pure.

A policy never mutates `RouterState`; it returns data. `RouterCore` turns a decision
into events and folds them into the state, so live routing, the simulator and unit
tests all run the same code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from services.router.state import InstanceView, RouterState
from shared.messages import CallSubmitted, CandidateCost, Event


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs shared by all policies; each policy reads the ones it uses."""

    lease_timeout_s: float = 1.0  # tau (paper App. E)
    adaptive_lease: bool = False
    gamma: float = 0.9  # admission margin: simulated round load <= gamma * ttft_target
    ttft_target_s: float = 10.0
    stale_after_s: float = 2.0  # heartbeats older than this make an instance stale
    overload: str = "reject"  # reject | queue
    retry_after_s: float = 1.0
    replica_penalty_s: float = 0.5  # nu_m in Eq. 2
    control_window_s: float = 10.0


@dataclass(frozen=True)
class Decision:
    """What to do with one submitted call. `instance_id` is None when rejected."""

    action: str  # route | reject
    instance_id: str | None = None
    candidates: tuple[CandidateCost, ...] = ()
    lease_outcome: str = "none"  # consumed | discarded | none
    lease_instance: str | None = None
    discard_reason: str | None = None
    retry_after_s: float | None = None
    expected_kv: str = "none"
    model_opened: bool = False
    avoidable_cold_open: bool = False
    reason: str = ""
    extra_events: tuple[Event, ...] = field(default=())


class PlacementPolicy(ABC):
    """A routing policy. Subclasses set `name` and implement `decide`."""

    name: ClassVar[str]

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

    @abstractmethod
    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> Decision:
        """Choose an instance for `call`. Must not mutate `state`."""

    def react(self, state: RouterState, event: Event, now: float) -> list[Event]:
        """Events this policy emits in response to `event` (e.g. a lease on completion)."""
        return []

    def tick(self, state: RouterState, now: float) -> list[Event]:
        """Time-driven events (e.g. lease expiry)."""
        return []

    # ---- helpers shared by policies -------------------------------------------------

    def healthy(self, view: InstanceView, now: float) -> bool:
        return now - view.received_at <= self.config.stale_after_s

    def serving(self, state: RouterState, model: str, now: float) -> list[InstanceView]:
        """Healthy instances that can serve `model` at all (it is in their catalogue)."""
        return [
            v
            for v in state.instances.values()
            if self.healthy(v, now) and any(m.model == model for m in v.snapshot.models)
        ]

    def reject(self, reason: str, candidates=()) -> Decision:
        return Decision(
            action="reject",
            candidates=tuple(candidates),
            retry_after_s=self.config.retry_after_s,
            reason=reason,
        )
