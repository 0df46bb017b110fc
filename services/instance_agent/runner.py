"""CallRunner: the agent's work loop, snapshot heartbeats and event publishing.

Compute happens on the engine's worker thread; everything that touches NATS stays
on the event loop. Tokens cross from the thread to the loop through call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import structlog
from opentelemetry import trace

from shared import subjects
from shared.bus import emit
from shared.messages import (
    CallCompleted,
    CallFailed,
    CallResult,
    CallRouted,
    CallStarted,
    ErrorReply,
    InstanceSnapshot,
    ModelResidency,
    SessionKv,
    SwitchDone,
    Timings,
    TokenChunk,
    Usage,
    encode,
)
from shared.tracing import extract_context


@dataclass
class Pending:
    routed: CallRouted
    msg: object  # the JetStream message, acked once the outcome is published
    received_at: float = field(default_factory=time.time)


class CallRunner:
    def __init__(self, settings, engine, executor, nc, js, tracer: trace.Tracer, log) -> None:
        self.settings, self.engine, self.executor = settings, engine, executor
        self.nc, self.js, self.tracer, self.log = nc, js, tracer, log
        self.instance_id = settings.instance_id
        self.queue: deque[Pending] = deque()
        self.wakeup = asyncio.Event()
        self.running: Pending | None = None
        self.version = 0
        self.seen: set[str] = set()

    # ---- intake ------------------------------------------------------------------------

    def accept(self, routed: CallRouted, msg) -> bool:
        if routed.call.model not in self.settings.models:
            return False
        if routed.call.call_id in self.seen:
            # Redelivered while still queued or running here: keep the first copy.
            return True
        self.seen.add(routed.call.call_id)
        self.queue.append(Pending(routed, msg))
        self.wakeup.set()
        return True

    # ---- work loop ---------------------------------------------------------------------

    async def work_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not self.queue:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            pending = self.queue.popleft()
            self.running = pending
            try:
                await self._execute(pending)
            except Exception as exc:  # an engine error fails this call, never the agent
                self.log.exception("call failed", call_id=pending.routed.call.call_id)
                await self._fail(pending, f"engine error: {exc}")
            finally:
                self.running = None
                self.seen.discard(pending.routed.call.call_id)
                await self.publish_snapshot()

    async def _execute(self, pending: Pending) -> None:
        from services.instance_agent.engine import GenRequest

        routed, call = pending.routed, pending.routed.call
        loop = asyncio.get_running_loop()
        ctx = extract_context(getattr(pending.msg, "headers", None))
        with self.tracer.start_as_current_span(
            "execute", context=ctx, attributes={"call.id": call.call_id, "instance.id": self.instance_id}
        ) as span:
            started = time.time()
            span.add_event("dequeued", {"queue_s": started - call.submitted_at})
            await emit(self.js, CallStarted(call.call_id, call.session_id, self.instance_id, started))
            opened = False
            if self.engine.active_model != call.model:
                await self._switch(call.model)
                opened = True
            slot_ready = time.time()
            first_token_at: list[float] = []
            tokens: asyncio.Queue = asyncio.Queue()
            publisher = asyncio.create_task(self._publish_tokens(call.call_id, tokens)) if call.stream else None

            def on_token(token_id: int, text: str) -> None:
                if not first_token_at:
                    first_token_at.append(time.time())
                if publisher is not None:
                    loop.call_soon_threadsafe(tokens.put_nowait, text)

            req = GenRequest(
                call_id=call.call_id, session_id=call.session_id, model=call.model,
                prompt_ids=list(call.prompt_ids), max_tokens=call.max_tokens,
                temperature=call.temperature, top_p=call.top_p, seed=call.seed, stop=tuple(call.stop),
            )
            result = await loop.run_in_executor(self.executor, self.engine.generate, req, on_token)
            done = time.time()
            if publisher is not None:
                tokens.put_nowait(None)
                await publisher
            first = first_token_at[0] if first_token_at else done
            span.add_event("prefill_done", {"prefill_s": result.prefill_s, "kv_source": result.kv_source})
            span.set_attributes({"queue_s": started - call.submitted_at, "prefill_s": result.prefill_s,
                                 "decode_s": result.decode_s, "cached_tokens": result.cached_tokens,
                                 "kv_source": result.kv_source, "slot_wait_s": slot_ready - started})
            await self._complete(pending, result, started, first, done, slot_ready - started, opened,
                                 trace_id=f"{span.get_span_context().trace_id:032x}")

    async def _switch(self, model: str) -> None:
        loop = asyncio.get_running_loop()
        before = self.engine.active_model
        record = await loop.run_in_executor(self.executor, self.engine.switch_to, model)
        await emit(self.js, SwitchDone(
            instance_id=self.instance_id, from_model=before, to_model=model, path=record.path,
            total_s=record.total_s, at=time.time(), phases=record.phases(),
            bytes_staged=record.bytes_staged, bytes_uncovered=record.bytes_uncovered,
        ))
        await self.publish_snapshot()

    async def _publish_tokens(self, call_id: str, tokens: asyncio.Queue) -> None:
        subject = subjects.tokens(call_id)
        index = 0
        while (text := await tokens.get()) is not None:
            if text:
                await self.nc.publish(subject, encode(TokenChunk(call_id, index, text)))
                index += 1

    async def _complete(self, pending: Pending, result, started: float, first: float, done: float,
                        slot_wait: float, opened: bool, trace_id: str) -> None:
        routed, call = pending.routed, pending.routed.call
        completed = CallCompleted(
            call_id=call.call_id, session_id=call.session_id, call_index=routed.call_index,
            model=call.model, instance_id=self.instance_id, prompt_tokens=result.prompt_tokens,
            output_tokens=len(result.token_ids), finish_reason=result.finish_reason,
            submitted_at=call.submitted_at, started_at=started, first_token_at=first, completed_at=done,
            cached_tokens=result.cached_tokens, kv_source=result.kv_source,
            queue_s=started - call.submitted_at, ttft_s=first - call.submitted_at,
            prefill_s=result.prefill_s, decode_s=result.decode_s, slot_wait_s=slot_wait,
            kv_tokens=result.prompt_tokens + len(result.token_ids), model_opened=opened, trace_id=trace_id,
        )
        await emit(self.js, completed)
        if call.reply_to:
            reply = CallResult(
                call_id=call.call_id, session_id=call.session_id, call_index=routed.call_index,
                model=call.model, instance_id=self.instance_id, text=result.text,
                finish_reason=result.finish_reason,
                usage=Usage(result.prompt_tokens, len(result.token_ids),
                            result.prompt_tokens + len(result.token_ids), result.cached_tokens),
                timings=Timings(completed.queue_s, completed.ttft_s, result.prefill_s, result.decode_s,
                                slot_wait, done - call.submitted_at),
                kv_source=result.kv_source,
            )
            await self.nc.publish(call.reply_to, encode(reply))
        await pending.msg.ack()
        structlog.contextvars.unbind_contextvars("call_id")

    async def _fail(self, pending: Pending, reason: str) -> None:
        routed, call = pending.routed, pending.routed.call
        await emit(self.js, CallFailed(call.call_id, call.session_id, call.model, reason, "agent", time.time(),
                                       status=500, instance_id=self.instance_id, call_index=routed.call_index))
        if call.reply_to:
            await self.nc.publish(call.reply_to, encode(ErrorReply(500, "engine_error", reason,
                                                                   call_id=call.call_id)))
        await pending.msg.ack()

    # ---- telemetry ---------------------------------------------------------------------

    def snapshot(self) -> InstanceSnapshot:
        self.version += 1
        engine = self.engine
        active = engine.active_model
        stats = engine.stats()
        queued: dict[str, int] = {}
        queued_tokens = 0
        for p in self.queue:
            queued[p.routed.call.model] = queued.get(p.routed.call.model, 0) + 1
            queued_tokens += p.routed.call.prompt_tokens
        models = [
            ModelResidency(model=m, state="active" if m == active else "absent",
                           switch_cost_s=float(getattr(stats, "last_switch_s", 0.0) or 0.0),
                           open_cost_s=float(getattr(stats, "last_switch_s", 0.0) or 0.0))
            for m in self.settings.models
        ]
        sessions = [SessionKv(sid, model, state, kv) for sid, model, state, kv in engine.session_states()]
        return InstanceSnapshot(
            instance_id=self.instance_id, version=self.version, at=time.time(), pool=self.settings.pool,
            models=models, active_model=active, sessions=sessions, queued=queued,
            queued_tokens=queued_tokens, running=1 if self.running else 0,
            kv_capacity_tokens=int(getattr(stats, "kv_capacity_tokens", 0)),
            kv_used_tokens=int(getattr(stats, "kv_used_tokens", 0)),
            prefill_tok_s=float(getattr(stats, "prefill_tok_s", 0.0)),
            decode_tok_s=float(getattr(stats, "decode_tok_s", 0.0)),
            restore_tok_s=float(getattr(stats, "restore_tok_s", 0.0)),
            switch_s=float(getattr(stats, "last_switch_s", 0.0) or 0.0),
            heartbeat_s=self.settings.heartbeat_s,
        )

    async def publish_snapshot(self) -> None:
        try:
            await self.nc.publish(subjects.telemetry(self.instance_id), encode(self.snapshot()))
        except Exception as exc:
            self.log.warning("snapshot publish failed", error=str(exc))

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.publish_snapshot()
            try:
                await asyncio.wait_for(stop.wait(), self.settings.heartbeat_s)
            except TimeoutError:
                pass
