"""Router state and its fold: `RouterState.apply(event)` is the only way state changes.

Everything here is pure: no I/O, no clock. Time comes in with the inputs.

    events ──apply──► sessions (session table, paper §4.1)
                      leases   (LeaseBook: the leases plus per-instance / per-model indexes)
                      models   (EWMA latency profiles, arrival rates, tool gaps)
                      prefix   (approximate prefix index over routed block hashes)
    SnapshotReceived ─apply─► instances (latest snapshot + overlay of calls routed since)
    InstanceLost     ─apply─► instance dropped, its in-flight calls closed
    every event      ─apply─► pools (the hot-pool controller, when the router chooses the pools)

`to_dict` / `from_dict` give the plain-dict form the Postgres projection stores; folding
the same inputs into a fresh state gives an equal `to_dict()` (tests/unit/router/test_router_replay.py).
The stream position a checkpoint covers is the service shell's business, not the state's.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from talaria.services.router.push_book import PushBook
from talaria.services.router.homes import HomeBook
from talaria.services.router.hot_pools import HotPools
from talaria.services.router.instances import InstanceView
from talaria.services.router.leases import LeaseBook
from talaria.services.router.output_estimate import OutputEstimator
from talaria.services.router.prefix_index import PrefixIndex
from talaria.services.router.profiles import InstanceProfile, ModelProfile
from talaria.shared.events import (
    CallCompleted,
    CallFailed,
    CallRouted,
    Event,
    InstanceLost,
    KvPushed,
    KvPushRequested,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    LeaseIssued,
    PoolPinned,
    RoundSummary,
)
from talaria.shared.snapshots import InstanceSnapshot

__all__ = ["InFlight", "InstanceView", "RouterState", "SessionEntry", "SnapshotReceived"]

SESSION_GAPS_KEPT = 16
ROUTED_KEPT = 100_000  # call ids remembered for redelivery dedupe (oldest forgotten first)
# Session rows remembered, least recently routed forgotten first (never one holding a lease or
# a call in flight), as output_estimate.SESSIONS_KEPT: a router that runs for weeks keeps a
# bounded table and so a bounded checkpoint (results/router_checkpoint.md: 100,000 rows encode
# in ~0.2 s; before, the table held every session ever seen, a month at 0.25 sessions/s is
# 650,000). A session forgotten and back is placed as a new one.
SESSIONS_KEPT = 100_000
# What one session costs the router, across its row, lease and home, output estimate and
# checkpoint share (measured: ~2.5 KB a session up to the row cap). The table's cap in bytes
# (RouterSettings.router_session_table_bytes) is this many rows (`rows_for`).
SESSION_ROW_BYTES = 2_560


def rows_for(max_bytes: int) -> int:
    """Session rows that fit `max_bytes` of router memory."""
    return max(100, max_bytes // SESSION_ROW_BYTES)


STATE_FORMAT = 2  # 2: session rows are lists in "session_fields" order; 1 (dict rows) still reads
READABLE_FORMATS = (1, 2)


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
# A checkpoint's session rows are lists in _SESSION_FIELDS order (named once, in
# "session_fields"): half the encoding time of a dict per row, which the router waits on.
_session_row = operator.attrgetter(*_SESSION_FIELDS)


@dataclass(frozen=True)
class SnapshotReceived:
    """A heartbeat as the router's input: the snapshot plus when the router received it
    (the router's clock, not the agent's). Not a wire event: snapshots are last-value
    telemetry, but folding them through `apply` keeps the state a pure fold of its inputs."""

    snapshot: InstanceSnapshot
    received_at: float


class InFlight(NamedTuple):
    """A call routed and not yet finished: where it runs and whom to answer if it is lost."""

    instance_id: str
    tokens: int
    model: str
    session_id: str = ""
    call_index: int = 0
    reply_to: str | None = None


@dataclass
class RouterState:
    sessions: dict[str, SessionEntry] = field(default_factory=dict)
    instances: dict[str, InstanceView] = field(default_factory=dict)
    leases: LeaseBook = field(default_factory=LeaseBook)
    # call_id -> instance ("" for a call failed before it was placed): a call is decided once,
    # and one whose client already got an error is never placed later (redelivery, restart).
    routed: dict[str, str] = field(default_factory=dict)
    # call_id -> stream sequence of the submission that was decided: the same message again is
    # a redelivery; another message with that id is a client reusing it (answered 409).
    submission_seq: dict[str, int] = field(default_factory=dict)
    inflight_calls: dict[str, InFlight] = field(default_factory=dict)
    models: dict[str, ModelProfile] = field(default_factory=dict)
    instance_profiles: dict[str, InstanceProfile] = field(default_factory=dict)
    prefix: PrefixIndex = field(default_factory=PrefixIndex)
    homes: HomeBook = field(default_factory=HomeBook)  # where each live session lives
    # Rows past which idle sessions are forgotten (not saved: settings). Live sets it from
    # TALARIA_ROUTER_SESSION_TABLE_BYTES (rows_for); the simulator keeps SESSIONS_KEPT: no
    # replayed trace comes near either, so the two never differ in what they decide.
    sessions_kept: int = SESSIONS_KEPT
    outputs: OutputEstimator = field(default_factory=OutputEstimator)  # output lengths seen (never max_tokens)
    horizon_epoch: int = 0  # bumped when a model's idle horizon changes (not state: a cache key)
    routed_total: int = 0
    # Instances an operator is draining (`talaria drain`, router_service.py): priced "draining",
    # hard, so no call lands there; their sessions' pages stay pullable until they stop.
    draining: set[str] = field(default_factory=set)
    # instance -> the incarnation (agent process) a drain took out of service: another one is
    # a restart, back in service, even where the router dropped the old view meanwhile (lost)
    drained_as: dict[str, str] = field(default_factory=dict)
    # The drains' pushes of their sessions' KV (drain_push.py); like `draining`, not saved:
    # `talaria drain` asks again, and a restarted router asks the pushes again.
    pushes: PushBook = field(default_factory=PushBook)
    # The hot-pool controller (hot_pools.py) when the router chooses the pools: it hears the
    # events this fold applies and is checkpointed with the rest.
    pools: HotPools | None = None

    def session(self, session_id: str) -> SessionEntry:
        entry = self.sessions.get(session_id)
        if entry is None:
            entry = self.sessions[session_id] = SessionEntry(session_id)
        return entry

    def _touch(self, session_id: str) -> SessionEntry:
        """The session's row, now the most recently used (the table is in order of use)."""
        entry = self.sessions.pop(session_id, None) or SessionEntry(session_id)
        self.sessions[session_id] = entry
        if len(self.sessions) > self.sessions_kept:
            self._forget_idle_sessions(keep=session_id)
        return entry

    def _forget_idle_sessions(self, keep: str) -> None:
        """Forget the least recently used rows past `sessions_kept`, a hundredth of it at once
        (so a new session costs O(1) amortised), skipping any with a lease or a call in flight."""
        busy = {p.session_id for p in self.inflight_calls.values()}
        excess = len(self.sessions) - self.sessions_kept + self.sessions_kept // 100
        idle = []
        for sid, entry in self.sessions.items():
            if len(idle) >= excess:
                break
            if entry.lease is None and sid not in busy and sid != keep:
                idle.append(sid)
        for sid in idle:
            del self.sessions[sid]

    def model(self, name: str) -> ModelProfile:
        prof = self.models.get(name)
        if prof is None:
            prof = self.models[name] = ModelProfile()
        return prof

    def excuse_silence(self, deaf_from: float, until: float, fresh_for: float) -> None:
        """The router itself could not hear from `deaf_from` to `until` (blocked on the stream,
        or its connection down): a view that was fresh when that began (heard within
        `fresh_for` of it) counts as heard at `until`, as liveness counts silence only from
        then (shared/health.py). Else the first decision after a broker failover finds every
        snapshot stale and refuses the call (CI: a 503 "no healthy instance"). A view already
        stale then (a dead instance restored from a checkpoint) stays stale."""
        for view in self.instances.values():
            if deaf_from - fresh_for <= view.received_at < until:
                view.received_at = until

    def idle_horizon_s(self, model: str) -> float:
        prof = self.models.get(model)
        return prof.idle_horizon_s() if prof is not None else 0.0

    def live_models(self, instance_id: str, now: float) -> tuple[str, ...]:
        """Models with a session that lives on the instance now (homes.py)."""
        return self.homes.live_models(instance_id, now, self.idle_horizon_s, self.horizon_epoch)

    def leases_on(self, instance_id: str, now: float) -> int:
        """Live leases charged against the instance (indexed: O(log leases))."""
        return self.leases.live_on(instance_id, now)

    # ---- the fold -------------------------------------------------------------------

    def apply(self, event: Event | SnapshotReceived, now: float | None = None) -> None:
        """Fold `event` in; `now` is when the router folds it (the hot pools' clock; default:
        the event's own time)."""
        self._fold(event)
        if self.pools is not None:
            self._pools_hear(event, _event_time(event) if now is None else now)

    def _fold(self, event: Event | SnapshotReceived) -> None:
        match event:
            case SnapshotReceived():
                self._observed(event.snapshot, event.received_at)
            case InstanceLost():
                self._lost(event)
            case CallRouted():
                self._routed(event)
            case CallCompleted():
                self._completed(event)
            case CallFailed():
                self._finished(event.call_id, event.at)
                if event.stage != "router" and event.call_id not in self.routed:
                    self._remember(event.call_id, "")  # its client has its answer: never place it
                if event.stage == "router":
                    self.model(event.model).observe_arrival(event.at)  # spillover demand
            case LeaseIssued():
                self._install(event)
            case LeaseConsumed() | LeaseDiscarded():
                self._drop_lease(event.session_id, event.instance_id, event.model, None, event.call_id)
            case LeaseExpired():
                self._drop_lease(event.session_id, event.instance_id, event.model, event.at, None)
            case KvPushRequested():
                self.pushes.fold_requested(event)
            case KvPushed():
                home = self.homes.home_of.get(event.session_id)
                # moved, unless the session has since returned elsewhere (it pulled at its call)
                if self.pushes.fold_pushed(event) and home in (None, (event.holder, event.model)):
                    self._pushed(event)
            case RoundSummary():
                prof = self.instance_profiles.setdefault(event.instance_id, InstanceProfile())
                prof.observe_round(event.wall_s, event.switch_s)
                view = self.instances.get(event.instance_id)
                if view is not None:
                    view.memo.clear()  # the measured switch cost may have changed
            case _:
                pass

    def _pools_hear(self, event: Event | SnapshotReceived, now: float) -> None:
        """The hot-pool controller hears, of a folded event: an agent's pins and rates, every
        placement still running (one folded after its completion would stay in flight there
        for ever), completions and failed calls (they end like completed ones), lost agents
        and another router's pool moves."""
        pools = self.pools
        match event:
            case SnapshotReceived(snapshot=snap):
                pools.instance(snap.instance_id, snap.pinned_model if snap.pool == "hot" else None,
                               (m.model for m in snap.models))
                if snap.active_model:
                    pools.observe_rates(snap.active_model, snap.prefill_tok_s, snap.decode_tok_s)
            case CallRouted(call=call) if call.call_id in self.inflight_calls:
                pools.routed(call.session_id, call.model, event.instance_id, call.prompt_tokens, now, call.call_id)
            case CallCompleted():
                pools.completed(event.session_id, event.model, event.prompt_tokens, event.cached_tokens,
                                event.output_tokens, event.prefill_s, event.decode_s, now, event.call_id)
            case CallFailed():
                pools.failed(event.call_id, now)
            case InstanceLost() if event.instance_id not in self.instances:
                pools.forget(event.instance_id)
            case PoolPinned():
                # another router moved a pool: known here at once, not a heartbeat later
                pools.pinned(event.instance_id, event.model, event.at)

    def _pushed(self, done: KvPushed) -> None:
        """A drain moved the session's KV to `done.instance_id`'s host registry: it lives there
        now (its next call is priced there as a host restore once that agent's snapshot says
        so; until then as the completion's KV, like any session's last instance)."""
        self.homes.moved(done.session_id, done.instance_id, done.model)
        entry = self.sessions.get(done.session_id)
        if entry is not None and entry.model == done.model:
            entry.last_instance = done.instance_id
            entry.last_used = max(entry.last_used, done.at)

    def _observed(self, snapshot: InstanceSnapshot, now: float) -> None:
        """A fresh snapshot replaces the overlay: it already counts what was routed before it."""
        old = self.instances.get(snapshot.instance_id)
        iid = snapshot.instance_id
        drained = self.drained_as.get(iid)
        restarted = drained is not None and drained != snapshot.incarnation
        if old is not None and old.snapshot.incarnation != snapshot.incarnation:
            old = None  # a new process: its view starts afresh whatever the versions say
            restarted = True
        if restarted and iid in self.draining:  # drained, then restarted (lost or not between): back in service
            self.draining.discard(iid)
            self.drained_as.pop(iid, None)
            self.pushes.forget(iid)
        if old is not None and snapshot.version < old.snapshot.version:
            return  # out-of-order heartbeat
        if snapshot.active_model:  # the rates it reports are its active model's
            self.model(snapshot.active_model).observe_engine(snapshot.prefill_tok_s, snapshot.restore_tok_s,
                                                                  snapshot.prefill_ctx_s_per_tok2,
                                                                  snapshot.prefill_ctx_measured)
        if old is not None and old.restamp(snapshot, now):
            return  # a heartbeat re-send: same view, new version/time, overlay reset
        view = InstanceView(snapshot, now, prior=old)
        if old is not None:
            view.inflight = old.inflight
            view.inherit_kv_index(old)
        self.instances[snapshot.instance_id] = view

    def _lost(self, event: InstanceLost) -> None:
        """The agent process is gone: drop its view and prefix entries and close its calls.
        Its leases stay until consumed, discarded (reason instance_gone) or expired, so each
        is audited."""
        view = self.instances.get(event.instance_id)
        if view is not None and view.snapshot.incarnation == event.incarnation:
            if event.instance_id in self.draining:  # its drain's status still answers for it (RouterCore.drain)
                self.pushes.holder_lost(event.instance_id, [s for s, _ in kv_on(self, event.instance_id)],
                                        f"{event.instance_id} was lost while draining ({event.reason})")
            del self.instances[event.instance_id]
            self.prefix.forget_instance(event.instance_id)
            self.homes.forget_instance(event.instance_id)
        for call_id in event.calls:
            self._finished(call_id, event.at)

    def _remember(self, call_id: str, instance_id: str) -> None:
        self.routed[call_id] = instance_id
        if len(self.routed) > ROUTED_KEPT:
            oldest = next(iter(self.routed))  # oldest first
            del self.routed[oldest]
            self.submission_seq.pop(oldest, None)

    def decided(self, call_id: str, seq: int) -> None:
        """The submission of `call_id` at stream sequence `seq` was decided (routed or failed)."""
        if call_id in self.routed and seq > 0:
            self.submission_seq[call_id] = seq

    def reused(self, call_id: str, seq: int) -> bool:
        """A submission at `seq` carries the id of a call decided from another message."""
        first = self.submission_seq.get(call_id)
        return first is not None and seq > 0 and first != seq

    def _routed(self, event: CallRouted) -> None:
        call = event.call
        if call.call_id in self.routed:
            # Folded before: replay folds again the router's own outputs stored after the
            # checkpoint's sequence (counting it twice would leave its session running on the
            # instance for ever), or the call ended before its routing reached the stream (the
            # agent ran the fast copy) and the session already moved on with its completion.
            self.decided(call.call_id, event.submitted_seq)
            return
        self._remember(call.call_id, event.instance_id)
        self.decided(call.call_id, event.submitted_seq)  # the stream's copy names it (replay)
        self.routed_total += 1
        entry = self._touch(call.session_id)
        if entry.last_completed_at is not None and entry.model == call.model:
            gap = max(0.0, call.submitted_at - entry.last_completed_at)
            entry.gaps.append(gap)
            del entry.gaps[:-SESSION_GAPS_KEPT]
            if self.model(call.model).observe_gap(gap):
                self.horizon_epoch += 1  # a session's idle horizon changed: homes.py's cache
        entry.last_completed_at = None
        # What the call must compute there: a session back where its last call ran reuses
        # its KV there (device or host), so only its new tokens queue as prefill work.
        reused = min(call.prompt_tokens, entry.kv_tokens) \
            if entry.last_instance == event.instance_id and entry.model == call.model else 0
        entry.calls = max(entry.calls, event.call_index + 1)
        entry.model = call.model
        if entry.first_instance is None:
            entry.first_instance = event.instance_id
        tokens = call.prompt_tokens
        self.inflight_calls[call.call_id] = InFlight(event.instance_id, tokens, call.model, call.session_id,
                                                     event.call_index, call.reply_to)
        prof = self.model(call.model)
        prof.observe_arrival(event.routed_at)
        prof.calls_seen += 1
        prof.sessions_seen += event.call_index == 0
        view = self.instances.get(event.instance_id)
        if view is not None:
            view.inflight.add(call.call_id)
            view.add_overlay(call.call_id, tokens, call.model, tokens - reused)
        self.prefix.insert(event.instance_id, call.model, call.session_id, call.block_hashes)
        self.homes.prune(event.instance_id, event.routed_at, self.idle_horizon_s)
        self.homes.routed(call.session_id, event.instance_id, call.model, event.routed_at)

    def _completed(self, event: CallCompleted) -> None:
        if event.call_id not in self.routed:
            # The agent ran the fast dispatch copy, and the router stopped before its routing
            # was stored: the redelivered submission must not place (and run) it again.
            self._remember(event.call_id, event.instance_id)
        self._finished(event.call_id, event.completed_at)
        entry = self.session(event.session_id)
        entry.model = event.model
        entry.last_instance = event.instance_id
        entry.kv_tokens = event.kv_tokens or (event.prompt_tokens + event.output_tokens)
        entry.last_used = event.completed_at
        entry.last_completed_at = event.completed_at
        entry.last_call_id = event.call_id
        self.outputs.observe(event.session_id, event.model, event.output_tokens)
        self.model(event.model).observe_completion(
            event.prompt_tokens, event.cached_tokens, event.output_tokens,
            event.prefill_s, event.decode_s, event.ttft_s,
        )

    def _finished(self, call_id: str, at: float) -> None:
        placed = self.inflight_calls.pop(call_id, None)
        if placed is None:
            return
        self.homes.ended(placed.session_id, placed.instance_id, at)
        view = self.instances.get(placed[0])
        if view is not None:
            view.inflight.discard(call_id)
            view.drop_overlay(call_id)

    def _install(self, event: LeaseIssued) -> None:
        self.leases.add(event)  # the book holds the event itself: no second lease shape
        self.session(event.session_id).lease = event

    def _drop_lease(self, session_id: str, instance_id: str, model: str, at: float | None,
                    by_call: str | None) -> None:
        """Drop the session's lease for a LeaseExpired (`at`) or a LeaseConsumed /
        LeaseDiscarded (`by_call`, the call that consumed or discarded it). An event about an
        older lease leaves its successor alone: replay folds again the router's own outputs
        stored after the checkpoint's sequence, and a dispatched call can complete (and
        install its lease) before its LeaseConsumed reaches the stream."""
        entry = self.sessions.get(session_id)
        lease = entry.lease if entry is not None else None
        if lease is None or lease.instance_id != instance_id or lease.model != model:
            return  # about an older lease that a successor already replaced
        if at is not None and lease.expires_at > at:
            return  # an expiry notice for a lease that is still live
        if by_call is not None and lease.call_id == by_call:
            return  # the call that consumed or discarded the older lease installed this one
        entry.lease = None
        self.leases.remove(session_id)

    # ---- projection form --------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain JSON-able dict (the Postgres projection). The prefix index is a soft cache
        and is not included (see prefix_index.py)."""
        return {
            "format": STATE_FORMAT,
            "routed_total": self.routed_total,
            "session_fields": _SESSION_FIELDS,
            "sessions": [_session_row(e) for e in self.sessions.values()],
            "leases": self.leases.to_list(),
            "instances": [_view_to_dict(v) for v in self.instances.values()],
            "inflight_calls": {c: list(p) for c, p in self.inflight_calls.items()},
            "routed": dict(self.routed),
            "submission_seq": dict(self.submission_seq),
            "models": {m: dict(vars(p), gaps=list(p.gaps)) for m, p in self.models.items()},
            "instance_profiles": {i: dict(vars(p)) for i, p in self.instance_profiles.items()},
            "homes": self.homes.to_list(),
            "outputs": self.outputs.to_dict(),
            "pools": self.pools.to_dict() if self.pools is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict) -> RouterState:
        if data.get("format", STATE_FORMAT) not in READABLE_FORMATS:
            raise ValueError(f"router state format {data.get('format')!r} is not one of {READABLE_FORMATS}")
        state = cls(routed_total=data.get("routed_total", 0))
        fields = data.get("session_fields")
        for row in data.get("sessions", []):
            if not isinstance(row, dict):  # a row in session_fields order (a dict: format 1)
                row = dict(zip(fields, row))
            state.sessions[row["session_id"]] = SessionEntry(**{**row, "gaps": list(row.get("gaps", []))}, lease=None)
        state.leases = LeaseBook.from_list(data.get("leases", []))
        for lease in state.leases.leases.values():
            state.session(lease.session_id).lease = lease
        for row in data.get("instances", []):
            view = _view_from_dict(row)
            state.instances[view.instance_id] = view
        state.inflight_calls = {c: InFlight(*p) for c, p in data.get("inflight_calls", {}).items()}
        state.routed = dict(data.get("routed", {}))
        state.submission_seq = dict(data.get("submission_seq", {}))
        state.models = {m: ModelProfile(**p) for m, p in data.get("models", {}).items()}
        state.instance_profiles = {i: InstanceProfile(**p) for i, p in data.get("instance_profiles", {}).items()}
        state.homes = HomeBook.from_list(data.get("homes", []))
        state.outputs = OutputEstimator.from_dict(data.get("outputs", {}))
        pools = data.get("pools")
        state.pools = HotPools.from_dict(pools) if pools is not None else None
        return state


def _event_time(event: Event | SnapshotReceived) -> float:
    """When an event happened, by its own clock (a fold with no router time given)."""
    for name in ("received_at", "routed_at", "completed_at", "at"):
        t = getattr(event, name, None)
        if t is not None:
            return t
    return 0.0


def _view_to_dict(view: InstanceView) -> dict:
    return {
        "snapshot": msgspec.to_builtins(view.snapshot),
        "received_at": view.received_at,
        "overlay": [[c, t, m, n] for c, (t, m, n) in view.overlay.items()],
        "inflight": sorted(view.inflight),
    }


def _view_from_dict(row: dict) -> InstanceView:
    view = InstanceView(msgspec.convert(row["snapshot"], InstanceSnapshot), row["received_at"])
    for call_id, tokens, model, *new in row.get("overlay", []):  # rows before `new` lack it
        view.add_overlay(call_id, tokens, model, new[0] if new else None)
    view.inflight = set(row.get("inflight", []))
    return view


def kv_on(state, holder: str) -> list[tuple[str, str]]:
    """(session, model) of every session whose KV lives on `holder`: homed there in the book
    (live or idle, not yet expired), or in its snapshot's device or host registry and homed
    nowhere else (a session that returned elsewhere has moved on)."""
    out = {(s, m) for m, homes in state.homes.by_instance.get(holder, {}).items() for s in homes.idle_since}
    view = state.instances.get(holder)
    if view is not None:
        for kv in view.snapshot.sessions:
            home = state.homes.home_of.get(kv.session_id)
            if kv.state in ("device", "host") and kv.kv_tokens > 0 and (home is None or home[0] == holder):
                out.add((kv.session_id, kv.model))
    return sorted(out)
