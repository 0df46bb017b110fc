"""Event → Postgres projection, idempotent: an event applied again, in any order relative to
the others, changes nothing a second time (delivery is at-least-once and, after a crash,
out of order).

How each count stays exact: `sessions.calls` counts a call when its CallSubmitted is
first applied (the `calls.api` column, set only by the submission, marks that);
`completed` / `failed` count the one transition of a `calls` row into a final outcome;
the first final outcome wins (a `failed` row never becomes `completed`). Rows keyed by
stream sequence (lease events, switches, rounds) are inserted once per sequence.

`project(conn, event, seq)` issues the SQL for one event inside the caller's
transaction and says whether the event was new (so span bookkeeping counts it once).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import bindparam, case, func, update
from sqlalchemy.dialects.postgresql import insert

from talaria.shared.db.schema import calls, lease_decisions, lease_events, refused_dispatches, rounds, sessions, switches
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
from talaria.shared.messages import CANCELLED_STATUS
from talaria.shared.tracing import session_trace_id, trace_id_hex


def ts(epoch: float | None) -> dt.datetime | None:
    return None if epoch is None else dt.datetime.fromtimestamp(epoch, dt.timezone.utc)


FINAL = ("completed", "failed", "cancelled")


async def project(conn, event: Event, seq: int) -> bool:
    match event:
        case CallSubmitted():
            return await _submitted(conn, event)
        case CallRouted():
            await _submitted(conn, event.call)  # a no-op unless the submission was not seen yet
            await conn.execute(ROUTED, dict(cid=event.call.call_id, p_index=event.call_index,
                                            p_instance=event.instance_id, p_at=ts(event.routed_at)))
        case CallStarted():
            await conn.execute(STARTED, dict(cid=event.call_id, p_instance=event.instance_id,
                                             p_at=ts(event.started_at)))
        case CallCompleted():
            return await _completed(conn, event)
        case CallFailed():
            return await _failed(conn, event)
        case RoutingDecision():
            await _decision(conn, event)
        case LeaseIssued() | LeaseConsumed() | LeaseDiscarded() | LeaseExpired():
            await _lease(conn, event, seq)
        case SwitchDone():
            await conn.execute(INSERT_ONCE[switches], dict(
                seq=seq, instance_id=event.instance_id, from_model=event.from_model, to_model=event.to_model,
                path=event.path, total_s=event.total_s, phases=event.phases, bytes_staged=event.bytes_staged,
                bytes_uncovered=event.bytes_uncovered, at=ts(event.at)))
        case RoundSummary():
            await conn.execute(INSERT_ONCE[rounds], dict(
                seq=seq, instance_id=event.instance_id, round_index=event.round_index, wall_s=event.wall_s,
                active_s=event.active_s, switch_s=event.switch_s, slots=event.slots,
                sp_admitted=event.sp_admitted, sp_parked=event.sp_parked, deadline_risk=event.deadline_risk,
                at=ts(event.at)))
        case DispatchRefused():
            await conn.execute(INSERT_ONCE[refused_dispatches], refused_row(event, seq))
    return True


def refused_row(e: DispatchRefused, seq: int) -> dict:
    return dict(seq=seq, call_id=e.call_id, session_id=e.session_id, instance_id=e.instance_id,
                router_id=e.fence.router_id, partition=e.fence.partition, epoch=e.fence.epoch, holder=e.holder,
                holder_epoch=e.holder_epoch, at=ts(e.at))


# The statements are built once: building one per event cost about half of the projector's
# CPU. Values come as bound parameters; an INSERT or UPDATE without `.values()` takes its
# columns from the parameters' keys (SQLAlchemy caches one compiled form per key set).


def _final_outcome():
    # Events can arrive out of order across subjects; never downgrade a finished call.
    return case((calls.c.outcome.in_(FINAL), calls.c.outcome), else_=None)


ROUTED = update(calls).where(calls.c.call_id == bindparam("cid")).values(
    call_index=bindparam("p_index"), instance_id=bindparam("p_instance"), routed_at=bindparam("p_at"),
    outcome=func.coalesce(_final_outcome(), "routed"))
STARTED = update(calls).where(calls.c.call_id == bindparam("cid")).values(
    started_at=bindparam("p_at"), instance_id=bindparam("p_instance"),
    outcome=func.coalesce(_final_outcome(), "running"))
INSERT_ONCE = {t: insert(t).on_conflict_do_nothing()
               for t in (calls, switches, rounds, lease_events, lease_decisions, refused_dispatches)}
SUBMISSION = ("api", "prompt_tokens", "submitted_at", "trace_id")
_new_call = insert(calls)
SUBMIT = _new_call.on_conflict_do_update(  # fills a row a later event created first; never twice
    index_elements=[calls.c.call_id], set_={c: _new_call.excluded[c] for c in SUBMISSION},
    where=calls.c.api.is_(None)).returning(calls.c.call_id)
FINISH = update(calls).where(calls.c.call_id == bindparam("cid"), calls.c.outcome.notin_(FINAL))
_seen = insert(sessions)
BUMP_SESSION = _seen.on_conflict_do_update(index_elements=[sessions.c.session_id], set_={
    "calls": sessions.c.calls + _seen.excluded.calls, "completed": sessions.c.completed + _seen.excluded.completed,
    "failed": sessions.c.failed + _seen.excluded.failed,
    "first_seen_at": func.least(sessions.c.first_seen_at, _seen.excluded.first_seen_at),
    "last_seen_at": func.greatest(sessions.c.last_seen_at, _seen.excluded.last_seen_at),
    # a call's submission names the session's model; a completion its instance
    "last_model": case((_seen.excluded.calls > 0, _seen.excluded.last_model), else_=sessions.c.last_model),
    "last_instance": func.coalesce(_seen.excluded.last_instance, sessions.c.last_instance),
})
DECISION_OUTCOME = update(lease_decisions).where(lease_decisions.c.call_id == bindparam("cid"))
# The call may have finished before its decision was projected: join its outcome in now.
DECISION_JOIN = update(lease_decisions).where(
    lease_decisions.c.call_id == bindparam("cid"), lease_decisions.c.outcome.is_(None),
    lease_decisions.c.call_id == calls.c.call_id, calls.c.outcome.in_(FINAL),
).values(outcome=calls.c.outcome, ttft_s=calls.c.ttft_s, kv_source=calls.c.kv_source,
         completed_at=calls.c.completed_at)


def text_(value: str | None) -> str | None:
    """Free text bound for Postgres, which refuses NUL in text."""
    return None if value is None else value.replace("\x00", "\\x00")


async def _bump_session(conn, session_id: str, at: dt.datetime | None, model: str, *, calls_: int = 0,
                        completed: int = 0, failed: int = 0, instance: str | None = None) -> None:
    """Add to a session's counts, creating its row if this is the first event seen of it."""
    at = at or dt.datetime.now(dt.timezone.utc)
    await conn.execute(BUMP_SESSION, dict(
        session_id=session_id, first_seen_at=at, last_seen_at=at, calls=calls_, completed=completed, failed=failed,
        last_model=model, last_instance=instance, trace_id=trace_id_hex(session_trace_id(session_id))))


