"""Where the projection lands: one small interface, a Postgres store and an in-memory store.

The telemetry service needs three things of a store: apply a batch of `(event, seq)`
atomically (each event idempotently, `project` saying whether it was new), quarantine a
poison event without sinking the batch, and remember the highest stream sequence covered.
`PostgresStore` does it with the SQL in projector.py; `MemoryStore` holds the same rows in
dicts (a simulator, a dry-run replay or a test can project without a database). One
contract-test suite (tests/integration/test_projection_store.py) runs against both, so the
SQL and the fold cannot drift apart. Reads (`call`, `session`, `decision`, `rows`) expose the
operator-visible columns, the same names as the SQL tables.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from typing import Protocol

from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert

from talaria.services.telemetry.projector import (FINAL, completed_values, failed_values, project, refused_row,
                                                 text_, ts)
from talaria.shared.db.connection import DB_ERRORS
from talaria.shared.db.schema import calls, lease_decisions, metadata, projections, quarantined_events, sessions
from talaria.shared.events import (
    CallCompleted,
    CallFailed,
    CallRouted,
    CallStarted,
    CallSubmitted,
    DispatchRefused,
    Event,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    LeaseIssued,
    RoundSummary,
    RoutingDecision,
    SwitchDone,
)
from talaria.shared.tracing import session_trace_id, trace_id_hex

NAME = "telemetry"  # the row in `projections` holding the covered stream sequence


class PoisonEvent(Exception):
    """This event, not the store, is at fault: quarantine it and go on."""


class EventRefused(Exception):
    """An event failed in a batch applied without a savepoint per event: the transaction is
    lost, so the caller applies the batch again with `isolate=True` to find the culprit."""


class ProjectionBatch(Protocol):
    async def project(self, event: Event, seq: int) -> bool:
        """Apply one event; True when it changed something for the first time. Raises
        PoisonEvent when the event cannot be projected; anything else is the store's trouble."""

    async def quarantine(self, seq: int, subject: str, error: str, data: bytes) -> None: ...

    def cover(self, seq: int) -> None:
        """Count a skipped event into the batch's offset (it is done with, though not projected)."""


class TelemetryStore(Protocol):
    def batch(self, isolate: bool = True) -> contextlib.AbstractAsyncContextManager[ProjectionBatch]:
        """One atomic, durable unit: all of it is applied, with the covered offset, or none.
        `isolate=False` skips the per-event isolation (cheaper); an event that fails then
        raises EventRefused and the whole batch is undone."""

    async def offset(self) -> int: ...
    async def call(self, call_id: str) -> dict | None: ...
    async def session(self, session_id: str) -> dict | None: ...
    async def decision(self, call_id: str) -> dict | None: ...
    async def rows(self, table: str) -> int: ...
    async def close(self) -> None: ...


CALL_COLUMNS = ("session_id", "model", "call_index", "instance_id", "api", "outcome", "prompt_tokens",
                "output_tokens", "cached_tokens", "kv_source", "migrated_bytes", "migrate_s", "finish_reason", "error", "failed_stage", "status",
                "submitted_at", "routed_at", "started_at", "completed_at", "ttft_s", "queue_s")
SESSION_COLUMNS = ("calls", "completed", "failed", "last_model", "last_instance", "first_seen_at", "last_seen_at")
DECISION_COLUMNS = ("chosen_instance", "lease_outcome", "action", "outcome", "ttft_s", "kv_source", "reason")


# --------------------------------------------------------------------------------------
# Postgres
# --------------------------------------------------------------------------------------

# SQLSTATE classes that say "the database, not this event": 08 connection, 40 rollback
# (serialization, deadlock), 53 resources, 55 lock, 57 operator intervention, 58 system.
TRANSIENT_SQLSTATE_CLASSES = {"08", "40", "53", "55", "57", "58"}


