"""CallRunner: drives the round scheduler with the torch engine; publishes what happens.

    routed call ──accept──▶ RoundScheduler.submit(Work)
    loop: action = next_action(now)
          SwitchModel → engine.switch_to      → SwitchDone event
          Prefill     → engine.prefill(batch) → first tokens (stream), CallStarted
          Decode      → engine.decode(batch)  → next tokens (stream)
          Idle        → wait for the next call
    scheduler events: CallFinished → engine.finish → CallCompleted + reply + ack;
                      RoundEnded → RoundSummary event

The scheduler is pure and the engine blocking: engine calls run on the single engine
thread, everything touching NATS stays on the event loop. A call's JetStream message is
acked only once its outcome is published, so a crashed agent's calls are redelivered.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from opentelemetry import trace

from talaria.services.instance_agent.engine import EngineError, GenRequest
from talaria.services.instance_agent.scheduler import (
    CallAdmitted,
    CallFinished,
    CallParked,
    Decode,
    DeadlineRisk,
    Idle,
    LinearCosts,
    Prefill,
    RoundEnded,
    RoundScheduler,
    SchedulerConfig,
    SchedulerError,
    SwitchModel,
    Work,
)
from talaria.services.instance_agent.telemetry import build_snapshot
from talaria.shared import subjects
from talaria.shared.bus import emit
from talaria.shared.logs import call_context
from talaria.shared.messages import (
    CANCELLED_STATUS,
    CallCompleted,
    CallFailed,
    CallResult,
    CallRouted,
    CallStarted,
    ErrorReply,
    RoundSummary,
    SwitchDone,
    Timings,
    TokenChunk,
    Usage,
    encode,
)
from talaria.shared.tracing import extract_context

FINISHED_MEMORY = 10_000
SNAPSHOT_ON_CHANGE_MIN_S = 0.05  # besides the heartbeat, on change, at most this often
IN_PROGRESS_EVERY_S = 20.0

# Starting guesses for the tiny CPU models; CalibratedCosts corrects them from measurements.
INITIAL_COSTS = LinearCosts(prefill_tok_s=5_000.0, restore_tok_s=200_000.0, decode_base_s=0.005,
                            switch_staged_s=0.02, switch_host_s=0.05, kv_bytes_per_token=4096)


def reusable_kv(engine, session_id: str, model: str, prompt_tokens: int) -> tuple[str, int]:
    """(where the session's KV is, how many prompt tokens of it can be reused) on `engine`;
    at least the last prompt token is always computed, so it yields the first logits."""
    state = engine.kv_state(session_id, model)
    if state == "none":
        return "none", 0
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
    started_at: float | None = None
    first_token_at: float | None = None
    slot_wait_s: float = 0.0
    via: str = ""
    opened_model: bool = False
    streamed: int = 0
    tokens: list[str] = field(default_factory=list)
    started_pub: asyncio.Future | None = None  # the CallStarted publish, off the prefill path


class CallRunner:
    def __init__(self, settings, engine, executor, nc, js, tracer: trace.Tracer, log) -> None:
        self.settings, self.engine, self.executor = settings, engine, executor
        self.nc, self.js, self.tracer, self.log = nc, js, tracer, log
        self.instance_id = settings.instance_id
        config = SchedulerConfig(
            pool=settings.pool, pinned_model=settings.models[0] if settings.pool == "hot" else None,
            sp=settings.sp, hkvr=settings.hkvr, staging=settings.staging, chunked_prefill=True,
            fill_by_switch=True,
        )
        self.sched = RoundScheduler(config, list(settings.models), INITIAL_COSTS)
        # Set when a call arrives: a chunked prefill in flight ends at its next forward pass.
        self.arrived = threading.Event()
        engine.should_yield = self.arrived.is_set
        self.calls: dict[str, Running] = {}
        self.wakeup = asyncio.Event()
        self.version = 0
        self.last_snapshot = 0.0
        self.opened_for: set[str] = set()  # calls whose slot began with a model switch
        # Calls finished here recently: a redelivery of one (its ack was lost) is acked, not rerun.
        self.finished: OrderedDict[str, None] = OrderedDict()
        # Cancels for calls not (yet) here: a call routed after its cancel is refused on arrival.
        self.cancelled: OrderedDict[str, str] = OrderedDict()

    # ---- intake ------------------------------------------------------------------------

    def accept(self, routed: CallRouted, msg) -> str | None:
        """Queue a routed call; returns why it was refused, or None when accepted."""
        call = routed.call
        if call.model not in self.settings.models:
            return f"this instance does not serve {call.model}"
        if call.call_id in self.calls:
            running = self.calls[call.call_id]
            if running.msg is None:  # the durable copy of a call started from its fast copy
                running.msg = msg
            return None  # redelivered while still here: keep the first copy
        if call.call_id in self.finished:
            if msg is not None:
                asyncio.ensure_future(msg.ack())
            return None
        if call.call_id in self.cancelled:
            self.calls[call.call_id] = Running(routed, msg, self.tracer.start_span("execute"))
            asyncio.ensure_future(self._cancelled(call.call_id, self.cancelled.pop(call.call_id)))
            return None
        kv_state, reusable = self._kv_for(call.session_id, call.model, call.prompt_tokens)
        work = Work(call.call_id, call.session_id, call.model, prompt_tokens=max(1, call.prompt_tokens),
                    reusable_tokens=reusable, kv_state=kv_state, max_tokens=call.max_tokens,
                    arrived_at=call.submitted_at, continuation=routed.call_index > 0)
        try:
            self.sched.submit(work, time.time())
        except SchedulerError as exc:
            self.log.warning("scheduler refused call", call_id=call.call_id, error=str(exc))
            return f"the instance cannot schedule this call: {exc}"
        span = self.tracer.start_span("execute", context=extract_context(getattr(msg, "headers", None)),
                                      attributes={"call.id": call.call_id, "instance.id": self.instance_id})
        self.calls[call.call_id] = Running(routed, msg, span)
        self.arrived.set()
        self.wakeup.set()
        return None

    def _kv_for(self, session_id: str, model: str, prompt_tokens: int) -> tuple[str, int]:
        try:
            return reusable_kv(self.engine, session_id, model, prompt_tokens)
        except Exception:  # the engine thread changed its tables under us: assume nothing
            return "none", 0

    async def cancel(self, call_id: str, reason: str) -> None:
        """Abort a call: out of the scheduler, its engine state released (its KV stays as the
        session's cache), recorded as cancelled. A call not here yet is refused on arrival."""
        if call_id in self.finished:
            return
        if call_id not in self.calls:
            self.cancelled[call_id] = reason
            while len(self.cancelled) > FINISHED_MEMORY:
                self.cancelled.popitem(last=False)
            return
        events = []
        try:
            events = self.sched.abort(call_id, time.time())
        except SchedulerError:
            pass  # not in the scheduler (refused or already finishing)
        await self._cancelled(call_id, reason)
        await self._events(events)  # abort drains the outbox: publish what was in it

    async def _cancelled(self, call_id: str, reason: str) -> None:
        running = self.calls.get(call_id)
        if running is None:
            return
        if running.started_at is not None:
            try:  # after any step in flight: the engine thread runs one thing at a time
                await self._run(self.engine.finish, call_id)
            except EngineError:
                pass  # the engine never admitted it
        await self._fail(call_id, f"cancelled: {reason}", status=CANCELLED_STATUS, code="cancelled")
        self.wakeup.set()

    # ---- the scheduling loop -----------------------------------------------------------

    async def work_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            action = self.sched.next_action(time.time())
            try:
                match action:
                    case Idle():
                        # Clear first: a call accepted while the events below are published
                        # must still wake us.
                        self.wakeup.clear()
                        await self._events(self.sched.drain_events())
                        await self._wait(stop, action.until)
                        continue
                    case SwitchModel():
                        events = await self._switch(action)
                    case Prefill():
                        events = await self._prefill(action)
                    case Decode():
                        events = await self._decode(action)
            except EngineError as exc:
                events = await self._engine_failed(action, exc)
            except Exception as exc:  # a bug or a NATS failure: fail this action's calls, keep serving
                self.log.exception("step failed", action=type(action).__name__)
                events = await self._engine_failed(action, exc)
            try:
                await self._events(events)
            except Exception:
                self.log.exception("publishing scheduler events failed")

    async def _wait(self, stop: asyncio.Event, until: float | None) -> None:
        timeout = None if until is None else max(0.0, until - time.time())
        waiters = [asyncio.ensure_future(self.wakeup.wait()), asyncio.ensure_future(stop.wait())]
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _switch(self, action: SwitchModel):
        record = await self._run(self.engine.switch_to, action.to_model)
        events = self.sched.on_switch_done(action, time.time(), record.total_s)
        self.opened_for.update(c for c, r in self.calls.items() if r.routed.call.model == action.to_model)
        await emit(self.js, SwitchDone(
            instance_id=self.instance_id, from_model=action.from_model, to_model=action.to_model,
            path=record.path, total_s=record.total_s, at=time.time(), phases=record.phases(),
            bytes_staged=record.bytes_staged, bytes_uncovered=record.bytes_uncovered,
        ))
        await self.publish_snapshot()
        return events

    async def _prefill(self, action: Prefill):
        reqs, more = [], []
        started = time.time()
        for call_id in action.call_ids:
            running = self.calls.get(call_id)
            if running is None:
                continue  # cancelled while queued for this action
            if running.started_at is not None:
                more.append(call_id)  # chunked prefill: this call's next chunk
                continue
            call = running.routed.call
            reqs.append(GenRequest(call_id=call.call_id, session_id=call.session_id, model=call.model,
                                   prompt_ids=list(call.prompt_ids), max_tokens=call.max_tokens,
                                   temperature=call.temperature, top_p=call.top_p, seed=call.seed,
                                   stop=tuple(call.stop)))
            running.started_at = started
            running.span.add_event("prefill_start", {"session_prefill": action.session_prefill})
            # Published while the prefill runs: it is a progress marker (the projector keeps a
            # final outcome over it whatever the order), and awaited before the call's outcome.
            running.started_pub = asyncio.ensure_future(
                emit(self.js, CallStarted(call_id, call.session_id, self.instance_id, started)))
        self.arrived.clear()
        steps = await self._run(self.engine.prefill, reqs, action.chunk_tokens, more)
        firsts = [s.call_id for s in steps]
        left = self.engine.prompt_left(action.call_ids) if action.chunk_tokens else None
        return self.sched.on_prefill_done(action, time.time(), await self._tokens(steps), first_tokens=firsts,
                                          prompt_left=left)

    async def _decode(self, action: Decode):
        steps = await self._run(self.engine.decode, list(action.call_ids))
        return self.sched.on_decode_done(action, time.time(), await self._tokens(steps))

    async def _tokens(self, steps) -> set[str]:
        now, finished = time.time(), set()
        for step in steps:
            running = self.calls.get(step.call_id)
            if running is None:
                continue
            if running.first_token_at is None:
                running.first_token_at = now
            if step.text and running.routed.call.stream:
                await self.nc.publish(subjects.tokens(step.call_id),
                                      encode(TokenChunk(step.call_id, running.streamed, step.text)))
                running.streamed += 1
            if step.finished:
                finished.add(step.call_id)
        return finished

    async def _engine_failed(self, action, exc: Exception):
        self.log.error("engine step failed", action=type(action).__name__, error=str(exc))
        events = []
        for call_id in getattr(action, "call_ids", ()):
            try:
                events += self.sched.abort(call_id, time.time())
            except SchedulerError:
                pass  # already gone from the scheduler
            try:
                self.engine.finish(call_id)  # release its pages if the engine still holds it
            except Exception:
                pass
            await self._fail(call_id, f"engine error: {exc}")
        return events

    # ---- scheduler events --------------------------------------------------------------

    async def _events(self, events) -> None:
        changed = False
        for event in events:
            match event:
                case CallAdmitted():
                    running = self.calls.get(event.call_id)
                    if running is not None:
                        running.slot_wait_s, running.via = event.slot_wait_s, event.via
                case CallFinished(reason="aborted"):
                    pass  # already failed and acked by whoever aborted it
                case CallFinished():
                    await self._complete(event.call_id)
                    changed = True
                case RoundEnded():
                    await emit(self.js, RoundSummary(
                        instance_id=self.instance_id, round_index=event.round_index, wall_s=event.wall_s,
                        active_s=event.active_s, switch_s=event.switch_s, at=event.at or time.time(),
                        slots=list(event.slots), sp_admitted=event.sp_admitted, sp_parked=event.sp_parked,
                        deadline_risk=event.deadline_risk))
                case CallParked() | DeadlineRisk():
                    # `kind`, not `event`: structlog's message argument is called `event`, and a
                    # clash raised here and lost the events after this one (calls never finished).
                    self.log.info("scheduler", kind=type(event).__name__, **{
                        k: v for k, v in event.__dict__.items() if k in ("call_id", "reason", "model")})
        if changed and time.monotonic() - self.last_snapshot >= SNAPSHOT_ON_CHANGE_MIN_S:
            await self.publish_snapshot()  # the router learns of freed capacity and new session KV now

    async def _complete(self, call_id: str) -> None:
        running = self.calls.pop(call_id, None)
        if running is None:
            return
        with call_context(running.routed.call.session_id, call_id):
            await self._publish_completion(call_id, running)

    async def _publish_completion(self, call_id: str, running: Running) -> None:
        try:
            result = await self._run(self.engine.finish, call_id)
        except EngineError as exc:
            self.calls[call_id] = running
            await self._fail(call_id, f"engine error: {exc}")
            return
        routed, call, done = running.routed, running.routed.call, time.time()
        started = running.started_at or done
        first = running.first_token_at or done
        opened = call_id in self.opened_for
        self.opened_for.discard(call_id)
        attrs = {"queue_s": started - call.submitted_at, "prefill_s": result.prefill_s,
                 "decode_s": result.decode_s, "cached_tokens": result.cached_tokens, "kv_source": result.kv_source,
                 "slot_wait_s": running.slot_wait_s, "admitted_via": running.via, "model_opened": opened}
        running.span.set_attributes(attrs)
        running.span.end()
        completed = CallCompleted(
            call_id=call_id, session_id=call.session_id, call_index=routed.call_index, model=call.model,
            instance_id=self.instance_id, prompt_tokens=result.prompt_tokens,
            output_tokens=len(result.token_ids), finish_reason=result.finish_reason,
            submitted_at=call.submitted_at, started_at=started, first_token_at=first, completed_at=done,
            cached_tokens=result.cached_tokens, kv_source=result.kv_source, queue_s=started - call.submitted_at,
            ttft_s=first - call.submitted_at, prefill_s=result.prefill_s, decode_s=result.decode_s,
            slot_wait_s=running.slot_wait_s, kv_tokens=result.prompt_tokens + len(result.token_ids),
            model_opened=opened, trace_id=f"{running.span.get_span_context().trace_id:032x}",
        )
        # The durable record, the reply and the stream's end go out together; the message is
        # acked only after all of them, so a crash before that still redelivers the call.
        sends = [emit(self.js, completed)]
        if call.reply_to:
            n_out = len(result.token_ids)
            sends.append(self.nc.publish(call.reply_to, encode(CallResult(
                call_id=call_id, session_id=call.session_id, call_index=routed.call_index, model=call.model,
                instance_id=self.instance_id, text=result.text, finish_reason=result.finish_reason,
                usage=Usage(result.prompt_tokens, n_out, result.prompt_tokens + n_out, result.cached_tokens),
                timings=Timings(completed.queue_s, completed.ttft_s, result.prefill_s, result.decode_s,
                                running.slot_wait_s, done - call.submitted_at),
                kv_source=result.kv_source,
            ))))
        if call.stream:
            sends.append(self.nc.publish(subjects.tokens(call_id), encode(TokenChunk(
                call_id, running.streamed, "", done=True, finish_reason=result.finish_reason))))
        await asyncio.gather(*sends, _settled(running.started_pub))
        if running.msg is not None:
            await running.msg.ack()
        self._remember(call_id)
        self.log.info("call completed", tokens=len(result.token_ids), kv_source=result.kv_source,
                      ttft_s=round(completed.ttft_s, 4))

    async def _fail(self, call_id: str, reason: str, status: int = 500, code: str = "engine_error") -> None:
        running = self.calls.pop(call_id, None)
        if running is None:
            return
        routed, call = running.routed, running.routed.call
        with call_context(call.session_id, call_id):
            self.log.error("call failed", reason=reason)
        running.span.set_status(trace.Status(trace.StatusCode.ERROR, reason))
        running.span.end()
        await _settled(running.started_pub)
        sends = [emit(self.js, CallFailed(call_id, call.session_id, call.model, reason, "agent", time.time(),
                                          status=status, instance_id=self.instance_id,
                                          call_index=routed.call_index))]
        if call.reply_to:
            sends.append(self.nc.publish(call.reply_to, encode(ErrorReply(status, code, reason, call_id=call_id))))
        if call.stream:
            sends.append(self.nc.publish(subjects.tokens(call_id), encode(TokenChunk(
                call_id, running.streamed, "", done=True, finish_reason=code))))
        await asyncio.gather(*sends)
        if running.msg is not None:
            await running.msg.ack()
        self._remember(call_id)

    def _remember(self, call_id: str) -> None:
        self.finished[call_id] = None
        while len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)

    async def progress_loop(self, stop: asyncio.Event) -> None:
        """Tell JetStream that held calls are still being worked on, so none is redelivered
        while it waits for its slot (the consumer's ack_wait is shorter than a long queue)."""
        while not stop.is_set():
            for running in list(self.calls.values()):
                try:
                    if running.msg is not None:
                        await running.msg.in_progress()
                except Exception:
                    pass
            try:
                await asyncio.wait_for(stop.wait(), IN_PROGRESS_EVERY_S)
            except TimeoutError:
                pass

    # ---- telemetry ---------------------------------------------------------------------

    async def publish_snapshot(self) -> None:
        self.version += 1
        self.last_snapshot = time.monotonic()
        try:
            snap = build_snapshot(self.settings, self.engine, self.sched, self.version, time.time())
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


async def _settled(fut: asyncio.Future | None) -> None:
    """Wait for a background publish; its failure only loses a progress marker."""
    if fut is not None:
        try:
            await fut
        except Exception:
            pass