async def _submitted(conn, e: CallSubmitted) -> bool:
    """Create the call's row, or fill a row a later event created first; count the call once."""
    at = ts(e.submitted_at)
    row = dict(call_id=e.call_id, session_id=e.session_id, model=e.model, outcome="submitted", api=e.api,
               prompt_tokens=e.prompt_tokens, submitted_at=at, trace_id=trace_id_hex(session_trace_id(e.session_id)))
    if (await conn.execute(SUBMIT, row)).first() is None:
        return False  # seen before: count each call once
    await _bump_session(conn, e.session_id, at, e.model, calls_=1)
    return True


async def _finish(conn, call_id: str, values: dict, row: dict) -> bool:
    """Move the call's row into its final outcome, once: True when this event did it."""
    result = await conn.execute(FINISH, dict(cid=call_id, **values))
    if result.rowcount == 0:  # final already, or the first event seen of this call
        result = await conn.execute(INSERT_ONCE[calls], dict(call_id=call_id, **row, **values))
    return result.rowcount > 0


def completed_values(e: CallCompleted) -> tuple[dict, dict]:
    """(the final columns, the row's identity should the completion be its first event);
    shared with the in-memory store so both write the same columns."""
    values = dict(
        call_index=e.call_index, instance_id=e.instance_id, outcome="completed",
        prompt_tokens=e.prompt_tokens, output_tokens=e.output_tokens, cached_tokens=e.cached_tokens,
        kv_source=e.kv_source, finish_reason=text_(e.finish_reason), started_at=ts(e.started_at),
        first_token_at=ts(e.first_token_at), completed_at=ts(e.completed_at), queue_s=e.queue_s,
        ttft_s=e.ttft_s, prefill_s=e.prefill_s, decode_s=e.decode_s, slot_wait_s=e.slot_wait_s,
        migrated_bytes=e.migrated_bytes, migrate_s=e.migrate_s,
    )
    return values, dict(session_id=e.session_id, model=e.model, submitted_at=ts(e.submitted_at))


