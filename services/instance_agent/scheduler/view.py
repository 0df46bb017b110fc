"""Telemetry snapshot of a scheduler (maps onto `talaria.shared.snapshots.InstanceSnapshot`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from talaria.services.instance_agent.scheduler.types import Decode, Prefill, SchedulerView, SwitchModel

if TYPE_CHECKING:
    from talaria.services.instance_agent.scheduler.scheduler import RoundScheduler


def build_view(sched: RoundScheduler, now: float) -> SchedulerView:
    rnd, calls = sched.round, sched.calls
    return SchedulerView(
        pool=sched.config.pool,
        active_model=sched.device_model,
        slot_model=sched.slot.model if sched.slot else None,
        phase=phase(sched),
        round_index=rnd.index if rnd is not None else sched.rounds_done,
        round_remaining_s=round_remaining_s(sched, now),
        queued={m: len(q) for m, q in calls.queued.items()},
        running={m: len(r) for m, r in calls.running.items()},
        queued_tokens=sched.prefill_ahead_tokens(),
        kv_used_bytes=sum(sched.kv_used(m) for m in sched.models),
        deadline_risk=sched.deadline_risk,
        sp_admitted=sched.sp_admitted,
        sp_parked=sched.sp_parked,
        switch_s=next_switch_s(sched),
    )


def round_remaining_s(sched: RoundScheduler, now: float) -> float:
    """Predicted time left in the current round (0 between rounds)."""
    rnd = sched.round
    return max(0.0, rnd.started_at + rnd.predicted_s - now) if rnd is not None else 0.0


def phase(sched: RoundScheduler) -> str:
    """idle | switch | P | SP | D1 | D | Dfin (no SP opportunity left: final decode or drain)."""
    inflight, slot = sched.inflight, sched.slot
    if inflight is not None:
        match inflight:
            case SwitchModel():
                return "switch"
            case Prefill(session_prefill=sp):
                return "SP" if sp else "P"
            case Decode():
                # decode_left counts this decode until it completes
                return "Dfin" if slot is not None and slot.decode_left <= 1 else "D"
    if slot is None:
        return "idle"
    if not slot.p_done:
        return "P"
    return "D1" if slot.decodes == 0 else "D"


def next_switch_s(sched: RoundScheduler) -> float:
    """Estimate of the next switch away from the device model (0 for a hot pool)."""
    if sched.config.pool == "hot":
        return 0.0
    current = sched.device_model
    nxt = next((m for m in sched.rotation(current) if m != current), None)
    if nxt is None:
        return 0.0
    return sched.costs.switch_s(current, nxt, sched.config.staging)
