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

from talaria.services.instance_agent.core import AgentCore, Outcome
from talaria.services.instance_agent.engine import EngineError, GenRequest
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
from talaria.shared.bus import emit
from talaria.shared.logs import call_context
from talaria.shared.nats_auth import trusted
from talaria.shared.messages import (
    CANCELLED_STATUS,
    CallFailed,
    CallResult,
    CallRouted,
    CallStarted,
    ErrorReply,
    InstanceLost,
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


class CallRunner:
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
        # Calls finished here recently: a redelivery of one (its ack was lost) is acked, not rerun.
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.outcomes = OutcomeSender(nc, js, log, self._remember)  # records stored off the loop
        self.released: dict[str, object] = {}  # finished calls the engine step released: result or error
        # Cancels for calls not (yet) here: a call routed after its cancel is refused on arrival.
        self.cancelled: OrderedDict[str, tuple[str, str]] = OrderedDict()  # call id -> (reason, tenant)
        self.watchdog = Watchdog(min_stuck_s=settings.watchdog_min_s)
        self.unhealthy = ""  # why new calls should go elsewhere (heartbeat flag); "" when healthy
        self.step_calls: tuple[str, ...] = ()  # the calls of the engine step in flight
        self.orphans: set[str] = set()  # failed by the watchdog; the engine may still hold them

    @property
    def sched(self):
        """The core's RoundScheduler."""
        return self.core.sched

    # ---- intake ------------------------------------------------------------------------

    def accept(self, routed: CallRouted, msg, headers=None) -> str | None:
        """Queue a routed call; returns why it was refused, or None when accepted. `msg` is
        its JetStream message, or None for the router's core-NATS fast copy (`headers` its
        trace context); the call starts from whichever comes first."""
        call = routed.call
        if call.model not in self.settings.models:
            return f"this instance does not serve {call.model}"
        if call.call_id in self.calls:
            running = self.calls[call.call_id]
            if running.msg is None:  # the durable copy of a call started from its fast copy
                running.msg = msg
            return None  # redelivered while still here: keep the first copy
        if self.outcomes.attach(call.call_id, msg):  # its record is being stored: acked with it
            return None
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
                             now=time.time())
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
        if call_id in self.finished or self.outcomes.holds(call_id):
            return
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
        if running.in_engine:
            try:  # after any step in flight: the engine thread runs one thing at a time
                await self._run(self.engine.finish, call_id)
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
            if self.orphans:
                await self._release_orphans()
            action = self.core.next_action(time.time())
            self.step_calls = tuple(getattr(action, "call_ids", ()))
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

    # ---- deadlines and lost placements: never run work nobody waits for --------------------

    def _next_deadline(self) -> float | None:
        return min((r.routed.call.deadline_at for r in self.calls.values() if r.routed.call.deadline_at),
                   default=None)

    async def _drop_expired(self, now: float) -> None:
        """Calls whose client stopped waiting (the deadline the gateway set has passed; it
        answered 504) are dropped before another step is spent on them, and recorded."""
        for call_id, running in list(self.calls.items()):
            deadline = running.routed.call.deadline_at
            if deadline and now >= deadline:
                await self._drop(call_id, f"dropped: its deadline passed {now - deadline:.1f}s ago "
                                          "(the client stopped waiting)", status=504, code="deadline_passed")

    async def on_instance_lost(self, msg) -> None:
        """The router declared this very process lost (heartbeats late) and failed its calls
        with 503: stop them here too, so none completes after its client was told to retry."""
        try:
            lost = msgspec.json.decode(msg.data, type=InstanceLost)
        except msgspec.DecodeError:
            return
        if not trusted(msg, lost) or lost.instance_id != self.instance_id or lost.incarnation != self.incarnation:
            return
        self.log.warning("the router declared this agent lost; dropping its calls", calls=len(lost.calls))
        for call_id in lost.calls:
            await self._drop(call_id, lost.reason, status=503, code="instance_lost")

    async def _drop(self, call_id: str, reason: str, *, status: int, code: str) -> None:
        if call_id not in self.calls:
            return
        try:
            await self._events(self.core.abort(call_id, time.time()))
        except SchedulerError:
            self.core.forget(call_id)  # not (or no longer) in the scheduler
        try:
            await self._run(self.engine.finish, call_id)  # release its pages if the engine holds it
        except Exception:
            pass
        await self._fail(call_id, reason, status=status, code=code)

    async def _wait(self, stop: asyncio.Event, until: float | None) -> None:
        timeout = None if until is None else max(0.0, until - time.time())
        waiters = [asyncio.ensure_future(self.wakeup.wait()), asyncio.ensure_future(stop.wait())]
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()

    async def _run(self, fn, *args, kind: str | None = None):
        self.watchdog.step_started(kind or fn.__name__, self.step_calls, time.time())
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self.watchdog.step_ended(time.time())

    async def _switch(self, action: SwitchModel):
        record = await self._run(self.engine.switch_to, action.to_model)
        outcome = self.core.switch_done(action, time.time(), record.total_s, path=record.path,
                                        phases=record.phases(), bytes_staged=record.bytes_staged,
                                        bytes_uncovered=record.bytes_uncovered)
        await emit(self.js, outcome.switch)
        outcome.switch = None
        await self.publish_snapshot()
        return outcome

    async def _prefill(self, action: Prefill):
        reqs, more = [], []
        started = time.time()
        for call_id in action.call_ids:
            running = self.calls.get(call_id)
            if running is None:
                continue  # cancelled while queued for this action
            if running.in_engine:
                more.append(call_id)  # chunked prefill: this call's next chunk
                continue
            call = running.routed.call
            reqs.append(GenRequest(call_id=call.call_id, session_id=call.session_id, model=call.model,
                                   prompt_ids=list(call.prompt_ids), max_tokens=call.max_tokens,
                                   temperature=call.temperature, top_p=call.top_p, seed=call.seed,
                                   stop=tuple(call.stop), kv_scope=call.kv_scope, logit_bias=call.logit_bias,
                                   logprobs=call.logprobs, top_logprobs=call.top_logprobs))
            running.in_engine = True
            running.span.add_event("prefill_start", {"session_prefill": action.session_prefill})
            # Published while the prefill runs: it is a progress marker (the projector keeps a
            # final outcome over it whatever the order), and awaited before the call's outcome.
            running.started_pub = asyncio.ensure_future(
                emit(self.js, CallStarted(call_id, call.session_id, self.instance_id, started)))
        self.arrived.clear()
        steps = await self._step(self.engine.prefill, reqs, action.chunk_tokens, more)
        firsts = [s.call_id for s in steps]
        left = self.engine.prompt_left(action.call_ids) if action.chunk_tokens else None
        return self.core.prefill_done(action, time.time(), await self._tokens(steps), first_tokens=firsts,
                                      prompt_left=left)

    async def _decode(self, action: Decode):
        steps = await self._step(self.engine.decode, list(action.call_ids))
        return self.core.decode_done(action, time.time(), await self._tokens(steps))

    async def _step(self, step, *args):
        """An engine step (prefill or decode); the calls it finished are released on the
        engine thread in the same trip, so completing them costs no second hand-off."""
        steps, released = await self._run(self._step_and_release, step, *args, kind=step.__name__)
        self.released.update((c, r) for c, r in released.items() if c in self.calls)
        return steps

    def _step_and_release(self, step, *args):
        steps = step(*args)
        done = [s.call_id for s in steps if s.finished]
        return steps, (self._finish_all(done) if done else {})

    async def _tokens(self, steps) -> set[str]:
        finished = set()
        for step in steps:
            running = self.calls.get(step.call_id)
            if running is None:
                continue
            if step.logprob is not None and running.routed.call.stream:
                running.logprobs.append(step.logprob)
            if step.text and running.routed.call.stream:
                # A chunk carries the logprobs of the tokens since the last one (text held back
                # for a stop string releases several tokens' text at once).
                lps, running.logprobs = running.logprobs or None, []
                await self.nc.publish(subjects.tokens(step.call_id),
                                      encode(TokenChunk(step.call_id, running.streamed, step.text, logprobs=lps)))
                running.streamed += 1
            if step.finished:
                finished.add(step.call_id)
        return finished

    async def _engine_failed(self, action, exc: Exception):
        self.log.error("engine step failed", action=type(action).__name__, error=str(exc))
        outcome = Outcome()
        for call_id in getattr(action, "call_ids", ()):
            try:
                aborted = self.core.abort(call_id, time.time())
                outcome.finished += aborted.finished
                outcome.rounds += aborted.rounds
                outcome.notes += aborted.notes
            except SchedulerError:
                self.core.forget(call_id)  # already gone from the scheduler
            try:
                self.engine.finish(call_id)  # release its pages if the engine still holds it
            except Exception:
                pass
            await self._fail(call_id, f"engine error: {exc}")
        return outcome

    # ---- the core's outcomes -----------------------------------------------------------

    async def _events(self, outcome: Outcome) -> None:
        if outcome.finished:
            await self._complete(outcome.finished)
        for summary in outcome.rounds:
            self.watchdog.round_ended(summary.wall_s)
            await emit(self.js, summary)
        if outcome.switch is not None:
            await emit(self.js, outcome.switch)
        for event in outcome.notes:
            # structlog's first argument is already called `event`: name ours `kind`.
            self.log.info("scheduler", kind=type(event).__name__, **{
                k: v for k, v in vars(event).items() if k in ("call_id", "reason", "model")})
        changed = bool(outcome.finished)
        if changed and time.monotonic() - self.last_snapshot >= SNAPSHOT_ON_CHANGE_MIN_S:
            await self.publish_snapshot()  # the router learns of freed capacity and new session KV now

    async def _complete(self, call_ids: list[str]) -> None:
        """Release the finished calls on the engine (one step for all of them), then send
        each one's outcome; the loop goes on while their records are stored."""
        ids = [c for c in call_ids if c in self.calls]
        if not ids:
            return
        results = {c: self.released.pop(c) for c in ids if c in self.released}
        todo = [c for c in ids if c not in results]
        if todo:
            results.update(await self._run(self._finish_all, todo, kind="finish"))
        for call_id in ids:
            running = self.calls.get(call_id)
            if running is None:  # cancelled or failed while the engine released it
                continue
            result = results[call_id]
            deadline = running.routed.call.deadline_at
            if deadline and time.time() >= deadline:  # its client got a 504: never flip that to completed
                await self._fail(call_id, "finished after its deadline (the client stopped waiting)", status=504,
                                 code="deadline_passed")
            elif isinstance(result, EngineError):
                await self._fail(call_id, f"engine error: {result}")
            else:
                del self.calls[call_id]
                with call_context(running.routed.call.session_id, call_id):
                    await self._publish_completion(call_id, running, result)

    def _finish_all(self, call_ids: list[str]) -> dict:
        """On the engine thread: each call's GenResult, or the EngineError finishing it raised."""
        out: dict = {}
        for call_id in call_ids:
            try:
                out[call_id] = self.engine.finish(call_id)
            except EngineError as exc:
                out[call_id] = exc
        return out

    async def _publish_completion(self, call_id: str, running: Running, result) -> None:
        routed, call, done = running.routed, running.routed.call, time.time()
        via = self.core.records[call_id].via
        completed = self.core.completed(
            call_id, done, prompt_tokens=result.prompt_tokens, output_tokens=len(result.token_ids),
            finish_reason=result.finish_reason, cached_tokens=result.cached_tokens, kv_source=result.kv_source,
            prefill_s=result.prefill_s, decode_s=result.decode_s,
            trace_id=f"{running.span.get_span_context().trace_id:032x}")
        running.span.set_attributes({
            "queue_s": completed.queue_s, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
            "cached_tokens": result.cached_tokens, "kv_source": result.kv_source,
            "slot_wait_s": completed.slot_wait_s, "admitted_via": via, "model_opened": completed.model_opened})
        running.span.end()
        # The reply and the stream's end go out now; the durable record follows, and the
        # message is acked only after it is stored, so a crash before that still redelivers.
        replies = []
        if call.reply_to:
            n_out = len(result.token_ids)
            replies.append((call.reply_to, encode(CallResult(
                call_id=call_id, session_id=call.session_id, call_index=routed.call_index, model=call.model,
                instance_id=self.instance_id, text=result.text, finish_reason=result.finish_reason,
                usage=Usage(result.prompt_tokens, n_out, result.prompt_tokens + n_out, result.cached_tokens),
                timings=Timings(completed.queue_s, completed.ttft_s, result.prefill_s, result.decode_s,
                                completed.slot_wait_s, done - call.submitted_at),
                kv_source=result.kv_source, stop_sequence=result.stop_sequence, logprobs=result.logprobs,
            ))))
        if call.stream:
            replies.append((subjects.tokens(call_id), encode(TokenChunk(
                call_id, running.streamed, "", done=True, finish_reason=result.finish_reason))))
        await self.outcomes.send(call_id, running, completed, replies)
        self.log.info("call completed", tokens=len(result.token_ids), kv_source=result.kv_source,
                      ttft_s=round(completed.ttft_s, 4))

    async def _fail(self, call_id: str, reason: str, *, status: int = 500, code: str = "engine_error") -> None:
        """Fail a call: the reply now, and (unlike a completion) wait until its record is stored."""
        running = self.calls.pop(call_id, None)
        self.released.pop(call_id, None)
        if running is None:
            return
        routed, call = running.routed, running.routed.call
        self.core.forget(call_id)
        with call_context(call.session_id, call_id):
            self.log.error("call failed", reason=reason)
        running.span.set_status(trace.Status(trace.StatusCode.ERROR, reason))
        running.span.end()
        replies = []
        if call.reply_to:
            retry = 1.0 if status == 503 else None  # 503: placed elsewhere it can run
            replies.append((call.reply_to, encode(ErrorReply(status, code, reason, call_id=call_id,
                                                             retry_after_s=retry))))
        if call.stream:
            replies.append((subjects.tokens(call_id), encode(TokenChunk(
                call_id, running.streamed, "", done=True, finish_reason=code))))
        failed = CallFailed(call_id, call.session_id, call.model, reason, "agent", time.time(), status=status,
                            instance_id=self.instance_id, call_index=routed.call_index)
        await (await self.outcomes.send(call_id, running, failed, replies))

    def _remember(self, call_id: str) -> None:
        self.watchdog.call_done(call_id)
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

    # ---- watchdog ----------------------------------------------------------------------

    async def watchdog_loop(self, stop: asyncio.Event) -> None:
        """Fail calls that stopped making progress; flag the agent unhealthy while an engine
        step is stuck, so the router stops choosing it (see watchdog.py)."""
        while not stop.is_set():
            try:
                await self.watch(time.time())
            except Exception:
                self.log.exception("watchdog check failed")
            try:
                await asyncio.wait_for(stop.wait(), self.settings.heartbeat_s)
            except TimeoutError:
                pass

    async def watch(self, now: float) -> None:
        verdict = self.watchdog.check(now)
        if verdict.unhealthy != self.unhealthy:
            (self.log.error if verdict.unhealthy else self.log.info)(
                "agent health changed", unhealthy=verdict.unhealthy or None)
            self.unhealthy = verdict.unhealthy
            await self.publish_snapshot()
        for call_id, why in verdict.fail_calls.items():
            if call_id not in self.calls:
                self.watchdog.call_done(call_id)
                continue
            try:
                await self._events(self.core.abort(call_id, now))
            except SchedulerError:
                self.core.forget(call_id)  # already gone from the scheduler
            self.orphans.add(call_id)  # released on the engine thread before the next step
            await self._fail(call_id, why)

    async def _release_orphans(self) -> None:
        orphans, self.orphans = self.orphans, set()

        def release() -> None:
            for call_id in orphans:
                if call_id in self.engine.running:
                    try:
                        self.engine.finish(call_id)
                    except Exception:
                        pass

        await asyncio.get_running_loop().run_in_executor(self.executor, release)

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
