"""The runner's outcomes: what the core reports (finished calls, round summaries, switches)
published, a call's completion or failure sent (reply and stream end at once, then its
record: a completion's in the background, outcomes.py) and only once the record is stored
its message acked, and what it remembers of finished calls so a late copy is never run.

A mixin of `CallRunner` (runner.py), like the scheduler's `ColdPool`: it reads the runner's
state (`calls`, `closing`, `finished`, `core`, `engine`, `nc`, `js`) and uses its `_run`.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from opentelemetry import trace

from talaria.services.instance_agent.core import Outcome
from talaria.services.instance_agent.engine import EngineError
from talaria.services.instance_agent.outcomes import settled
from talaria.shared import subjects
from talaria.shared.bus import emit, written
from talaria.shared.events import CallFailed
from talaria.shared.logs import call_context
from talaria.shared.nats_auth import sender_headers
from talaria.shared.messages import CallResult, ErrorReply, Timings, TokenChunk, Usage
from talaria.shared.wire import encode

if TYPE_CHECKING:
    from talaria.services.instance_agent.runner import Running

FINISHED_MEMORY = 10_000
SNAPSHOT_ON_CHANGE_MIN_S = 0.05  # besides the heartbeat, on change, at most this often
IN_PROGRESS_EVERY_S = 20.0


class CallOutcomes:
    # ---- the core's outcomes -----------------------------------------------------------

    async def _events(self, outcome: Outcome) -> None:
        noted = []
        for call_id in outcome.finished:
            try:
                noted.append(await self._complete(call_id))
            except Exception:  # one call's failure must not strand the others (done, held by the engine)
                self.log.exception("completing a call failed", call_id=call_id)
                self.sweep_due = True
        if outcome.finished:
            await written()  # the replies (and records) leave now, in one write, before the bookkeeping
        for note in noted:
            if note is not None:
                note()
        for summary in outcome.rounds:
            self.watchdog.round_ended(summary.wall_s)
            await self.outcomes.note(summary)
        if outcome.switch is not None:
            await self.outcomes.note(outcome.switch)
        for event in outcome.notes:
            # structlog's first argument is already called `event`: name ours `kind`.
            self.log.info("scheduler", kind=type(event).__name__, **{
                k: v for k, v in vars(event).items() if k in ("call_id", "reason", "model")})
        changed = bool(outcome.finished)
        if changed and time.monotonic() - self.last_snapshot >= SNAPSHOT_ON_CHANGE_MIN_S:
            await self.publish_snapshot()  # the router learns of freed capacity and new session KV now

    async def _complete(self, call_id: str):
        """Complete a finished call; returns its bookkeeping (span, log line) for after the
        replies are written, or None."""
        running = self.calls.get(call_id)
        if running is None:
            return None
        deadline = running.routed.call.deadline_at
        if deadline and time.time() >= deadline:  # its client got a 504: never flip that to completed
            if self.released.pop(call_id, None) is None:
                try:
                    await self._run(self.engine.finish, call_id)
                except Exception:
                    pass
            await self._fail(call_id, "finished after its deadline (the client stopped waiting)", status=504,
                             code="deadline_passed")
            return None
        self._close(call_id)
        with call_context(running.routed.call.session_id, call_id):
            try:
                return await self._publish_completion(call_id, running)
            except BaseException:
                self.closing.pop(call_id, None)  # not sent: a redelivery runs it again
                raise

    async def _publish_completion(self, call_id: str, running: Running):
        result = self.released.pop(call_id, None)  # the engine step that finished it released it
        try:
            if result is None:
                result = await self._run(self.engine.finish, call_id)
            elif isinstance(result, EngineError):
                raise result
        except EngineError as exc:
            self.calls[call_id] = self.closing.pop(call_id)
            await self._fail(call_id, f"engine error: {exc}")
            return None
        routed, call, done = running.routed, running.routed.call, time.time()
        via = self.core.records[call_id].via
        completed = self.core.completed(
            call_id, done, prompt_tokens=result.prompt_tokens, output_tokens=len(result.token_ids),
            finish_reason=result.finish_reason, cached_tokens=result.cached_tokens, kv_source=result.kv_source,
            prefill_s=result.prefill_s, decode_s=result.decode_s,
            trace_id=f"{running.span.get_span_context().trace_id:032x}")
        # The record and the reply (and a stream's end) go out now (outcomes.py); the message
        # is acked only once the record is stored, so a crash before that redelivers.
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
            replies.append((subjects.tokens(call.tenant, call_id), encode(TokenChunk(
                call_id, running.streamed, "", done=True, finish_reason=result.finish_reason))))
        await self.outcomes.send(call_id, running.started_pub, completed, replies,
                                 on_stored=lambda: self._closed(call_id, running),
                                 on_dropped=lambda: self.closing.pop(call_id, None))

        def note() -> None:  # once the replies are written: off the path to the client
            running.span.set_attributes({
                "queue_s": completed.queue_s, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
                "cached_tokens": result.cached_tokens, "kv_source": result.kv_source,
                "slot_wait_s": completed.slot_wait_s, "admitted_via": via, "model_opened": completed.model_opened})
            running.span.end()
            with call_context(call.session_id, call_id):
                self.log.info("call completed", tokens=len(result.token_ids), kv_source=result.kv_source,
                              ttft_s=round(completed.ttft_s, 4))

        return note

    async def _fail(self, call_id: str, reason: str, *, status: int = 500, code: str = "engine_error") -> None:
        self.released.pop(call_id, None)
        running = self._close(call_id)
        if running is None:
            return
        try:
            await self._publish_failure(call_id, running, reason, status, code)
        finally:
            self.closing.pop(call_id, None)

    async def _publish_failure(self, call_id: str, running: Running, reason: str, status: int, code: str) -> None:
        routed, call = running.routed, running.routed.call
        self.core.forget(call_id)
        with call_context(call.session_id, call_id):
            self.log.error("call failed", reason=reason)
        running.span.set_status(trace.Status(trace.StatusCode.ERROR, reason))
        running.span.end()
        await settled(running.started_pub)
        sends = [emit(self.js, CallFailed(call_id, call.session_id, call.model, reason, "agent", time.time(),
                                          status=status, instance_id=self.instance_id,
                                          call_index=routed.call_index))]
        if call.reply_to:
            retry = 1.0 if status == 503 else None  # 503: placed elsewhere it can run
            sends.append(self.nc.publish(call.reply_to, encode(ErrorReply(status, code, reason, call_id=call_id,
                                                                          retry_after_s=retry)),
                                         headers=sender_headers(self.nc)))
        if call.stream:
            sends.append(self.nc.publish(subjects.tokens(call.tenant, call_id), encode(TokenChunk(
                call_id, running.streamed, "", done=True, finish_reason=code)), headers=sender_headers(self.nc)))
        await asyncio.gather(*sends)
        await self._closed(call_id, running)

    def _close(self, call_id: str) -> Running | None:
        """Take a call out of `calls` while its outcome is published (see `closing`)."""
        running = self.calls.pop(call_id, None)
        if running is not None:
            self.closing[call_id] = running
        return running

    async def _closed(self, call_id: str, running: Running) -> None:
        """Its outcome is out: finished from now on, and its message (the durable copy may
        have been attached while it was closing) acked."""
        self.closing.pop(call_id, None)
        self._remember(call_id)
        if running.msg is not None:
            await running.msg.ack()

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


def merge_outcomes(into: Outcome, more: Outcome) -> None:
    into.finished += more.finished
    into.rounds += more.rounds
    into.notes += more.notes


