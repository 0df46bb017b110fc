"""`RoundScheduler`: the instance's round scheduler with session-prefill (paper §3.2, §3.4).

Pure: every method takes `now`; nothing here reads a clock, sleeps or touches an engine.
The driver alternates `next_action(now)` with the matching `on_*_done(...)`; `submit`
and `abort` may come at any time, including while an action is executing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from talaria.services.instance_agent.scheduler.calls import AgentCall, CallTable, check_routed
from talaria.services.instance_agent.scheduler.chunked_prefill import PrefillPlanner
from talaria.services.instance_agent.scheduler.cold_pool import ColdPool
from talaria.services.instance_agent.scheduler.config import ConfigReader, SchedulerConfig, SharedConfig
from talaria.services.instance_agent.scheduler.costs import CalibratedCosts, StepCostModel, call_kv_bytes, charged_kv
from talaria.services.instance_agent.scheduler.types import (
    ActionMismatchError,
    ConfigError,
    InvalidWorkError,
    SchedulerBusyError,
    UnknownCallError,
    ModelNotServedError,
)
from talaria.services.instance_agent.scheduler.hot_pool import HotPool
from talaria.services.instance_agent.scheduler.prefill_curve import PrefillCurve
from talaria.services.instance_agent.scheduler.reports import Reports
from talaria.services.instance_agent.scheduler.cold_pool import Rotation
from talaria.services.instance_agent.scheduler.types import (
    Action,
    Decode,
    Idle,
    KvState,
    Prefill,
    SchedulerEvent,
    SchedulerView,
    SwitchModel,
)
from talaria.services.instance_agent.scheduler.work_costs import WorkPricing, compute_tokens


@dataclass(frozen=True)
class _Inflight:
    action: Action
    issued_at: float
    predicted_s: float


class RoundScheduler(ConfigReader):
    """Orders the work of one instance. It never changes what a call computes, only when.

    The driver API and the bookkeeping of actions in flight live here. It is composed of
    parts, each handed its collaborators: the pricing of work (work_costs.py), prefill
    actions and chunk sizing (chunked_prefill.py), the model rotation (cold_pool.py) and the
    pool policy, the cold pool's rounds and slots (cold_pool.py) or the hot pool
    (hot_pool.py)."""

    def __init__(self, config: SchedulerConfig, models: Sequence[str], costs: StepCostModel,
                 calls: CallTable | None = None) -> None:
        """`calls`: the table it schedules from and submits into (the agent's, AgentCore.calls);
        default a table of its own, which keeps every call submitted (a driver on its own)."""
        _check_models(config, tuple(models))
        self.shared = SharedConfig(config)
        self.models = tuple(models)
        self.costs = costs if isinstance(costs, CalibratedCosts) else CalibratedCosts(costs, config.ewma_alpha)
        self.calls = CallTable(self.models) if calls is None else calls
        self.reports = Reports()
        self.device_model = config.pinned_model if config.pool == "hot" else config.initial_model
        self._inflight: _Inflight | None = None
        self.pricing = WorkPricing(self.calls, self.costs, self.shared)
        self.curve = PrefillCurve()  # how prefill cost grows with context, from the chunks run
        self.prefill = PrefillPlanner(self.calls, self.costs, self.shared, self.pricing, self.curve)
        self.rotations = Rotation(self.models, self.calls)
        self.cold = ColdPool(self.shared, self.calls, self.reports, self.pricing, self.prefill, self.rotations)
        self.hot = HotPool(self.shared, self.calls, self.pricing, self.prefill)
        self.repinned = False  # the router changed what this instance keeps resident (repin)
        self._pending_pin: tuple[str | None] | None = None  # a repin waiting for the hot batch to finish

    # The cold pool's round and slot in progress (None on a hot instance), for readers.
    slot = property(lambda self: self.cold.slot)
    round = property(lambda self: self.cold.round)
    rounds_done = property(lambda self: self.cold.rounds_done)

    # ---- the router's hot-pool decision (services/router/hot_pools.py) ------------------

    def repin(self, model: str | None) -> None:
        """Keep `model` resident from now on (a hot instance of it), or none (cold pool).

        Calls of other models already here (routed before the router's decision reached
        this instance) are still served: the hot pool first finishes the calls it is
        running (its batches have no slot to close); then, until the other models' calls
        are done and the pinned model is on the device, the cold pool's rounds run (they
        switch to the pinned model when its calls arrive); after that, the hot pool's plain
        continuous batching. Nothing is refused or lost by a repin."""
        if model is not None and model not in self.models:
            raise ConfigError("pinned_model", f"{model!r} is not in {self.models}")
        self.repinned = True
        self._pending_pin = (model,)
        self._apply_pin()

    @property
    def pin_target(self) -> str | None:
        """The model this instance keeps resident, a repin still pending included."""
        if self._pending_pin is not None:
            return self._pending_pin[0]
        return self.config.pinned_model if self.config.pool == "hot" else None

    def _apply_pin(self) -> None:
        if self._pending_pin is None or self._inflight is not None:
            return  # (an action in flight completes under the config it was issued with)
        if self.config.pool == "hot" and self.device_model and self.calls.running[self.device_model]:
            return  # the hot pool's running batch finishes first
        model = self._pending_pin[0]
        self._pending_pin = None
        self.shared.value = replace(self.config, pool="hot" if model else "cold", pinned_model=model)

    def _hot_now(self) -> bool:
        """The hot pool's rule applies: pinned, its model on the device, no other model's
        call left here (after a repin, the cold pool finishes those first)."""
        self._apply_pin()
        if self.config.pool != "hot":
            return False
        if not self.repinned or self._pending_pin is not None:
            return True
        pinned = self.config.pinned_model
        return self.device_model == pinned and not self.calls.any_active_except(pinned) and self.slot is None

    # ---- driver API -------------------------------------------------------------------

    def submit(self, call: AgentCall, now: float) -> None:
        """Accept a call routed here: its record joins the table, queued. Raises for work it
        cannot price, a model not served or a call it holds already."""
        check_routed(call)
        if self.config.pool == "hot" and call.model != self.config.pinned_model and not self.repinned:
            raise ModelNotServedError(call.model, (self.config.pinned_model,))
        budget = self.config.kv_budget_bytes
        if budget is not None and call_kv_bytes(self.costs, call) > budget:
            raise InvalidWorkError(call.call_id, f"needs more KV than the whole budget ({budget} B)")
        self.calls.add(call)

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
        if self._hot_now():
            action = self.hot.next_action(now, max_decode_steps)
        else:
            action = self.cold.next_action(now, self.device_model, max_decode_steps)
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
            predicted = sum(self.pricing.left_cost(c, max(1, c.prefill_left - prompt_left.get(c.call_id, 0)))
                            for c in known)
        self.costs.observe("prefill", action.model, predicted, now - flight.issued_at)
        self._observe_curve(action, known, now - flight.issued_at, firsts, prompt_left)
        for call in known:  # a chunked prefill ended: how long it took, against its price
            if call.first_chunk_at is not None and (firsts is None or call.call_id in firsts):
                fresh = compute_tokens(call, self.config.hkvr)
                self.curve.prefilled(action.model, fresh, call.prompt_tokens - fresh, now - call.first_chunk_at)
        continuation = bool(known) and all(c.first_chunk_at is not None for c in known)
        # The driver ended the chunk early: a call arrived, so protected decode ends here and
        # a contended slot closes (the next slot's P admits the newcomer).
        yielded = prompt_left is not None and action.chunk_tokens > 0 and any(
            prompt_left.get(c.call_id, 0) > max(0, c.prefill_left - action.chunk_tokens) for c in known)
        # Every call of the model still prefilling, in this chunk or waiting beside it.
        filling = {id(c): c for c in self.calls.running.get(action.model, ()) if c.prefilling}
        filling = list({**filling, **{id(c): c for c in known}}.values())
        left_before = [c.prefill_left for c in filling]
        for call in known:
            if call.first_chunk_at is None:  # admitted by this prefill
                call.first_chunk_at = flight.issued_at
                kv = charged_kv(call, self.config.hkvr)
                self.reports.admitted(call, kv, flight.issued_at, self.cold.round, now)
            if firsts is None or call.call_id in firsts:
                call.generated = 1
                call.prefill_left = 0
            elif prompt_left is not None and call.call_id in prompt_left:
                call.prefill_left = max(1, prompt_left[call.call_id])
            elif action.chunk_tokens:
                call.prefill_left = max(1, call.prefill_left - action.chunk_tokens)
        for call, before in zip(filling, left_before):
            if call.prefilling and call.prefill_left == before:  # it waited behind another's chunk
                call.paced_from = (now, call.prefill_left)
        self.cold.prefill_done(action, now, yielded, continuation, flight.predicted_s)
        self.hot.last = "C" if continuation else "P"
        self._finish(action.call_ids, done, now)
        return self.drain_events()

    def _observe_curve(self, action: Prefill, known: list[AgentCall], took: float,
                       firsts: frozenset | None, prompt_left: Mapping[str, int] | None) -> None:
        """Fold a chunk of one call prefilled in several (prefill_curve.py): before the call's
        bookkeeping moves on, its context is what the chunk attended over."""
        if len(known) != 1 or not action.chunk_tokens:
            return
        call = known[0]
        done = firsts is None or call.call_id in firsts
        if done and call.first_chunk_at is None:
            return  # the whole prompt in one chunk: no context spread to learn from
        before = call.prefill_left or call.prompt_tokens
        after = 0 if done else (prompt_left[call.call_id] if prompt_left and call.call_id in prompt_left
                                 else max(1, before - action.chunk_tokens))
        self.curve.observe(action.model, before - after, call.prompt_tokens - before, took)

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
        predicted = flight.predicted_s if ran == action.steps else self.pricing.decode_s(action, ran)
        self.costs.observe("decode", action.model, predicted, now - flight.issued_at)
        waiting = frozenset(stalled)
        for call in self._known(action.call_ids):
            if call.call_id not in waiting:
                call.generated += ran
        self.cold.decode_done(ran, now)
        self.hot.last = "D"
        self._finish(action.call_ids, done, now)
        return self.drain_events()

    def on_switch_done(self, action: SwitchModel, now: float, measured_s: float | None = None) -> list[SchedulerEvent]:
        """The device now serves `action.to_model`; `measured_s` defaults to the wall time."""
        flight = self._complete(action)
        took = now - flight.issued_at if measured_s is None else measured_s
        self.costs.observe_switch(action.from_model, action.to_model, action.staged, took)
        self.device_model = action.to_model
        self.cold.switch_done(took)
        return self.drain_events()

    def on_action_failed(self, action: Action, now: float) -> list[SchedulerEvent]:
        """The executor could not run `action` (it aborts the calls it fails): the action is no
        longer in flight and the device is unchanged; a failed switch is chosen afresh."""
        self._complete(action)
        if isinstance(action, SwitchModel):
            self.cold.switch_failed()
        return self.drain_events()

    def abort(self, call_id: str, now: float) -> list[SchedulerEvent]:
        """Forget a call (client gone, engine failure). Safe while it is in flight."""
        call = self.calls.held(call_id)
        self.calls.remove(call)
        self.reports.finished(call, "aborted", now)
        return self.drain_events()

    def update_kv(self, session_id: str, model: str, kv_state: KvState, reusable_tokens: int | None = None) -> int:
        """The engine moved a session's prefix (e.g. device -> host on a switch)."""
        return self.calls.update_kv(session_id, model, kv_state, reusable_tokens)

    def drain_events(self) -> list[SchedulerEvent]:
        """Events raised so far (also returned by every on_*_done); call it after an Idle."""
        return self.reports.drain()

    def estimate_s(self, action: Action) -> float:
        """Predicted duration of `action` under the current (calibrated) costs."""
        match action:
            case Prefill(call_ids=ids, chunk_tokens=chunk) if chunk > 0:
                return sum(self.prefill.chunk_cost(c, chunk) for c in self._known(ids))
            case Prefill(call_ids=ids):
                return sum(self.pricing.cost(c) if c.first_chunk_at is None
                           else self.pricing.left_cost(c, c.prefill_left) for c in self._known(ids))
            case Decode():
                return self.pricing.decode_s(action, action.steps)
            case SwitchModel(from_model=a, to_model=b, staged=staged):
                return self.costs.switch_s(a, b, staged)
        return 0.0

    # ---- telemetry view (maps onto `talaria.shared.snapshots.InstanceSnapshot`) -------------

    def snapshot(self, now: float) -> SchedulerView:
        rnd, calls = self.round, self.calls
        return SchedulerView(
            pool=self.config.pool,
            active_model=self.device_model,
            slot_model=self.slot.model if self.slot else None,
            phase=self.phase(),
            round_index=rnd.index if rnd is not None else self.rounds_done,
            round_remaining_s=self.round_remaining_s(now),
            queued={m: len(q) for m, q in calls.queued.items()},
            running={m: len(r) for m, r in calls.running.items()},
            queued_tokens=self.prefill_ahead_tokens(),
            kv_used_bytes=sum(self.pricing.kv_used(m) for m in self.models),
            deadline_risk=self.deadline_risk,
            sp_admitted=self.sp_admitted,
            sp_parked=self.sp_parked,
            switch_s=self.next_switch_s(),
        )

    def round_remaining_s(self, now: float) -> float:
        """Predicted time left in the current round (0 between rounds)."""
        return self.cold.round_remaining_s(now)

    def prefill_ahead_tokens(self) -> int:
        """Prompt tokens a call arriving now waits behind (chunked_prefill.py)."""
        return self.prefill.prefill_ahead_tokens(self.cold.slot)

    def prefill_ahead_s(self) -> float:
        """The same work in predicted seconds (chunked_prefill.py)."""
        return self.prefill.prefill_ahead_s(self.cold.slot)

    def prefill_left_s(self) -> float:
        """The rest of the prefill under way, past its first chunk (chunked_prefill.py)."""
        return self.prefill.prefill_left_s(self.cold.slot)

    def kv_used(self, model: str) -> int:
        return self.pricing.kv_used(model)

    def phase(self) -> str:
        """idle | switch | P | SP | D1 | D | Dfin (no SP opportunity left: final decode or drain)."""
        inflight, slot = self.inflight, self.slot
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

    def next_switch_s(self) -> float:
        """Estimate of the next switch away from the device model (0 for a hot pool)."""
        if self.config.pool == "hot":
            return 0.0
        current = self.device_model
        nxt = next((m for m in self.rotation(current) if m != current), None)
        if nxt is None:
            return 0.0
        return self.costs.switch_s(current, nxt, self.config.staging)

    def generated(self, call_id: str) -> int:
        """Tokens the scheduler has counted for a live call."""
        return self.calls.held(call_id).generated

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
        return self.rotations.rotation(after)

    def active_in_rotation(self, after: str | None) -> list[str]:
        """`rotation(after)` restricted to models with a queued or running call."""
        return self.rotations.active_in_rotation(after)

    # ---- shared helpers ---------------------------------------------------------------

    def _finish(self, ids: tuple[str, ...], engine_done: frozenset[str], now: float) -> None:
        for call in list(self._known(ids)):
            if call.done_by_length or call.call_id in engine_done:
                self.calls.remove(call)
                self.reports.finished(call, "length" if call.done_by_length else "engine", now)

    def _complete(self, action: Action) -> _Inflight:
        flight = self._inflight
        if flight is None or flight.action != action:
            raise ActionMismatchError(flight.action if flight else None, action)
        self._inflight = None
        return flight

    def _known(self, ids: Iterable[str]) -> Iterable[AgentCall]:
        # Calls aborted while their step was in flight are skipped.
        return (c for c in map(self.calls.holding, ids) if c is not None)


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