class PostgresStore:
    def __init__(self, engine) -> None:
        self.engine = engine

    @contextlib.asynccontextmanager
    async def batch(self, isolate: bool = True) -> AsyncIterator[ProjectionBatch]:
        async with self.engine.begin() as conn:
            # Durable before the caller acks, even when the server runs with it off.
            await conn.execute(text("SET LOCAL synchronous_commit = on"))
            b = _PgBatch(conn, isolate)
            yield b
            now = dt.datetime.now(dt.timezone.utc)
            await conn.execute(insert(projections).values(name=NAME, seq=b.offset, saved_at=now).on_conflict_do_update(
                index_elements=[projections.c.name],
                set_=dict(seq=func.greatest(projections.c.seq, b.offset), saved_at=now)))

    async def offset(self) -> int:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(projections.c.seq).where(projections.c.name == NAME))).first()
        return row.seq if row else 0

    async def _one(self, table, key, value, columns) -> dict | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(*(table.c[c] for c in columns)).where(table.c[key] == value))).first()
        return None if row is None else dict(row._mapping)

    async def call(self, call_id: str) -> dict | None:
        return await self._one(calls, "call_id", call_id, CALL_COLUMNS)

    async def session(self, session_id: str) -> dict | None:
        return await self._one(sessions, "session_id", session_id, SESSION_COLUMNS)

    async def decision(self, call_id: str) -> dict | None:
        return await self._one(lease_decisions, "call_id", call_id, DECISION_COLUMNS)

    async def rows(self, table: str) -> int:
        async with self.engine.connect() as conn:
            return (await conn.execute(select(func.count()).select_from(metadata.tables[table]))).scalar_one()

    async def close(self) -> None:
        await self.engine.dispose()


class _Offset:
    offset = 0

    def cover(self, seq: int) -> None:
        self.offset = max(self.offset, seq)


class _PgBatch(_Offset):
    def __init__(self, conn, isolate: bool) -> None:
        self.conn = conn
        self.isolate = isolate

    async def project(self, event: Event, seq: int) -> bool:
        self.cover(seq)
        if not self.isolate:  # no savepoint: two round trips fewer per event
            try:
                return await project(self.conn, event, seq)
            except Exception as exc:
                if _is_transient(exc):
                    raise
                raise EventRefused(f"{type(exc).__name__}: {exc}") from exc
        try:
            async with self.conn.begin_nested():  # a savepoint: one bad event cannot sink the batch
                return await project(self.conn, event, seq)
        except Exception as exc:
            if _is_transient(exc) or not await _alive(self.conn):
                raise  # the database's trouble, not this event's: the caller retries the batch
            raise PoisonEvent(f"{type(exc).__name__}: {exc}") from exc

    async def quarantine(self, seq: int, subject: str, error: str, data: bytes) -> None:
        self.cover(seq)
        await self.conn.execute(insert(quarantined_events).values(
            seq=seq, subject=subject.replace("\x00", ""), error=error.replace("\x00", "\\x00")[:2000],
            data=bytes(data), at=dt.datetime.now(dt.timezone.utc),
        ).on_conflict_do_nothing())


def _is_transient(exc: Exception) -> bool:
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    if isinstance(exc, (OSError, ConnectionError, TimeoutError, InterfaceError, OperationalError)):
        return True
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        state = _sqlstate(exc)
        return state is not None and state[:2] in TRANSIENT_SQLSTATE_CLASSES
    return False  # unknown: the caller asks the connection whether it is still well


async def _alive(conn) -> bool:
    try:
        await conn.execute(text("SELECT 1"))
        return True
    except DB_ERRORS:
        return False


def _sqlstate(exc) -> str | None:
    orig = getattr(exc, "orig", None)
    for e in (orig, getattr(orig, "__cause__", None)):
        state = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
        if state:
            return str(state)
    return None


# --------------------------------------------------------------------------------------
# In memory: the same rules as projector.py, as a fold over dicts
# --------------------------------------------------------------------------------------


class MemoryStore:
    def __init__(self) -> None:
        self.tables: dict[str, dict] = {name: {} for name in metadata.tables}
        self._offset = 0

    @contextlib.asynccontextmanager
    async def batch(self, isolate: bool = True) -> AsyncIterator[ProjectionBatch]:
        # Each event is isolated here at no cost, so `isolate` changes nothing.
        staged = _MemoryBatch({name: {k: dict(v) for k, v in rows.items()} for name, rows in self.tables.items()})
        yield staged
        self.tables = staged.tables  # all or nothing, like the transaction
        self._offset = max(self._offset, staged.offset)

    async def offset(self) -> int:
        return self._offset

    def _one(self, table: str, key: str, columns) -> dict | None:
        row = self.tables[table].get(key)
        return None if row is None else {c: row.get(c) for c in columns}

    async def call(self, call_id: str) -> dict | None:
        return self._one("calls", call_id, CALL_COLUMNS)

    async def session(self, session_id: str) -> dict | None:
        return self._one("sessions", session_id, SESSION_COLUMNS)

    async def decision(self, call_id: str) -> dict | None:
        return self._one("lease_decisions", call_id, DECISION_COLUMNS)

    async def rows(self, table: str) -> int:
        return len(self.tables[table])

    async def close(self) -> None:
        pass


