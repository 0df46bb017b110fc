"""Router state and its fold: `RouterState.apply(event)` is the only way state changes.

Everything here is pure: no I/O, no clock. `now` always comes in from the caller.

    events ──apply──► sessions (session table, paper §4.1)
                      leases   (LeaseBook: the leases plus per-instance / per-model indexes)
                      models   (EWMA latency profiles, arrival rates, tool gaps)
                      prefix   (approximate prefix index over routed block hashes)
    snapshots ─observe─► instances (latest snapshot + overlay of calls routed since)

`to_dict` / `from_dict` give the plain-dict form the Postgres projection stores; folding
the same events and snapshots into a fresh state gives an equal `to_dict()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from talaria.services.router.instances import InstanceView
from talaria.services.router.leases import LeaseBook
from talaria.services.router.prefix_index import PrefixIndex
from talaria.services.router.profiles import InstanceProfile, ModelProfile
from talaria.shared.messages import (
    CallCompleted,
    CallFailed,
    CallRouted,
    Event,
    InstanceSnapshot,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    LeaseIssued,
    RoundSummary,
)

__all__ = ["InstanceView", "RouterState", "SessionEntry"]

SESSION_GAPS_KEPT = 16
ROUTED_KEPT = 100_000  # call ids remembered for redelivery dedupe (oldest forgotten first)
STATE_FORMAT = 1


@dataclass
class SessionEntry:
    """One row of the session table: last instance, model, observed KV length, last use, lease."""

    session_id: str
    model: str | None = None
    last_instance: str | None = None
    kv_tokens: int = 0
    last_used: float = 0.0
    calls: int = 0  # calls routed so far; the next call's index
    lease: LeaseIssued | None = None
    first_instance: str | None = None
    last_call_id: str | None = None  # last completed call
    last_completed_at: float | None = None  # cleared once the next call's gap is recorded
    gaps: list[float] = field(default_factory=list)  # recent tool gaps, oldest first


_SESSION_FIELDS = [f for f in SessionEntry.__dataclass_fields__ if f != "lease"]


@dataclass
class RouterState:
    sessions: dict[str, SessionEntry] = field(default_factory=dict)
    instances: dict[str, InstanceView] = field(default_factory=dict)
    leases: LeaseBook = field(default_factory=LeaseBook)
    routed: dict[str, str] = field(default_factory=dict)  # call_id -> instance (dedupe)
    inflight_calls: dict[str, tuple[str, int, str]] = field(default_factory=dict)  # call -> (inst, tokens, model)
    models: dict[str, ModelProfile] = field(default_factory=dict)
    instance_profiles: dict[str, InstanceProfile] = field(default_factory=dict)
    prefix: PrefixIndex = field(default_factory=PrefixIndex)
    routed_total: int = 0
    last_seq: int = 0  # JetStream sequence of the last applied event

    def session(self, session_id: str) -> SessionEntry:
        entry = self.sessions.get(session_id)
        if entry is None:
            entry = self.sessions[session_id] = SessionEntry(session_id)
        return entry

    def model(self, name: str) -> ModelProfile:
        prof = self.models.get(name)
        if prof is None:
            prof = self.models[name] = ModelProfile()
        return prof

    def leases_on(self, instance_id: str, now: float) -> int:
        """Live leases charged against the instance (indexed: O(log leases))."""
        return self.leases.live_on(instance_id, now)

    # ---- the fold -------------------------------------------------------------------

    def observe(self, snapshot: InstanceSnapshot, now: float) -> None:
        """A fresh snapshot replaces the overlay: it already counts what was routed before it."""
        old = self.instances.get(snapshot.instance_id)
        if old is not None and snapshot.version < old.snapshot.version:
            return  # out-of-order heartbeat
        if old is not None and old.restamp(snapshot, now):
            return  # a heartbeat re-send: same view, new version/time, overlay reset
        view = InstanceView(snapshot, now, prior=old)
        if old is not None:
            view.inflight = old.inflight
            view.inherit_kv_index(old)
        self.instances[snapshot.instance_id] = view

    def forget(self, instance_id: str) -> None:
        """The instance left the pool (deregistered or declared dead by the shell). Its leases
        stay until consumed, discarded (reason instance_gone) or expired, so each is audited."""
        self.instances.pop(instance_id, None)
        self.prefix.forget_instance(instance_id)

    def apply(self, event: Event) -> None:
        match event:
            case CallRouted():
                self._routed(event)
            case CallCompleted():
                self._completed(event)
            case CallFailed():
                self._finished(event.call_id)
                if event.stage == "router":
                    self.model(event.model).observe_arrival(event.at)  # spillover demand
            case LeaseIssued():
                self._install(event)
            case LeaseConsumed() | LeaseDiscarded():
                self._drop_lease(event.session_id, event.instance_id, event.model, None)
            case LeaseExpired():
                self._drop_lease(event.session_id, event.instance_id, event.model, event.at)
            case RoundSummary():
                prof = self.instance_profiles.setdefault(event.instance_id, InstanceProfile())
                prof.observe_round(event.wall_s, event.switch_s)
                view = self.instances.get(event.instance_id)
                if view is not None:
                    view.memo.clear()  # the measured switch cost may have changed
            case _:
                pass

    def _routed(self, event: CallRouted) -> None:
        call = event.call
        self.routed[call.call_id] = event.instance_id
        if len(self.routed) > ROUTED_KEPT:
            del self.routed[next(iter(self.routed))]
        self.routed_total += 1
        entry = self.session(call.session_id)
        if entry.last_completed_at is not None and entry.model == call.model:
            gap = max(0.0, call.submitted_at - entry.last_completed_at)
            entry.gaps.append(gap)
            del entry.gaps[:-SESSION_GAPS_KEPT]
            self.model(call.model).observe_gap(gap)
        entry.last_completed_at = None
        entry.calls = max(entry.calls, event.call_index + 1)
        entry.model = call.model
        if entry.first_instance is None:
            entry.first_instance = event.instance_id
        tokens = call.prompt_tokens
        self.inflight_calls[call.call_id] = (event.instance_id, tokens, call.model)
        self.model(call.model).observe_arrival(event.routed_at)
        view = self.instances.get(event.instance_id)
        if view is not None:
            view.inflight.add(call.call_id)
            view.add_overlay(call.call_id, tokens, call.model)
        self.prefix.insert(event.instance_id, call.model, call.session_id, call.block_hashes)

    def _completed(self, event: CallCompleted) -> None:
        self._finished(event.call_id)
        entry = self.session(event.session_id)
        entry.model = event.model
        entry.last_instance = event.instance_id
        entry.kv_tokens = event.kv_tokens or (event.prompt_tokens + event.output_tokens)
        entry.last_used = event.completed_at
        entry.last_completed_at = event.completed_at
        entry.last_call_id = event.call_id
        self.model(event.model).observe_completion(
            event.prompt_tokens, event.cached_tokens, event.output_tokens,
            event.prefill_s, event.decode_s, event.ttft_s,
        )

    def _finished(self, call_id: str) -> None:
        placed = self.inflight_calls.pop(call_id, None)
        if placed is None:
            return
        view = self.instances.get(placed[0])
        if view is not None:
            view.inflight.discard(call_id)
            view.drop_overlay(call_id)

    def _install(self, event: LeaseIssued) -> None:
        self.leases.add(event)  # the book holds the event itself: no second lease shape
        self.session(event.session_id).lease = event

    def _drop_lease(self, session_id: str, instance_id: str, model: str, at: float | None) -> None:
        entry = self.sessions.get(session_id)
        lease = entry.lease if entry is not None else None
        if lease is None or lease.instance_id != instance_id or lease.model != model:
            return  # about an older lease that a successor already replaced
        if at is not None and lease.expires_at > at:
            return  # an expiry notice for a lease that is still live
        entry.lease = None
        self.leases.remove(session_id)

    # ---- projection form --------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain JSON-able dict (the Postgres projection). The prefix index is a soft cache
        and is not included (see prefix_index.py)."""
        return {
            "format": STATE_FORMAT,
            "last_seq": self.last_seq,
            "routed_total": self.routed_total,
            "sessions": [{k: getattr(e, k) for k in _SESSION_FIELDS} for e in self.sessions.values()],
            "leases": self.leases.to_list(),
            "instances": [_view_to_dict(v) for v in self.instances.values()],
            "inflight_calls": {c: list(p) for c, p in self.inflight_calls.items()},
            "routed": dict(self.routed),
            "models": {m: dict(vars(p), gaps=list(p.gaps)) for m, p in self.models.items()},
            "instance_profiles": {i: dict(vars(p)) for i, p in self.instance_profiles.items()},
        }

    @classmethod
    def from_dict(cls, data: dict) -> RouterState:
        if data.get("format", STATE_FORMAT) != STATE_FORMAT:
            raise ValueError(f"router state format {data.get('format')!r} is not {STATE_FORMAT}")
        state = cls(last_seq=data.get("last_seq", 0), routed_total=data.get("routed_total", 0))
        for row in data.get("sessions", []):
            state.sessions[row["session_id"]] = SessionEntry(**row, lease=None)
        state.leases = LeaseBook.from_list(data.get("leases", []))
        for lease in state.leases.leases.values():
            state.session(lease.session_id).lease = lease
        for row in data.get("instances", []):
            view = _view_from_dict(row)
            state.instances[view.instance_id] = view
        state.inflight_calls = {c: (p[0], p[1], p[2]) for c, p in data.get("inflight_calls", {}).items()}
        state.routed = dict(data.get("routed", {}))
        state.models = {m: ModelProfile(**p) for m, p in data.get("models", {}).items()}
        state.instance_profiles = {i: InstanceProfile(**p) for i, p in data.get("instance_profiles", {}).items()}
        return state


def _view_to_dict(view: InstanceView) -> dict:
    return {
        "snapshot": msgspec.to_builtins(view.snapshot),
        "received_at": view.received_at,
        "overlay": [[c, t, m] for c, (t, m) in view.overlay.items()],
        "inflight": sorted(view.inflight),
    }


def _view_from_dict(row: dict) -> InstanceView:
    view = InstanceView(msgspec.convert(row["snapshot"], InstanceSnapshot), row["received_at"])
    for call_id, tokens, model in row.get("overlay", []):
        view.add_overlay(call_id, tokens, model)
    view.inflight = set(row.get("inflight", []))
    return view
