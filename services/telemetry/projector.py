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

from sqlalchemy import case, func, update
from sqlalchemy.dialects.postgresql import insert

from talaria.shared.db.schema import calls, lease_decisions, lease_events, rounds, sessions, switches
from talaria.shared.events import (
    CallCompleted,
    CallFailed,
    CallRouted,
    CallStarted,
    CallSubmitted,
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
            await conn.execute(
                update(calls).where(calls.c.call_id == event.call.call_id).values(
                    call_index=event.call_index, instance_id=event.instance_id, routed_at=ts(event.routed_at),
                    outcome=func.coalesce(_final_outcome(), "routed"),
                )
            )
        case CallStarted():
            await conn.execute(
                update(calls).where(calls.c.call_id == event.call_id).values(
                    started_at=ts(event.started_at), instance_id=event.instance_id,
                    outcome=func.coalesce(_final_outcome(), "running"),
                )
            )
        case CallCompleted():
            return await _completed(conn, event)
        case CallFailed():
            return await _failed(conn, event)
        case RoutingDecision():
            await _decision(conn, event)
        case LeaseIssued() | LeaseConsumed() | LeaseDiscarded() | LeaseExpired():
            await _lease(conn, event, seq)
        case SwitchDone():
            await conn.execute(insert(switches).values(
                seq=seq, instance_id=event.instance_id, from_model=event.from_model, to_model=event.to_model,
                path=event.path, total_s=event.total_s, phases=event.phases, bytes_staged=event.bytes_staged,
                bytes_uncovered=event.bytes_uncovered, at=ts(event.at),
            ).on_conflict_do_nothing())
        case RoundSummary():
            await conn.execute(insert(rounds).values(
                seq=seq, instance_id=event.instance_id, round_index=event.round_index, wall_s=event.wall_s,
                active_s=event.active_s, switch_s=event.switch_s, slots=event.slots,
                sp_admitted=event.sp_admitted, sp_parked=event.sp_parked, deadline_risk=event.deadline_risk,
                at=ts(event.at),
            ).on_conflict_do_nothing())
    return True


def _final_outcome():
    # Events can arrive out of order across subjects; never downgrade a finished call.
    return case((calls.c.outcome.in_(FINAL), calls.c.outcome), else_=None)


def text_(value: str | None) -> str | None:
    """Free text bound for Postgres, which refuses NUL in text."""
    return None if value is None else value.replace("\x00", "\\x00")


async def _bump_session(conn, session_id: str, at: dt.datetime | None, model: str, *, calls_: int = 0,
                        completed: int = 0, failed: int = 0, instance: str | None = None) -> None:
    """Add to a session's counts, creating its row if this is the first event seen of it."""
    at = at or dt.datetime.now(dt.timezone.utc)
    trace = trace_id_hex(session_trace_id(session_id))
    set_ = {"calls": sessions.c.calls + calls_, "completed": sessions.c.completed + completed,
            "failed": sessions.c.failed + failed,
            "first_seen_at": func.least(sessions.c.first_seen_at, at),
            "last_seen_at": func.greatest(sessions.c.last_seen_at, at)}
    if calls_:
        set_["last_model"] = model
    if instance:
        set_["last_instance"] = instance
    await conn.execute(insert(sessions).values(
        session_id=session_id, first_seen_at=at, last_seen_at=at, calls=calls_, completed=completed, failed=failed,
        last_model=model, last_instance=instance, trace_id=trace,
    ).on_conflict_do_update(index_elements=[sessions.c.session_id], set_=set_))


async def _submitted(conn, e: CallSubmitted) -> bool:
    """Create the call's row, or fill a row a later event created first; count the call once."""
    at = ts(e.submitted_at)
    submission = dict(api=e.api, prompt_tokens=e.prompt_tokens, submitted_at=at,
                      trace_id=trace_id_hex(session_trace_id(e.session_id)))
    stmt = insert(calls).values(call_id=e.call_id, session_id=e.session_id, model=e.model, outcome="submitted",
                                **submission)
    stmt = stmt.on_conflict_do_update(index_elements=[calls.c.call_id], set_=submission,
                                      where=calls.c.api.is_(None)).returning(calls.c.call_id)
    if (await conn.execute(stmt)).first() is None:
        return False  # seen before: count each call once
    await _bump_session(conn, e.session_id, at, e.model, calls_=1)
    return True


async def _finish(conn, call_id: str, values: dict, row: dict) -> bool:
    """Move the call's row into its final outcome, once: True when this event did it."""
    result = await conn.execute(update(calls).where(calls.c.call_id == call_id)
                                .where(calls.c.outcome.notin_(FINAL)).values(**values))
    if result.rowcount == 0:  # final already, or the first event seen of this call
        result = await conn.execute(insert(calls).values(call_id=call_id, **row, **values)
                                    .on_conflict_do_nothing())
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
    await conn.execute(update(lease_decisions).where(lease_decisions.c.call_id == e.call_id).values(
        outcome="completed", ttft_s=e.ttft_s, kv_source=e.kv_source, completed_at=ts(e.completed_at),
    ))
    return True


async def _failed(conn, e: CallFailed) -> bool:
    values, row = failed_values(e)
    outcome = values["outcome"]
    if not await _finish(conn, e.call_id, values, row):
        return False
    await _bump_session(conn, e.session_id, ts(e.at), e.model, failed=1)
    await conn.execute(update(lease_decisions).where(lease_decisions.c.call_id == e.call_id)
                       .values(outcome=outcome, completed_at=ts(e.at)))
    return True


async def _decision(conn, e: RoutingDecision) -> None:
    candidates = [
        {f: getattr(c, f) for f in c.__struct_fields__} for c in e.candidates
    ]
    await conn.execute(insert(lease_decisions).values(
        call_id=e.call_id, session_id=e.session_id, call_index=e.call_index, model=e.model, policy=e.policy,
        action=e.action, decided_at=ts(e.decided_at), chosen_instance=e.chosen, lease_outcome=e.lease_outcome,
        lease_instance=e.lease_instance, discard_reason=text_(e.discard_reason), candidates=candidates,
        retry_after_s=e.retry_after_s, decision_us=e.decision_us, model_opened=e.model_opened,
        avoidable_cold_open=e.avoidable_cold_open, reason=text_(e.reason) or None,
    ).on_conflict_do_nothing())
    # The call may have finished before its decision was projected: join its outcome in now.
    await conn.execute(update(lease_decisions).where(
        lease_decisions.c.call_id == e.call_id, lease_decisions.c.outcome.is_(None),
        lease_decisions.c.call_id == calls.c.call_id,
        calls.c.call_id == e.call_id, calls.c.outcome.in_(FINAL),
    ).values(outcome=calls.c.outcome, ttft_s=calls.c.ttft_s, kv_source=calls.c.kv_source,
             completed_at=calls.c.completed_at))


async def _lease(conn, e, seq: int) -> None:
    kind = {LeaseIssued: "issued", LeaseConsumed: "consumed", LeaseDiscarded: "discarded",
            LeaseExpired: "expired"}[type(e)]
    at = getattr(e, "issued_at", None) or getattr(e, "at")
    await conn.execute(insert(lease_events).values(
        seq=seq, kind=kind, session_id=e.session_id, model=e.model, instance_id=e.instance_id,
        call_id=getattr(e, "call_id", None), reason=text_(getattr(e, "reason", None)), at=ts(at),
        expires_at=ts(getattr(e, "expires_at", None)),
    ).on_conflict_do_nothing())