def failed_values(e: CallFailed) -> tuple[dict, dict]:
    """As `completed_values`; a client's cancel (status 499) is outcome `cancelled`."""
    outcome = "cancelled" if e.status == CANCELLED_STATUS else "failed"
    values = dict(outcome=outcome, error=text_(e.reason), failed_stage=text_(e.stage), status=e.status,
                  completed_at=ts(e.at))
    if e.instance_id:
        values["instance_id"] = e.instance_id
    if e.call_index is not None:
        values["call_index"] = e.call_index
    return values, dict(session_id=e.session_id, model=e.model, submitted_at=ts(e.at))


async def _completed(conn, e: CallCompleted) -> bool:
    values, row = completed_values(e)
    if not await _finish(conn, e.call_id, values, row):
        return False  # already final: count it once, never flip failed -> completed
    await _bump_session(conn, e.session_id, ts(e.completed_at), e.model, completed=1, instance=e.instance_id)
    await conn.execute(DECISION_OUTCOME, dict(cid=e.call_id, outcome="completed", ttft_s=e.ttft_s,
                                              kv_source=e.kv_source, completed_at=ts(e.completed_at)))
    return True


async def _failed(conn, e: CallFailed) -> bool:
    values, row = failed_values(e)
    if not await _finish(conn, e.call_id, values, row):
        return False
    await _bump_session(conn, e.session_id, ts(e.at), e.model, failed=1)
    await conn.execute(DECISION_OUTCOME, dict(cid=e.call_id, outcome=values["outcome"], completed_at=ts(e.at)))
    return True


async def _decision(conn, e: RoutingDecision) -> None:
    candidates = [
        {f: getattr(c, f) for f in c.__struct_fields__} for c in e.candidates
    ]
    await conn.execute(INSERT_ONCE[lease_decisions], dict(
        call_id=e.call_id, session_id=e.session_id, call_index=e.call_index, model=e.model, policy=e.policy,
        action=e.action, decided_at=ts(e.decided_at), chosen_instance=e.chosen, lease_outcome=e.lease_outcome,
        lease_instance=e.lease_instance, discard_reason=text_(e.discard_reason), candidates=candidates,
        retry_after_s=e.retry_after_s, decision_us=e.decision_us, model_opened=e.model_opened,
        avoidable_cold_open=e.avoidable_cold_open, reason=text_(e.reason) or None))
    await conn.execute(DECISION_JOIN, dict(cid=e.call_id))


async def _lease(conn, e, seq: int) -> None:
    kind = {LeaseIssued: "issued", LeaseConsumed: "consumed", LeaseDiscarded: "discarded",
            LeaseExpired: "expired"}[type(e)]
    at = getattr(e, "issued_at", None) or getattr(e, "at")
    await conn.execute(INSERT_ONCE[lease_events], dict(
        seq=seq, kind=kind, session_id=e.session_id, model=e.model, instance_id=e.instance_id,
        call_id=getattr(e, "call_id", None), reason=text_(getattr(e, "reason", None)), at=ts(at),
        expires_at=ts(getattr(e, "expires_at", None))))
