"""Router state and its fold: `RouterState.apply(event)` is the only way state changes.

Everything here is pure: no I/O, no clock. `now` always comes in from the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import (
    CallCompleted,
    CallFailed,
    CallRouted,
    Event,
    InstanceSnapshot,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    LeaseIssued,
)


@dataclass(frozen=True)
class Lease:
    """Soft reservation: the session's next call for `model` is expected on `instance_id`."""

    session_id: str
    model: str
    instance_id: str
    call_id: str
    issued_at: float
    expires_at: float
    kv_tokens: int = 0

    def live(self, now: float) -> bool:
        # Expiry is exclusive: a lease issued at t with timeout tau is dead at exactly t + tau.
        return now < self.expires_at


@dataclass
class SessionEntry:
    session_id: str
    model: str | None = None
    last_instance: str | None = None
    kv_tokens: int = 0
    last_used: float = 0.0
    calls: int = 0  # calls routed so far; the next call's index
    lease: Lease | None = None
    first_instance: str | None = None


@dataclass
class InstanceView:
    """Latest snapshot plus the overlay of calls routed since that snapshot."""

    snapshot: InstanceSnapshot
    received_at: float
    overlay_calls: int = 0
    overlay_tokens: int = 0
    inflight: set[str] = field(default_factory=set)

    @property
    def instance_id(self) -> str:
        return self.snapshot.instance_id


@dataclass
class RouterState:
    sessions: dict[str, SessionEntry] = field(default_factory=dict)
    instances: dict[str, InstanceView] = field(default_factory=dict)
    routed: dict[str, str] = field(default_factory=dict)  # call_id -> instance (dedupe)
    inflight_calls: dict[str, tuple[str, int]] = field(default_factory=dict)  # call -> (inst, tokens)
    last_seq: int = 0  # JetStream sequence of the last applied event

    def session(self, session_id: str) -> SessionEntry:
        entry = self.sessions.get(session_id)
        if entry is None:
            entry = self.sessions[session_id] = SessionEntry(session_id)
        return entry

    def leases_on(self, instance_id: str, now: float) -> int:
        return sum(
            1
            for s in self.sessions.values()
            if s.lease is not None and s.lease.instance_id == instance_id and s.lease.live(now)
        )

    # ---- the fold -------------------------------------------------------------------

    def observe(self, snapshot: InstanceSnapshot, now: float) -> None:
        """A fresh snapshot replaces the overlay: it already counts what was routed before it."""
        old = self.instances.get(snapshot.instance_id)
        if old is not None and snapshot.version < old.snapshot.version:
            return  # out-of-order heartbeat
        view = InstanceView(snapshot, now)
        if old is not None:
            view.inflight = old.inflight
        self.instances[snapshot.instance_id] = view

    def apply(self, event: Event) -> None:
        match event:
            case CallRouted():
                self._routed(event)
            case CallCompleted():
                self._finished(event.call_id)
                entry = self.session(event.session_id)
                entry.model = event.model
                entry.last_instance = event.instance_id
                entry.kv_tokens = event.prompt_tokens + event.output_tokens
                entry.last_used = event.completed_at
            case CallFailed():
                self._finished(event.call_id)
            case LeaseIssued():
                self.session(event.session_id).lease = Lease(
                    event.session_id,
                    event.model,
                    event.instance_id,
                    event.call_id,
                    event.issued_at,
                    event.expires_at,
                    event.kv_tokens,
                )
            case LeaseConsumed() | LeaseDiscarded() | LeaseExpired():
                entry = self.sessions.get(event.session_id)
                if entry is not None:
                    entry.lease = None
            case _:
                pass

    def _routed(self, event: CallRouted) -> None:
        call = event.call
        self.routed[call.call_id] = event.instance_id
        entry = self.session(call.session_id)
        entry.calls = max(entry.calls, event.call_index + 1)
        entry.model = call.model
        if entry.first_instance is None:
            entry.first_instance = event.instance_id
        self.inflight_calls[call.call_id] = (event.instance_id, call.prompt_tokens)
        view = self.instances.get(event.instance_id)
        if view is not None:
            view.overlay_calls += 1
            view.overlay_tokens += call.prompt_tokens
            view.inflight.add(call.call_id)

    def _finished(self, call_id: str) -> None:
        placed = self.inflight_calls.pop(call_id, None)
        if placed is None:
            return
        view = self.instances.get(placed[0])
        if view is not None:
            view.inflight.discard(call_id)
