"""AgentCore: the instance agent's pure core, driven by two executors.

The live `CallRunner` (runner.py, torch engine on the wall clock) and the simulator's
`SimExecutor` (talaria/sim/executor.py, a cost profile on a virtual clock) drive the same
core: it keeps the agent's one call table, turns routed calls into scheduler work and
scheduler events into the wire's records, and builds the snapshot. It reads no clock and
touches no engine, bus or profile, so both publish the same records for the same schedule.
The loop and a call's phases are `AgentCore`'s docstring.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from talaria.services.instance_agent.scheduler.calls import LIVE, AgentCall, CallTable, Phase
from talaria.services.instance_agent.scheduler import (
    CallAdmitted,
    CallFinished,
    CallParked,
    StepCostModel,
    Decode,
    DeadlineRisk,
    KvState,
    Prefill,
    RoundEnded,
    RoundScheduler,
    SchedulerConfig,
    SwitchModel,
)
from talaria.shared.events import CallCompleted, RoundSummary, SwitchDone
from talaria.shared.snapshots import InstanceSnapshot, ModelResidency, SessionKv

if TYPE_CHECKING:  # the live executor's part of a call; the core only carries it
    from talaria.services.instance_agent.call_transport import CallTransport


@dataclass(slots=True)
class StepReport:
    """What one completed action (or a drain) means for the outside world."""

    finished: list[str] = field(default_factory=list)  # calls done (not aborted): release, then complete
    rounds: list[RoundSummary] = field(default_factory=list)
    switch: SwitchDone | None = None
    notes: list[CallParked | DeadlineRisk] = field(default_factory=list)

    def merge(self, more: "StepReport") -> None:
        self.finished += more.finished
        self.rounds += more.rounds
        self.notes += more.notes


class AgentCore:
    """Routed calls in, scheduler work out; scheduler events in, wire records out.

        routed call ──accept──▶ AgentCall (its one record) ──▶ RoundScheduler.submit
        executor loop: action = core.next_action(now)
                       runs it (torch engine on the wall clock | cost profile on a virtual clock)
                       core.switch_done / prefill_done / decode_done(action, now, ...) → StepReport
        StepReport: calls finished (executor releases them, then core.completed → CallCompleted),
                 RoundSummary and SwitchDone messages, notes (CallParked / DeadlineRisk)
        core.snapshot(...) → InstanceSnapshot (the one snapshot builder)

    The core keeps the agent's one table of calls (`calls`, a `CallTable`: an `AgentCall` per call
    id, with its phase and timeline: queue, slot wait, first token, whether its slot began with a
    model switch; the scheduler it builds is handed the same table and keeps its queues in it)
    and the translation of scheduler events into the wire messages. A call's phase is
    the truth about it:

        QUEUED ──prefill issued──▶ RUNNING ──executor closes it──▶ CLOSING ──outcome stored──▶ FINISHED
        (a cancel for a call not here yet: CANCELLED, so the call is refused when it arrives)

    An executor that must answer late copies of a call (the live runner: a redelivered message is
    acked, never run again) keeps ended calls (`keep_ended`); the simulator keeps none. It reads no clock and touches no engine, bus or profile,
    so the live `CallRunner` (services/instance_agent/runner.py) and the simulator's
    `SimExecutor` (talaria/sim/executor.py) publish the same records for the same schedule.
    """

    def __init__(self, instance_id: str, config: SchedulerConfig, models: Sequence[str], costs: StepCostModel,
                 keep_ended: int = 0, attention_ratios: Mapping[str, float] | None = None) -> None:
        """`attention_ratios`: per model, attention's work per token attended over relative to
        a token's linear work (shared/attention_prior.py), the prior of prefill's slope with
        context until the chunks run here establish it; none: no prior (0 until measured)."""
        self.instance_id = instance_id
        self.attention_ratios = dict(attention_ratios or {})
        self.calls = CallTable(tuple(models))  # the one table: every call here by id, any phase
        self.sched = RoundScheduler(config, list(models), costs, self.calls)
        self.keep_ended = keep_ended
        self._ended: deque[str] = deque()  # ended calls kept, oldest first

    # ---- the call table ----------------------------------------------------------------

    def live(self) -> Iterator[AgentCall]:
        """Calls queued or running here."""
        return (c for c in self.calls.values() if c.phase in LIVE)

    def live_call(self, call_id: str) -> AgentCall | None:
        call = self.calls.get(call_id)
        return call if call is not None and call.phase in LIVE else None

    def live_calls(self, call_ids: Iterable[str]) -> tuple[AgentCall, ...]:
        """The records of those of `call_ids` that are queued or running."""
        return tuple(c for c in map(self.live_call, call_ids) if c is not None)

    def record(self, call_id: str, session_id: str, model: str, *, call_index: int, submitted_at: float,
               tenant: str = "", transport: CallTransport | None = None) -> AgentCall:
        """A queued call outside the scheduler (one refused on arrival is closed at once)."""
        call = AgentCall(call_id, session_id, model, call_index, submitted_at, tenant=tenant, transport=transport)
        self.calls[call_id] = call
        return call

    def cancel_early(self, call_id: str, reason: str, tenant: str) -> None:
        """A cancel for a call not here (yet): the call is refused when it arrives."""
        self.calls[call_id] = AgentCall(call_id, "", "", 0, 0.0, tenant=tenant, phase=Phase.CANCELLED,
                                        cancel_reason=reason)
        self._keep(call_id)

    def close(self, call_id: str) -> AgentCall | None:
        """The executor starts publishing a live call's outcome: CLOSING (None: not live)."""
        call = self.live_call(call_id)
        if call is not None:
            call.phase = Phase.CLOSING
        return call

    def reopen(self, call_id: str) -> None:
        """Its outcome could not be published after all: live again (the executor fails it)."""
        call = self.calls.get(call_id)
        if call is not None and call.phase is Phase.CLOSING:
            call.phase = Phase.RUNNING if call.started_at is not None else Phase.QUEUED

    def end(self, call_id: str) -> None:
        """Its outcome is stored: FINISHED, remembered while `keep_ended` allows."""
        call = self.calls.get(call_id)
        if call is None:
            return
        call.phase = Phase.FINISHED
        call.transport = None
        self._keep(call_id)

    def forget(self, call_id: str) -> AgentCall | None:
        """Drop a call from the table (its outcome was not stored: a redelivery runs it again)."""
        return self.calls.pop(call_id, None)

    def _keep(self, call_id: str) -> None:
        self._ended.append(call_id)
        while len(self._ended) > self.keep_ended:
            old = self._ended.popleft()
            call = self.calls.get(old)
            if call is not None and call.phase in (Phase.FINISHED, Phase.CANCELLED):
                del self.calls[old]

    # ---- intake ------------------------------------------------------------------------

    def accept(self, call_id: str, session_id: str, model: str, *, call_index: int, prompt_tokens: int,
               max_tokens: int, submitted_at: float, kv_state: KvState, reusable_tokens: int, now: float,
               arrived_at: float | None = None, tenant: str = "", transport: CallTransport | None = None,
               kv_output_tokens: int = 0) -> AgentCall:
        """Submit a routed call; raises the scheduler's error when it cannot take it.
        `arrived_at` (default `submitted_at`) starts the scheduler's slot wait."""
        call = AgentCall(call_id, session_id, model, call_index, submitted_at, prompt_tokens=max(1, prompt_tokens),
                         reusable_tokens=reusable_tokens, kv_state=kv_state, max_tokens=max_tokens,
                         kv_output_tokens=kv_output_tokens,
                         arrived_at=submitted_at if arrived_at is None else arrived_at, tenant=tenant,
                         transport=transport)
        self.sched.submit(call, now)  # queued in the one table
        return call

    # ---- the executor's side of the loop -----------------------------------------------

    def next_action(self, now: float, max_decode_steps: int = 1):
        action = self.sched.next_action(now, max_decode_steps)
        if isinstance(action, Prefill):
            for call_id in action.call_ids:
                rec = self.live_call(call_id)
                if rec is not None and rec.started_at is None:  # a later chunk does not restart it
                    rec.started_at = now
                    rec.phase = Phase.RUNNING
        return action

    def switch_done(self, action: SwitchModel, now: float, total_s: float, *, path: str,
                    phases: dict[str, float] | None = None, bytes_staged: int = 0,
                    bytes_uncovered: int = 0, clock_measured: bool = False) -> StepReport:
        """The device serves `action.to_model` after `total_s` seconds along `path`. The
        scheduler learns `total_s`, or with `clock_measured` the time since it issued the
        switch (a virtual clock that advanced by exactly the priced time)."""
        for rec in self.live():
            if rec.model == action.to_model:
                rec.opened_model = True
        events = self.sched.on_switch_done(action, now, None if clock_measured else total_s)
        out = self._outcome(events, now)
        out.switch = SwitchDone(
            instance_id=self.instance_id, from_model=action.from_model, to_model=action.to_model, path=path,
            total_s=total_s, at=now, phases=dict(phases or {}), bytes_staged=bytes_staged,
            bytes_uncovered=bytes_uncovered)
        return out

    def prefill_done(self, action: Prefill, now: float, finished: Iterable[str] = (),
                     first_tokens: Iterable[str] | None = None, prompt_left=None) -> StepReport:
        """`first_tokens`: calls whose prompt is complete (default all); with chunked prefill
        the others continue, and `prompt_left` says how much each has left."""
        firsts = None if first_tokens is None else set(first_tokens)
        for call_id in action.call_ids:
            rec = self.live_call(call_id)
            if rec is not None and rec.first_token_at is None and (firsts is None or call_id in firsts):
                rec.first_token_at = now
        events = self.sched.on_prefill_done(action, now, finished, first_tokens=firsts, prompt_left=prompt_left)
        return self._outcome(events, now)

    def decode_done(self, action: Decode, now: float, finished: Iterable[str] = (), steps: int | None = None,
                    stalled: Iterable[str] = ()) -> StepReport:
        return self._outcome(self.sched.on_decode_done(action, now, finished, steps, stalled), now)

    def action_failed(self, action, now: float) -> StepReport:
        """The executor could not run `action` and failed what it had to: the scheduler can
        choose again (without this it would wait for the action forever)."""
        return self._outcome(self.sched.on_action_failed(action, now), now)

    def drain(self, now: float) -> StepReport:
        """Events raised outside an action (after an Idle)."""
        return self._outcome(self.sched.drain_events(), now)

    def abort(self, call_id: str, now: float) -> StepReport:
        """Take a call the executor fails out of the scheduler (which frees its place); the
        executor then closes it. Raises the scheduler's error for a call it does not hold."""
        return self._outcome(self.sched.abort(call_id, now), now)

    def _outcome(self, events, now: float) -> StepReport:
        out = StepReport()
        for event in events:
            match event:
                case CallAdmitted():
                    rec = self.calls.get(event.call_id)
                    if rec is not None:
                        rec.slot_wait_s, rec.via = event.slot_wait_s, event.via
                case CallFinished(reason="aborted"):
                    pass  # failed and reported by whoever aborted it
                case CallFinished():
                    out.finished.append(event.call_id)
                case RoundEnded():
                    out.rounds.append(RoundSummary(
                        instance_id=self.instance_id, round_index=event.round_index, wall_s=event.wall_s,
                        active_s=event.active_s, switch_s=event.switch_s, at=event.at or now,
                        slots=list(event.slots), sp_admitted=event.sp_admitted, sp_parked=event.sp_parked,
                        deadline_risk=event.deadline_risk))
                case CallParked() | DeadlineRisk():
                    out.notes.append(event)
        return out

    # ---- records -----------------------------------------------------------------------

    def completed(self, call_id: str, now: float, *, prompt_tokens: int, output_tokens: int, finish_reason: str,
                  cached_tokens: int = 0, kv_source: str = "none", prefill_s: float = 0.0, decode_s: float = 0.0,
                  trace_id: str = "", migrated_bytes: int = 0, migrate_s: float = 0.0) -> CallCompleted:
        """The completion record of a finished call from what the executor computed for it.
        The executor ends the call (`end`) once the record is stored."""
        rec = self.calls[call_id]
        started = rec.started_at if rec.started_at is not None else now
        first = rec.first_token_at if rec.first_token_at is not None else now
        return CallCompleted(
            call_id=call_id, session_id=rec.session_id, call_index=rec.call_index, model=rec.model,
            instance_id=self.instance_id, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
            finish_reason=finish_reason, submitted_at=rec.submitted_at, started_at=started,
            first_token_at=first, completed_at=now, cached_tokens=cached_tokens,
            kv_source=kv_source, queue_s=started - rec.submitted_at, ttft_s=first - rec.submitted_at,
            prefill_s=prefill_s, decode_s=decode_s, slot_wait_s=rec.slot_wait_s,
            kv_tokens=prompt_tokens + output_tokens, model_opened=rec.opened_model,
            trace_id=trace_id, migrated_bytes=migrated_bytes, migrate_s=migrate_s,
        )

    def prefill_probed(self, model: str, probes: Iterable[tuple[int, int, float]]) -> None:
        """The engine's start-up probe of `model`: passes of (tokens, context, seconds), folded
        into the prefill curve like chunks (the linear rate without a step's fixed cost, and a
        first point of the slope)."""
        self.sched.curve.probed(model, probes)

    def snapshot(self, version: int, now: float, *, pool: str, active_model: str | None,
                 models: list[ModelResidency], sessions: list[SessionKv], memory, heartbeat_s: float) -> InstanceSnapshot:
        """The instance snapshot the router consumes. Queues, round and risk come from the
        scheduler (the fields of `RoundScheduler.snapshot` the router reads, without its per-call KV sum); residency, session KV and `memory` (capacity, use and measured rates, the
        attributes of `engine.contract.EngineStats`) from the executor's device."""
        sched, calls = self.sched, self.calls
        pinned = sched.config.pinned_model if pool == "hot" else None
        rate = 1.0 / memory.prefill_tok_s if memory.prefill_tok_s > 0 else 0.0
        ctx2, measured = sched.curve.slope(active_model, self.attention_ratios.get(active_model or "", 0.0), rate)
        if sched.repinned:  # the router's hot-pool decision replaced the deployed pool
            pinned = sched.pin_target
            pool = "hot" if pinned else "cold"
        return InstanceSnapshot(
            instance_id=self.instance_id, version=version, at=now, pool=pool, pinned_model=pinned, models=models,
            active_model=active_model, sessions=sessions, queued={m: len(q) for m, q in calls.queued.items()},
            # With chunked prefill (the live agent) also the prefill a newcomer waits behind.
            queued_tokens=sched.prefill_ahead_tokens() if sched.config.chunked_prefill
            else sum(c.prompt_tokens for q in calls.queued.values() for c in q),
            queued_prefill_s=sched.prefill_ahead_s(), prefill_left_s=sched.prefill_left_s(),
            running=sum(len(r) for r in calls.running.values()),
            round_remaining_s=sched.round_remaining_s(now),
            deadline_risk=sched.deadline_risk, kv_capacity_tokens=memory.kv_capacity_tokens,
            kv_used_tokens=memory.kv_used_tokens, kv_pinned_tokens=getattr(memory, "kv_pinned_tokens", -1),
            staging_free_bytes=memory.staging_free_bytes,
            hbm_bytes=memory.hbm_bytes, hbm_used_bytes=memory.hbm_used_bytes, prefill_tok_s=memory.prefill_tok_s,
            prefill_ctx_s_per_tok2=ctx2, prefill_ctx_measured=measured,
            prefill_overstatement=sched.curve.overstatement(active_model, rate, ctx2),
            decode_tok_s=memory.decode_tok_s, restore_tok_s=memory.restore_tok_s, switch_s=sched.next_switch_s(),
            migrate_bytes_s=getattr(memory, "migrate_bytes_s", 0.0),
            migrate_setup_s=getattr(memory, "migrate_setup_s", -1.0), heartbeat_s=heartbeat_s,
        )
