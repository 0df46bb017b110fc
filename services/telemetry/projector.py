"""Event → Postgres projection. Idempotent: replaying an event changes nothing twice.

`project(conn, event, seq)` issues the SQL for one event inside the caller's
transaction; the caller records the stream sequence in `projections` in the same
transaction, so a crash never leaves a half-applied batch.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, update
from sqlalchemy.dialects.postgresql import insert

from talaria.shared.db.schema import calls, lease_decisions, lease_events, rounds, sessions, switches
from talaria.shared.messages import (
    CallCompleted,
    CANCELLED_STATUS,
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
from talaria.shared.tracing import session_trace_id, trace_id_hex


def ts(epoch: float | None) -> dt.datetime | None:
    return None if epoch is None else dt.datetime.fromtimestamp(epoch, dt.timezone.utc)


async def project(conn, event: Event, seq: int) -> None:
    match event:
        case CallSubmitted():
            await _submitted(conn, event)
        case CallRouted():
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
            await _completed(conn, event)
        case CallFailed():
            await _failed(conn, event)
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


FINAL = ["completed", "failed", "cancelled"]


def _final_outcome():
    # Events can arrive out of order across subjects; never downgrade a finished call.
    from sqlalchemy import case

    return case((calls.c.outcome.in_(FINAL), calls.c.outcome), else_=None)


async def _submitted(conn, e: CallSubmitted) -> None:
    at = ts(e.submitted_at)
    inserted = await conn.execute(insert(calls).values(
        call_id=e.call_id, session_id=e.session_id, model=e.model, api=e.api, outcome="submitted",
        prompt_tokens=e.prompt_tokens, submitted_at=at, trace_id=trace_id_hex(session_trace_id(e.session_id)),
    ).on_conflict_do_nothing())
    if inserted.rowcount == 0:
        return  # seen before: count each call once
    stmt = insert(sessions).values(
        session_id=e.session_id, first_seen_at=at, last_seen_at=at, calls=1, last_model=e.model,
        trace_id=trace_id_hex(session_trace_id(e.session_id)),
    )
    await conn.execute(stmt.on_conflict_do_update(
        index_elements=[sessions.c.session_id],
        set_={"last_seen_at": func.greatest(sessions.c.last_seen_at, at), "calls": sessions.c.calls + 1,
              "last_model": e.model},
    ))


async def _completed(conn, e: CallCompleted) -> None:
    values = dict(
        call_index=e.call_index, instance_id=e.instance_id, outcome="completed",
        prompt_tokens=e.prompt_tokens, output_tokens=e.output_tokens, cached_tokens=e.cached_tokens,
        kv_source=e.kv_source, finish_reason=e.finish_reason, started_at=ts(e.started_at),
        first_token_at=ts(e.first_token_at), completed_at=ts(e.completed_at), queue_s=e.queue_s,
        ttft_s=e.ttft_s, prefill_s=e.prefill_s, decode_s=e.decode_s, slot_wait_s=e.slot_wait_s,
    )
    result = await conn.execute(update(calls).where(calls.c.call_id == e.call_id)
                                .where(calls.c.outcome != "completed").values(**values))
    if result.rowcount == 0:  # completion seen before submission (replay from a later point)
        result = await conn.execute(insert(calls).values(call_id=e.call_id, session_id=e.session_id,
                                                         model=e.model, submitted_at=ts(e.submitted_at), **values)
                                    .on_conflict_do_nothing())
    if result.rowcount == 0:
        return  # already completed: count it once
    await conn.execute(update(sessions).where(sessions.c.session_id == e.session_id).values(
        completed=sessions.c.completed + 1, last_instance=e.instance_id,
        last_seen_at=func.greatest(sessions.c.last_seen_at, ts(e.completed_at)),
    ))
    await conn.execute(update(lease_decisions).where(lease_decisions.c.call_id == e.call_id).values(
        outcome="completed", ttft_s=e.ttft_s, kv_source=e.kv_source, completed_at=ts(e.completed_at),
    ))


async def _failed(conn, e: CallFailed) -> None:
    outcome = "cancelled" if e.status == CANCELLED_STATUS else "failed"
    values = dict(outcome=outcome, error=e.reason, failed_stage=e.stage, status=e.status,
                  completed_at=ts(e.at))
    if e.instance_id:
        values["instance_id"] = e.instance_id
    if e.call_index is not None:
        values["call_index"] = e.call_index
    result = await conn.execute(update(calls).where(calls.c.call_id == e.call_id)
                                .where(calls.c.outcome.notin_(FINAL)).values(**values))
    if result.rowcount == 0:  # failed before its submission was projected: still recorded
        result = await conn.execute(insert(calls).values(
            call_id=e.call_id, session_id=e.session_id, model=e.model, submitted_at=ts(e.at), **values
        ).on_conflict_do_nothing())
    if result.rowcount:
        await conn.execute(insert(sessions).values(
            session_id=e.session_id, first_seen_at=ts(e.at), last_seen_at=ts(e.at), calls=0, failed=1,
            last_model=e.model, trace_id=trace_id_hex(session_trace_id(e.session_id)),
        ).on_conflict_do_update(index_elements=[sessions.c.session_id],
                                set_={"failed": sessions.c.failed + 1}))
    await conn.execute(update(lease_decisions).where(lease_decisions.c.call_id == e.call_id)
                       .values(outcome=outcome, completed_at=ts(e.at)))


async def _decision(conn, e: RoutingDecision) -> None:
    candidates = [
        {f: getattr(c, f) for f in c.__struct_fields__} for c in e.candidates
    ]
    await conn.execute(insert(lease_decisions).values(
        call_id=e.call_id, session_id=e.session_id, call_index=e.call_index, model=e.model, policy=e.policy,
        action=e.action, decided_at=ts(e.decided_at), chosen_instance=e.chosen, lease_outcome=e.lease_outcome,
        lease_instance=e.lease_instance, discard_reason=e.discard_reason, candidates=candidates,
        retry_after_s=e.retry_after_s, decision_us=e.decision_us, model_opened=e.model_opened,
        avoidable_cold_open=e.avoidable_cold_open,
    ).on_conflict_do_nothing())


async def _lease(conn, e, seq: int) -> None:
    kind = {LeaseIssued: "issued", LeaseConsumed: "consumed", LeaseDiscarded: "discarded",
            LeaseExpired: "expired"}[type(e)]
    at = getattr(e, "issued_at", None) or getattr(e, "at")
    await conn.execute(insert(lease_events).values(
        seq=seq, kind=kind, session_id=e.session_id, model=e.model, instance_id=e.instance_id,
        call_id=getattr(e, "call_id", None), reason=getattr(e, "reason", None), at=ts(at),
        expires_at=ts(getattr(e, "expires_at", None)),
    ).on_conflict_do_nothing())
