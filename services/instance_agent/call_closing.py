"""The runner's closer: what the core reports (finished calls, round summaries, switches)
published, a call's completion or failure sent (reply and stream end at once, then its
record: a completion's in the background, record_sender.py) and only once the record is
stored its message acked and the call ended in the core's table (FINISHED), so a late copy is
never run.

A part of `CallRunner` (runner.py): it owns the record sender; the calls are the core's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from opentelemetry import trace

from talaria.services.instance_agent.call_transport import CallTransport
from talaria.services.instance_agent.agent_core import AgentCall, AgentCore, Phase, StepReport
from talaria.services.instance_agent.engine import EngineError
from talaria.services.instance_agent.engine_thread import EngineThread
from talaria.services.instance_agent.record_sender import RecordSender, settled
from talaria.services.instance_agent.watchdog import Watchdog
from talaria.shared.subjects import Deployment
from talaria.shared.bus import BUS_ERRORS, emit, written
from talaria.shared.events import CallFailed
from talaria.shared.logs import call_context
from talaria.shared.nats_auth import sender_headers
from talaria.shared.messages import CallResult, ErrorReply, Timings, TokenChunk, Usage
from talaria.shared.wire import encode

class CallCloser:
    def __init__(self, core: AgentCore, thread: EngineThread, watchdog: Watchdog, nc, js, instance_id: str, log,
                 on_change: Callable[[], Awaitable[None]], deployment: Deployment) -> None:
        self.core, self.thread, self.watchdog = core, thread, watchdog
        self.engine = thread.engine
        self.nc, self.js, self.instance_id, self.log = nc, js, instance_id, log
        self.deployment = deployment
        self.on_change = on_change  # calls finished: the router should hear of the freed capacity
        self.sender = RecordSender(nc, js, log)  # completion records stored off the loop

    # ---- the core's reports ------------------------------------------------------------

    async def events(self, report: StepReport) -> None:
        noted = []
        for call_id in report.finished:
            try:
                noted.append(await self.complete(call_id))
            except Exception:  # one call's failure must not strand the others (done, held by the engine)
                self.log.exception("completing a call failed", call_id=call_id)
        if report.finished:
            await written()  # the replies (and records) leave now, in one write, before the bookkeeping
        for note in noted:
            if note is not None:
                note()
        for summary in report.rounds:
            self.watchdog.round_ended(summary.wall_s)
            await self.sender.note(summary)
        if report.switch is not None:
            await self.sender.note(report.switch)
        for event in report.notes:
            # structlog's first argument is already called `event`: name ours `kind`.
            self.log.info("scheduler", kind=type(event).__name__, **{
                k: v for k, v in vars(event).items() if k in ("call_id", "reason", "model")})
        if report.finished:
            await self.on_change()

    async def complete(self, call_id: str):
        """Complete a finished call; returns its bookkeeping (span, log line) for after the
        replies are written, or None."""
        call = self.core.live_call(call_id)
        if call is None:
            return None
        transport = call.transport
        deadline = transport.routed.call.deadline_at
        if deadline and time.time() >= deadline:  # its client got a 504: never flip that to completed
            if transport.released is False:
                try:
                    await self.thread.run(self.engine.finish, transport.seq)
                except EngineError:
                    pass  # the engine released it already
                transport.in_engine = False
            await self.fail(call_id, "finished after its deadline (the client stopped waiting)", status=504,
                            code="deadline_passed")
            return None
        self.core.close(call_id)
        with call_context(transport.routed.call.session_id, call_id):
            try:
                return await self._publish_completion(call, transport)
            except BaseException:
                self.core.forget(call_id)  # not sent: a redelivery runs it again
                if transport.in_engine:
                    self.thread.release_soon(transport.seq)
                raise

    async def _publish_completion(self, call: AgentCall, transport: CallTransport):
        call_id = call.call_id
        released, transport.released = transport.released, False  # the engine step that finished it released it
        try:
            if released is False:
                await self.thread.run(self.engine.finish, transport.seq)
            elif isinstance(released, EngineError):
                raise released
        except EngineError as exc:
            transport.in_engine = False
            self.core.reopen(call_id)
            await self.fail(call_id, f"engine error: {exc}")
            return None
        transport.in_engine = False
        result = transport.seq  # released: what the engine computed for the call
        routed, request, done = transport.routed, transport.routed.call, time.time()
        via = call.via
        completed = self.core.completed(
            call_id, done, prompt_tokens=result.prompt_tokens, output_tokens=len(result.token_ids),
            finish_reason=result.finish_reason, cached_tokens=result.cached_tokens, kv_source=result.kv_source,
            prefill_s=result.prefill_s, decode_s=result.decode_s,
            trace_id=f"{transport.span.get_span_context().trace_id:032x}",
            **_migrated(transport.migrated if result.kv_source == "migrated" else None))
        # The record and the reply (and a stream's end) go out now (record_sender.py); the message
        # is acked only once the record is stored, so a crash before that redelivers.
        replies = []
        if request.reply_to:
            n_out = len(result.token_ids)
            replies.append((request.reply_to, encode(CallResult(
                call_id=call_id, session_id=request.session_id, call_index=routed.call_index, model=request.model,
                instance_id=self.instance_id, text=result.text, finish_reason=result.finish_reason,
                usage=Usage(result.prompt_tokens, n_out, result.prompt_tokens + n_out, result.cached_tokens),
                timings=Timings(completed.queue_s, completed.ttft_s, result.prefill_s, result.decode_s,
                                completed.slot_wait_s, done - request.submitted_at),
                kv_source=result.kv_source, stop_sequence=result.stop_sequence, logprobs=result.logprobs,
            ))))
        if request.stream:
            replies.append((self.deployment.tokens(request.tenant, call_id), encode(TokenChunk(
                call_id, transport.streamed, "", done=True, finish_reason=result.finish_reason))))
        await self.sender.send(call_id, transport.started_pub, completed, replies,
                               on_stored=lambda: self._closed(call_id, transport),
                               on_dropped=lambda: self.core.forget(call_id))

        def note() -> None:  # once the replies are written: off the path to the client
            transport.span.set_attributes({  # the GenAI usage keys; ours under talaria. (shared/tracing.py)
                "gen_ai.usage.input_tokens": completed.prompt_tokens,
                "gen_ai.usage.output_tokens": completed.output_tokens,
                "gen_ai.usage.cache_read.input_tokens": result.cached_tokens,
                "talaria.queue_s": completed.queue_s, "talaria.prefill_s": result.prefill_s,
                "talaria.decode_s": result.decode_s, "talaria.kv_source": result.kv_source,
                "talaria.slot_wait_s": completed.slot_wait_s, "talaria.admitted_via": via,
                "talaria.model_opened": completed.model_opened, "talaria.migrated_bytes": completed.migrated_bytes,
                "talaria.migrate_s": completed.migrate_s})
            transport.span.end()
            with call_context(request.session_id, call_id):
                self.log.info("call completed", tokens=len(result.token_ids), kv_source=result.kv_source,
                              ttft_s=round(completed.ttft_s, 4))

        return note

    async def fail(self, call_id: str, reason: str, *, status: int = 500, code: str = "engine_error") -> None:
        """Record a live call failed and answer its client; what the engine holds of it is
        released after the step in flight."""
        call = self.core.close(call_id)
        if call is None:
            return
        transport = call.transport
        transport.released = False
        if transport.pull is not None and transport.pull is not asyncio.current_task():
            transport.pull.cancel()  # its pages were on the way (kv_migration.py): the transfer stops with it
        if transport.in_engine:
            self.thread.release_soon(transport.seq)
            transport.in_engine = False
        try:
            await self._publish_failure(call_id, transport, reason, status, code)
        finally:
            if call.phase is Phase.CLOSING:  # not published: forgotten (a redelivery runs it again)
                self.core.forget(call_id)

    async def _publish_failure(self, call_id: str, transport: CallTransport, reason: str, status: int,
                               code: str) -> None:
        routed, request = transport.routed, transport.routed.call
        with call_context(request.session_id, call_id):
            self.log.error("call failed", reason=reason)
        transport.span.set_status(trace.Status(trace.StatusCode.ERROR, reason))
        transport.span.end()
        await settled(transport.started_pub)
        sends = [emit(self.js, CallFailed(call_id, request.session_id, request.model, reason, "agent", time.time(),
                                          status=status, instance_id=self.instance_id,
                                          call_index=routed.call_index))]
        if request.reply_to:
            retry = 1.0 if status == 503 else None  # 503: placed elsewhere it can run
            sends.append(self.nc.publish(request.reply_to, encode(ErrorReply(status, code, reason, call_id=call_id,
                                                                             retry_after_s=retry)),
                                         headers=sender_headers(self.nc)))
        if request.stream:
            sends.append(self.nc.publish(self.deployment.tokens(request.tenant, call_id), encode(TokenChunk(
                call_id, transport.streamed, "", done=True, finish_reason=code)), headers=sender_headers(self.nc)))
        await asyncio.gather(*sends)
        await self._closed(call_id, transport)

    async def _closed(self, call_id: str, transport: CallTransport) -> None:
        """Its outcome is out: finished from now on, and its message (the durable copy may
        have been attached while it was closing) acked."""
        self.core.end(call_id)
        if transport.msg is not None:
            await transport.msg.ack()

    async def progress_loop(self, stop: asyncio.Event, every_s: float) -> None:
        """Tell JetStream every `every_s` that held calls are still being worked on, so none is
        redelivered while it waits for its slot (the consumer's ack_wait is shorter than a long queue)."""
        while not stop.is_set():
            for call in list(self.core.live()):
                try:
                    if call.transport.msg is not None:
                        await call.transport.msg.in_progress()
                except BUS_ERRORS:
                    pass
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                pass


def _migrated(m) -> dict:
    """A migrated call's pull, as CallCompleted records it."""
    return {} if m is None else {"migrated_bytes": m.bytes, "migrate_s": m.seconds}
