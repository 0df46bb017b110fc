"""`RoundScheduler`: the instance's round scheduler with session-prefill (paper §3.2, §3.4).

Pure: every method takes `now`; nothing here reads a clock, sleeps or touches an engine.
The driver alternates `next_action(now)` with the matching `on_*_done(...)`; `submit`
and `abort` may come at any time, including while an action is executing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from talaria.services.instance_agent.scheduler.admission import Selection
from talaria.services.instance_agent.scheduler.calls import CallState, CallTable
from talaria.services.instance_agent.scheduler.chunked_prefill import ChunkedPrefill
from talaria.services.instance_agent.scheduler.cold_pool import ColdPool
from talaria.services.instance_agent.scheduler.config import SchedulerConfig
from talaria.services.instance_agent.scheduler.costs import CalibratedCosts, StepCostModel, call_kv_bytes, charged_kv
from talaria.services.instance_agent.scheduler.errors import (
    ActionMismatchError,
    ConfigError,
    InvalidWorkError,
    SchedulerBusyError,
    UnknownCallError,
    ModelNotServedError,
)
from talaria.services.instance_agent.scheduler.hot_pool import HotPool
from talaria.services.instance_agent.scheduler.reports import Reports
from talaria.services.instance_agent.scheduler.rounds import RoundState, Slot
from talaria.services.instance_agent.scheduler.types import (
    Action,
    Decode,
    Idle,
    KvState,
    Prefill,
    SchedulerEvent,
    SchedulerView,
    SwitchModel,
    Work,
)
from talaria.services.instance_agent.scheduler.view import build_view
from talaria.services.instance_agent.scheduler.work_costs import WorkCosts, compute_tokens


@dataclass(frozen=True)
class _Inflight:
    action: Action
    issued_at: float
    predicted_s: float


class RoundScheduler(ColdPool, HotPool, ChunkedPrefill, WorkCosts):
    """Orders the work of one instance. It never changes what a call computes, only when.

    The driver API and the bookkeeping of actions in flight live here; the pool policies
    (cold_pool.py, hot_pool.py), chunk sizing (chunked_prefill.py) and the pricing of work
    (work_costs.py) are mixins over the same state."""

    def __init__(self, config: SchedulerConfig, models: Sequence[str], costs: StepCostModel) -> None:
        _check_models(config, tuple(models))
        self.config = config
        self.models = tuple(models)
        self.costs = costs if isinstance(costs, CalibratedCosts) else CalibratedCosts(costs, config.ewma_alpha)
        self.calls = CallTable(self.models)
        self.reports = Reports()
        self.device_model = config.pinned_model if config.pool == "hot" else config.initial_model
        self.slot: Slot | None = None
        self.round: RoundState | None = None
        self.rounds_done = 0
        self._target: str | None = None  # model the in-flight or next switch opens
        self._inflight: _Inflight | None = None
        self._hot_last = ""
        self._max_steps = 1  # decode steps the current next_action call may hand out
        self._rotations: dict[str | None, tuple[str, ...]] = {}  # rotation() by `after`, memoised

    # ---- driver API -------------------------------------------------------------------

    def submit(self, work: Work, now: float) -> None:
        """Accept a call routed here. Raises for a model not served or a call seen before."""
        if self.config.pool == "hot" and work.model != self.config.pinned_model:
            raise ModelNotServedError(work.model, (self.config.pinned_model,))
        budget = self.config.kv_budget_bytes
        if budget is not None and call_kv_bytes(self.costs, work) > budget:
            raise InvalidWorkError(work.call_id, f"needs more KV than the whole budget ({budget} B)")
        self.calls.add(work, now)

    def next_action(self, now: float, max_decode_steps: int = 1) -> Action:
        """What the executor should do next. Every non-Idle action must be reported done.

        `max_decode_steps` > 1 lets a Decode cover several iterations (`Decode.steps`),
        cut at the next boundary the scheduler would act on, so the result equals that
        many single-step Decodes (a simulator uses it to advance many tokens per event).
        """
        if self._inflight is not None:
            raise SchedulerBusyError(self._inflight.action)
        if max_decode_steps < 1:
            raise ValueError(f"max_decode_steps={max_decode_steps} < 1")
        self._max_steps = max_decode_steps
        action = self._next_hot(now) if self.config.pool == "hot" else self._next_cold(now)
        if not isinstance(action, Idle):
            self._inflight = _Inflight(action, now, self.estimate_s(action))
        return action

    def on_prefill_done(
        self, action: Prefill, now: float, finished: Iterable[str] = (), first_tokens: Iterable[str] | None = None,
        prompt_left: Mapping[str, int] | None = None,
    ) -> list[SchedulerEvent]:
        """The prefill ran. `first_tokens`: the calls whose prompt is now complete (they have
        their first token); default all of them. With chunked prefill the others continue
        in a later Prefill; `prompt_left` says how many prompt tokens each has left (a
        driver may end a chunk early), default the chunk's worth fewer. `finished`: calls
        that hit EOS/stop."""
        done = _finished_in(action, finished)
        flight = self._complete(action)
        firsts = None if first_tokens is None else frozenset(first_tokens)
        known = list(self._known(action.call_ids))
        predicted = flight.predicted_s
        if prompt_left is not None and action.chunk_tokens:
            # Calibrate on the work that ran, not on the chunk that was asked for.
            predicted = sum(self._left_cost(c, max(1, c.prefill_left - prompt_left.get(c.call_id, 0)))
                            for c in known)
        self.costs.observe("prefill", action.model, predicted, now - flight.issued_at)
        continuation = bool(known) and all(c.first_chunk_at is not None for c in known)
        # The driver ended the chunk early: a call arrived, so protected decode ends here and
        # a contended slot closes (the next slot's P admits the newcomer).
        yielded = prompt_left is not None and action.chunk_tokens > 0 and any(
            prompt_left.get(c.call_id, 0) > max(0, c.prefill_left - action.chunk_tokens) for c in known)
        for call in known:
            if call.first_chunk_at is None:  # admitted by this prefill
                call.first_chunk_at = flight.issued_at
                kv = charged_kv(call.work, self.config.hkvr)
                self.reports.admitted(call, kv, flight.issued_at, self.round, now)
            if firsts is None or call.call_id in firsts:
                call.generated = 1
                call.prefill_left = 0
            elif prompt_left is not None and call.call_id in prompt_left:
                call.prefill_left = max(1, prompt_left[call.call_id])
            elif action.chunk_tokens:
                call.prefill_left = max(1, call.prefill_left - action.chunk_tokens)
        slot = self.slot
        if slot is not None and yielded:
            slot.protected = min(slot.protected, slot.decodes)
            slot.deadline = min(slot.deadline, now)
            slot.last = "C"
        elif slot is not None:
            if continuation:
                # A chunk spends decode time: it counts as the decode steps it displaces, so
                # protected decode runs out (and a contended slot closes) at the same pace.
                slot.last = "C"
                step = slot.plan.decode_step_s
                slot.decodes += max(1, math.ceil(flight.predicted_s / step - 1e-9)) if step > 0 else 1
            else:
                slot.last = "SP" if action.session_prefill else "P"
        self._hot_last = "C" if continuation else "P"
        self._finish(action.call_ids, done, now)
        return self.drain_events()

    def on_decode_done(
        self, action: Decode, now: float, finished: Iterable[str] = (), steps: int | None = None,
        stalled: Iterable[str] = (),
    ) -> list[SchedulerEvent]:
        """`steps` decode iterations ran (default: all of `action.steps`; fewer when the
        driver stopped early). `finished`: calls that hit EOS/stop in the last step.
        `stalled`: calls the engine could not step (no KV page for their next token yet):
        they generated nothing and decode again in a later step."""
        ran = action.steps if steps is None else steps
        if not 1 <= ran <= action.steps:
            raise ValueError(f"steps={steps} not in [1, {action.steps}]")
        done = _finished_in(action, finished)
        flight = self._complete(action)
        predicted = flight.predicted_s if ran == action.steps else self._decode_s(action, ran)
        self.costs.observe("decode", action.model, predicted, now - flight.issued_at)
        waiting = frozenset(stalled)
        for call in self._known(action.call_ids):
            if call.call_id not in waiting:
                call.generated += ran
        slot = self.slot
        if slot is not None:
            slot.decodes += ran
            if slot.free_run:
                slot.free_run = False
                if not slot.extended and slot.decodes > slot.protected:
                    self._extend(slot, now)
            self.slot.last = "D"
        self._hot_last = "D"
        self._finish(action.call_ids, done, now)
        return self.drain_events()

    def on_switch_done(self, action: SwitchModel, now: float, measured_s: float | None = None) -> list[SchedulerEvent]:
        """The device now serves `action.to_model`; `measured_s` defaults to the wall time."""
        flight = self._complete(action)
        took = now - flight.issued_at if measured_s is None else measured_s
        self.costs.observe_switch(action.from_model, action.to_model, action.staged, took)
        self.device_model = action.to_model
        if self.round is not None:
            self.round.switch_s += took
        return self.drain_events()

    def on_action_failed(self, action: Action, now: float) -> list[SchedulerEvent]:
        """The executor could not run `action` (it aborts the calls it fails): the action is no
        longer in flight and the device is unchanged; a failed switch is chosen afresh."""
        self._complete(action)
        if isinstance(action, SwitchModel):
            self._target = None
        return self.drain_events()

    def abort(self, call_id: str, now: float) -> list[SchedulerEvent]:
        """Forget a call (client gone, engine failure). Safe while it is in flight."""
        call = self.calls.get(call_id)
        self.calls.remove(call_id)
        self.reports.finished(call, "aborted", now)
        return self.drain_events()

    def update_kv(self, session_id: str, model: str, kv_state: KvState, reusable_tokens: int | None = None) -> int:
        """The engine moved a session's prefix (e.g. device -> host on a switch)."""
        return self.calls.update_kv(session_id, model, kv_state, reusable_tokens)

    def observe_cost(self, kind: str, model: str, predicted_s: float, measured_s: float) -> None:
        """Fold an externally measured step into the EWMA cost correction."""
        self.costs.observe(kind, model, predicted_s, measured_s)

    def drain_events(self) -> list[SchedulerEvent]:
        """Events raised so far (also returned by every on_*_done); call it after an Idle."""
        return self.reports.drain()

    def estimate_s(self, action: Action) -> float:
        """Predicted duration of `action` under the current (calibrated) costs."""
        match action:
            case Prefill(call_ids=ids, chunk_tokens=chunk) if chunk > 0:
                return sum(self._chunk_cost(c, chunk) for c in self._known(ids))
            case Prefill(call_ids=ids):
                return sum(self._cost(c) if c.first_chunk_at is None else self._left_cost(c, c.prefill_left)
                           for c in self._known(ids))
            case Decode():
                return self._decode_s(action, action.steps)
            case SwitchModel(from_model=a, to_model=b, staged=staged):
                return self.costs.switch_s(a, b, staged)
        return 0.0

    def snapshot(self, now: float) -> SchedulerView:
        return build_view(self, now)

    def generated(self, call_id: str) -> int:
        """Tokens the scheduler has counted for a live call."""
        return self.calls.get(call_id).generated

    @property
    def inflight(self) -> Action | None:
        return self._inflight.action if self._inflight else None

    @property
    def sp_admitted(self) -> int:
        return self.reports.sp_admitted

    @property
    def sp_parked(self) -> int:
        return self.reports.sp_parked

    @property
    def deadline_risk(self) -> int:
        return self.reports.deadline_risk

    def rotation(self, after: str | None) -> list[str]:
        """All models in cyclic order, starting after `after` and ending with it."""
        return list(self._rotation(after))

    def _rotation(self, after: str | None) -> tuple[str, ...]:
        rot = self._rotations.get(after)
        if rot is None:
            if after is None:
                rot = self.models
            else:
                i = self.models.index(after)
                rot = self.models[i + 1 :] + self.models[: i + 1]
            self._rotations[after] = rot
        return rot

    def active_in_rotation(self, after: str | None) -> list[str]:
        """`rotation(after)` restricted to models with a queued or running call."""
        calls = self.calls
        if not calls._n_active:
            return []
        live = calls._live
        return [m for m in self._rotation(after) if live[m]]

    # ---- shared helpers ---------------------------------------------------------------

    def _start_prefill(self, selection: Selection, via: str, model: str, now: float) -> Prefill:
        for call in selection.admitted:
            self.calls.start(call.call_id, via, now)
            call.prefill_left = compute_tokens(call.work, self.config.hkvr)
        chunk, per_pass = self._chunk_for(model, selection.admitted)
        return Prefill(selection.ids, session_prefill=via == "SP", model=model, chunk_tokens=chunk,
                       pass_tokens=per_pass)

    def _finish(self, ids: tuple[str, ...], engine_done: frozenset[str], now: float) -> None:
        for call in list(self._known(ids)):
            if call.done_by_length or call.call_id in engine_done:
                self.calls.remove(call.call_id)
                self.reports.finished(call, "length" if call.done_by_length else "engine", now)

    def _complete(self, action: Action) -> _Inflight:
        flight = self._inflight
        if flight is None or flight.action != action:
            raise ActionMismatchError(flight.action if flight else None, action)
        self._inflight = None
        return flight

    def _known(self, ids: Iterable[str]) -> Iterable[CallState]:
        # Calls aborted while their step was in flight are skipped.
        return (self.calls.get(i) for i in ids if i in self.calls)


def _finished_in(action: Prefill | Decode, finished: Iterable[str]) -> frozenset[str]:
    done = frozenset(finished)
    stray = done - set(action.call_ids)
    if stray:
        raise UnknownCallError(sorted(stray)[0], f"in the completed action {action!r}")
    return done


def _check_models(config: SchedulerConfig, models: tuple[str, ...]) -> None:
    if not models:
        raise ConfigError("models", "an instance serves at least one model")
    if len(set(models)) != len(models):
        raise ConfigError("models", f"duplicates in {models}")
    if config.pool == "hot" and config.pinned_model not in models:
        raise ConfigError("pinned_model", f"{config.pinned_model!r} is not in {models}")
    if config.initial_model is not None and config.initial_model not in models:
        raise ConfigError("initial_model", f"{config.initial_model!r} is not in {models}")
