"""CallRunner: the live executor of the agent core (core.py) on the torch engine.

    routed call ──accept──▶ AgentCore.accept (→ RoundScheduler.submit)
    loop: action = core.next_action(now)
          SwitchModel → engine.switch_to      → core.switch_done  → SwitchDone event
          Prefill     → engine.prefill(batch) → first tokens (stream), CallStarted
          Decode      → engine.decode(batch)  → next tokens (stream)
          Idle        → core.drain; wait for the next call
    outcome: finished call → engine.finish → core.completed → CallCompleted + reply + ack;
             RoundSummary → event

The simulator's `SimExecutor` (talaria/sim/executor.py) runs the same core on a cost profile.

The scheduler is pure and the engine blocking: engine calls run on the single engine
thread, everything touching NATS stays on the event loop. A call's JetStream message is
acked only once its outcome is published, so a crashed agent's calls are redelivered.

Here: intake, cancels, the work loop, snapshots. The steps are in engine_steps.py, the
outcomes (events, replies, acks) in call_outcomes.py, the drops (deadlines, lost
placements, the watchdog, stray engine entries) in call_drops.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
from opentelemetry import trace

from talaria.services.instance_agent.call_drops import CallDrops
from talaria.services.instance_agent.call_outcomes import FINISHED_MEMORY, CallOutcomes
from talaria.services.instance_agent.core import AgentCore, Outcome
from talaria.services.instance_agent.engine import EngineError
from talaria.services.instance_agent.engine_steps import EngineSteps
from talaria.services.instance_agent.outcomes import OutcomeSender
from talaria.services.instance_agent.scheduler import (
    Decode,
    Idle,
    LinearCosts,
    Prefill,
    SchedulerConfig,
    SchedulerError,
    SwitchModel,
)
from talaria.services.instance_agent.telemetry import build_snapshot
from talaria.services.instance_agent.watchdog import Watchdog
from talaria.shared import subjects
from talaria.shared.events import CallRouted
from talaria.shared.messages import CANCELLED_STATUS
from talaria.shared.tracing import extract_context
from talaria.shared.wire import encode

# Starting guesses for the tiny CPU models; CalibratedCosts corrects them from measurements.
INITIAL_COSTS = LinearCosts(prefill_tok_s=5_000.0, restore_tok_s=200_000.0, decode_base_s=0.005,
                            switch_staged_s=0.02, switch_host_s=0.05, kv_bytes_per_token=4096)


def reusable_kv(engine, session_id: str, model: str, prompt_tokens: int,
                prompt_ids=None) -> tuple[str, int]:
    """(where the session's KV is, how many prompt tokens of it can be reused) on `engine`;
    at least the last prompt token is always computed, so it yields the first logits.
    With `prompt_ids`, device KV counts only as far as it matches the prompt: a prompt that
    does not extend the last one would otherwise be priced (and chunked) as almost free."""
    state = engine.kv_state(session_id, model)
    if state == "none":
        return "none", 0
    if state == "device" and prompt_ids is not None and hasattr(engine, "device_prefix"):
        held = engine.device_prefix(session_id, model, prompt_ids)
    else:
        held = max((n for s, m, st, n in engine.session_states()
                    if s == session_id and m == model and st == state), default=0)
    return state, min(held, prompt_tokens - 1)


@dataclass
class Running:
    routed: CallRouted
    # The JetStream message, acked once the outcome is published; None while the call runs
    # from its core-NATS fast copy and the durable copy has not arrived (it is acked on arrival).
    msg: object | None
    span: trace.Span
    streamed: int = 0  # its timeline (queue, slot wait, first token) is the core's CallRecord
    in_engine: bool = False  # its prefill was handed to the engine (chunks continue it)
    started_pub: asyncio.Future | None = None  # the CallStarted publish, off the prefill path
    logprobs: list = field(default_factory=list)  # a streamed call's logprobs not yet in a chunk
    ending: bool = False  # a cancel or drop is releasing it (the stray sweep leaves it to them)


class CallRunner(EngineSteps, CallOutcomes, CallDrops):
    """Intake, the work loop and telemetry here; the engine steps (engine_steps.py), the
    outcomes and acks (call_outcomes.py) and the drops (call_drops.py) are mixins over the
    same state."""

    def __init__(self, settings, engine, executor, nc, js, tracer: trace.Tracer, log) -> None:
        self.settings, self.engine, self.executor = settings, engine, executor
        self.nc, self.js, self.tracer, self.log = nc, js, tracer, log
        self.instance_id = settings.instance_id
        # This process's identity in every snapshot: the router replaces a predecessor's view
        # at once, and calls placed on the predecessor are refused here (the router failed them).
        self.incarnation = uuid.uuid4().hex[:12]
        config = SchedulerConfig.for_engine(
            engine.capabilities,
            pool=settings.pool, pinned_model=settings.models[0] if settings.pool == "hot" else None,
            sp=settings.sp, hkvr=settings.hkvr, staging=settings.staging, chunked_prefill=True,
            fill_by_switch=True,
        )
        self.core = AgentCore(self.instance_id, config, list(settings.models), INITIAL_COSTS)
        # Set when a call arrives: a chunked prefill in flight ends at its next forward pass.
        self.arrived = threading.Event()
        engine.should_yield = self.arrived.is_set
        self.calls: dict[str, Running] = {}
        self.wakeup = asyncio.Event()
        self.version = 0
        self.last_snapshot = 0.0
        # A call is in at most one of: `calls` (queued or running), `closing` (its outcome is
        # being published: a copy arriving then, e.g. the durable one after a NATS pause, is
        # attached to it, never run again), `finished` (recently done: a redelivery is acked).
        self.closing: dict[str, Running] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.outcomes = OutcomeSender(nc, js, log)  # completion records stored off the loop
        self.released: dict[str, object] = {}  # finished calls the engine step released: result or error
        # Cancels for calls not (yet) here: a call routed after its cancel is refused on arrival.
        self.cancelled: OrderedDict[str, tuple[str, str]] = OrderedDict()  # call id -> (reason, tenant)
        self.watchdog = Watchdog(min_stuck_s=settings.watchdog_min_s)
        self.unhealthy = ""  # why new calls should go elsewhere (heartbeat flag); "" when healthy
        self.step_calls: tuple[str, ...] = ()  # the calls of the engine step in flight
        self.step_predicted_s = 0.0  # the scheduler's estimate of that step (for the watchdog)
        # Look, before the next step, for engine entries no call here runs any more (failed by
        # the watchdog or an engine error, or leaked by a bug): they hold pages and block switches.
        self.sweep_due = False

    @property
    def sched(self):
        """The core's RoundScheduler."""
        return self.core.sched

    def holds(self, call_id: str) -> bool:
        """Whether a copy of this call needs nothing more: it is queued, running, finishing or
        finished here."""
        return call_id in self.calls or call_id in self.closing or call_id in self.finished

    # ---- intake ------------------------------------------------------------------------

    def accept(self, routed: CallRouted, msg, headers=None) -> str | None:
        """Queue a routed call; returns why it was refused, or None when accepted. `msg` is
        its JetStream message, or None for the router's core-NATS fast copy (`headers` its
        trace context); the call starts from whichever comes first."""
        call = routed.call
        if call.model not in self.settings.models:
            return f"this instance does not serve {call.model}"
        running = self.calls.get(call.call_id) or self.closing.get(call.call_id)
        if running is not None:
            if running.msg is None:  # the durable copy of a call started from its fast copy:
                running.msg = msg  # acked once the call's outcome is out
            return None  # redelivered while still here: keep the first copy
        if call.call_id in self.finished:
            if msg is not None:
                asyncio.ensure_future(msg.ack())
            return None
        if self.cancelled.get(call.call_id, ("", None))[1] == call.tenant:  # cancelled before it arrived
            self.calls[call.call_id] = Running(routed, msg, self.tracer.start_span("execute"))
            asyncio.ensure_future(self._cancelled(call.call_id, self.cancelled.pop(call.call_id)[0]))
            return None
        if routed.incarnation and routed.incarnation != self.incarnation:
            return (f"placed on a previous process of {self.instance_id}, which stopped before running it; "
                    "retry the call")
        kv_state, reusable = self._kv_for(call.session_id, call.model, call.prompt_tokens, call.prompt_ids)
        try:
            self.core.accept(call.call_id, call.session_id, call.model, call_index=routed.call_index,
                             prompt_tokens=call.prompt_tokens, max_tokens=call.max_tokens,
                             submitted_at=call.submitted_at, kv_state=kv_state, reusable_tokens=reusable,
                             now=time.time(), kv_output_tokens=routed.kv_output_tokens)
        except SchedulerError as exc:
            self.log.warning("scheduler refused call", call_id=call.call_id, error=str(exc))
            return f"the instance cannot schedule this call: {exc}"
        span = self.tracer.start_span("execute", context=extract_context(headers or getattr(msg, "headers", None)),
                                      attributes={"call.id": call.call_id, "instance.id": self.instance_id})
        self.calls[call.call_id] = Running(routed, msg, span)
        self.arrived.set()
        self.wakeup.set()
        return None

    def _kv_for(self, session_id: str, model: str, prompt_tokens: int, prompt_ids) -> tuple[str, int]:
        try:
            return reusable_kv(self.engine, session_id, model, prompt_tokens, prompt_ids)
        except Exception:  # the engine thread changed its tables under us: assume nothing
            return "none", 0

    async def cancel(self, call_id: str, reason: str, tenant: str = "") -> None:
        """Abort a call of `tenant`: out of the scheduler, its engine state released (its KV
        stays as the session's cache), recorded as cancelled. A call not here yet is refused
        on arrival if it is that tenant's. Another tenant's call is left alone."""
        if call_id in self.finished or call_id in self.closing:
            return  # its outcome is out (or going out)
        if call_id not in self.calls:
            self.cancelled[call_id] = (reason, tenant)
            while len(self.cancelled) > FINISHED_MEMORY:
                self.cancelled.popitem(last=False)
            return
        if self.calls[call_id].routed.call.tenant != tenant:
            self.log.warning("cancel from another tenant ignored", call_id=call_id)
            return
        outcome = Outcome()
        try:
            outcome = self.core.abort(call_id, time.time())
        except SchedulerError:
            pass  # not in the scheduler (refused or already finishing)
        await self._cancelled(call_id, reason)
        await self._events(outcome)  # abort drains the scheduler's outbox: publish what was in it

    async def _cancelled(self, call_id: str, reason: str) -> None:
        running = self.calls.get(call_id)
        if running is None:
            return
        running.ending = True
        if running.in_engine:
            try:  # after any step in flight: the engine thread runs one thing at a time
                await self._on_engine(self.engine.finish, call_id)
            except EngineError:
                pass  # the engine never admitted it
        await self._fail(call_id, f"cancelled: {reason}", status=CANCELLED_STATUS, code="cancelled")
        self.wakeup.set()

    # ---- the scheduling loop -----------------------------------------------------------

    async def work_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self._drop_expired(time.time())
            except Exception:
                self.log.exception("dropping expired calls failed")
            if self.sweep_due:
                try:
                    await self._sweep()
                except Exception:
                    self.log.exception("releasing stray engine state failed")
            try:
                action = self.core.next_action(time.time())
            except Exception:  # a scheduler bug: keep the loop (the agent) alive, retry next beat
                self.log.exception("scheduler failed to choose an action")
                await self._wait(stop, time.time() + self.settings.heartbeat_s)
                continue
            self.step_calls = tuple(getattr(action, "call_ids", ()))
            self.step_predicted_s = self.core.sched.estimate_s(action)
            try:
                match action:
                    case Idle():
                        # Clear first: a call accepted while the events below are published
                        # must still wake us.
                        self.wakeup.clear()
                        await self._events(self.core.drain(time.time()))
                        await self._wait(stop, _earliest(action.until, self._next_deadline()))
                        continue
                    case SwitchModel():
                        outcome = await self._switch(action)
                    case Prefill():
                        outcome = await self._prefill(action)
                    case Decode():
                        outcome = await self._decode(action)
            except EngineError as exc:
                outcome = await self._engine_failed(action, exc)
            except Exception as exc:  # a bug or a NATS failure: fail this action's calls, keep serving
                self.log.exception("step failed", action=type(action).__name__)
                outcome = await self._engine_failed(action, exc)
            try:
                await self._events(outcome)
            except Exception:
                self.log.exception("publishing scheduler events failed")

    async def _wait(self, stop: asyncio.Event, until: float | None) -> None:
        timeout = None if until is None else max(0.0, until - time.time())
        waiters = [asyncio.ensure_future(self.wakeup.wait()), asyncio.ensure_future(stop.wait())]
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()

    async def _run(self, fn, *args, kind: str | None = None):
        """An engine step of the work loop, timed by the watchdog."""
        self.watchdog.step_started(kind or fn.__name__, self.step_calls, time.time(), self.step_predicted_s)
        try:
            return await self._on_engine(fn, *args)
        finally:
            self.watchdog.step_ended(time.time())

    async def _on_engine(self, fn, *args):
        """On the engine thread, after any step in flight (cancels and drops: not a step of
        the loop, so the watchdog's view of the step in flight stays whole)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---- telemetry ---------------------------------------------------------------------

    async def publish_snapshot(self) -> None:
        self.version += 1
        self.last_snapshot = time.monotonic()
        try:
            snap = msgspec.structs.replace(
                build_snapshot(self.settings, self.engine, self.core, self.version, time.time(),
                               unhealthy=self.unhealthy),
                incarnation=self.incarnation)
            await self.nc.publish(subjects.telemetry(self.instance_id), encode(snap))
        except Exception as exc:  # a torn read of engine tables; the next beat retries
            self.log.warning("snapshot failed", error=str(exc))

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.publish_snapshot()
            try:
                await asyncio.wait_for(stop.wait(), self.settings.heartbeat_s)
            except TimeoutError:
                pass


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