class _MemoryBatch(_Offset):
    def __init__(self, tables: dict[str, dict]) -> None:
        self.tables = tables
        self.calls, self.sessions, self.decisions = tables["calls"], tables["sessions"], tables["lease_decisions"]

    async def quarantine(self, seq: int, subject: str, error: str, data: bytes) -> None:
        self.cover(seq)
        self.tables["quarantined_events"].setdefault(seq, dict(seq=seq, subject=subject, error=error, data=data))

    async def project(self, event: Event, seq: int) -> bool:
        self.cover(seq)
        match event:
            case CallSubmitted():
                return self._submitted(event)
            case CallRouted():
                self._submitted(event.call)
                self._update(event.call.call_id, call_index=event.call_index, instance_id=event.instance_id,
                             routed_at=ts(event.routed_at), outcome="routed")
            case CallStarted():
                self._update(event.call_id, started_at=ts(event.started_at), instance_id=event.instance_id,
                             outcome="running")
            case CallCompleted():
                return self._completed(event)
            case CallFailed():
                return self._failed(event)
            case RoutingDecision():
                self._decision(event)
            case LeaseIssued() | LeaseConsumed() | LeaseDiscarded() | LeaseExpired():
                self.tables["lease_events"].setdefault(seq, dict(seq=seq, session_id=event.session_id))
            case SwitchDone():
                self.tables["switches"].setdefault(seq, dict(seq=seq, instance_id=event.instance_id))
            case RoundSummary():
                self.tables["rounds"].setdefault(seq, dict(seq=seq, instance_id=event.instance_id))
            case DispatchRefused():
                self.tables["refused_dispatches"].setdefault(seq, refused_row(event, seq))
        return True

    def _update(self, call_id: str, outcome: str, **values) -> None:
        row = self.calls.get(call_id)
        if row is not None:
            row.update(values)
            if row["outcome"] not in FINAL:  # never downgrade a finished call
                row["outcome"] = outcome

    def _bump(self, session_id: str, at, model: str, *, calls_=0, completed=0, failed=0, instance=None) -> None:
        at = at or dt.datetime.now(dt.timezone.utc)
        row = self.sessions.setdefault(session_id, dict(
            calls=0, completed=0, failed=0, first_seen_at=at, last_seen_at=at, last_model=model,
            last_instance=None, trace_id=trace_id_hex(session_trace_id(session_id))))
        row["calls"] += calls_
        row["completed"] += completed
        row["failed"] += failed
        row["first_seen_at"], row["last_seen_at"] = min(row["first_seen_at"], at), max(row["last_seen_at"], at)
        if calls_:
            row["last_model"] = model
        if instance:
            row["last_instance"] = instance

    def _submitted(self, e: CallSubmitted) -> bool:
        row = self.calls.get(e.call_id)
        if row is not None and row.get("api") is not None:
            return False  # seen before: count each call once
        submission = dict(api=e.api, prompt_tokens=e.prompt_tokens, submitted_at=ts(e.submitted_at),
                          trace_id=trace_id_hex(session_trace_id(e.session_id)))
        if row is None:
            self.calls[e.call_id] = dict(session_id=e.session_id, model=e.model, outcome="submitted", **submission)
        else:
            row.update(submission)
        self._bump(e.session_id, ts(e.submitted_at), e.model, calls_=1)
        return True

    def _finish(self, call_id: str, values: dict, row: dict) -> bool:
        existing = self.calls.get(call_id)
        if existing is None:
            self.calls[call_id] = {**row, **values}
            return True
        if existing["outcome"] in FINAL:
            return False
        existing.update(values)
        return True

    def _join_decision(self, call_id: str) -> None:
        decision, call = self.decisions.get(call_id), self.calls.get(call_id)
        if decision is not None and call is not None and call["outcome"] in FINAL:
            decision.update({c: call.get(c) for c in ("outcome", "ttft_s", "kv_source", "completed_at")})

    def _completed(self, e: CallCompleted) -> bool:
        if not self._finish(e.call_id, *completed_values(e)):
            return False
        self._bump(e.session_id, ts(e.completed_at), e.model, completed=1, instance=e.instance_id)
        self._join_decision(e.call_id)
        return True

    def _failed(self, e: CallFailed) -> bool:
        if not self._finish(e.call_id, *failed_values(e)):
            return False
        self._bump(e.session_id, ts(e.at), e.model, failed=1)
        self._join_decision(e.call_id)
        return True

    def _decision(self, e: RoutingDecision) -> None:
        if e.call_id not in self.decisions:
            self.decisions[e.call_id] = dict(chosen_instance=e.chosen, lease_outcome=e.lease_outcome,
                                             action=e.action, outcome=None, ttft_s=None, kv_source=None,
                                             reason=text_(e.reason) or None)
        if self.decisions[e.call_id]["outcome"] is None:
            self._join_decision(e.call_id)
