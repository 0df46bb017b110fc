"""The router's outputs on their way to the stream: published in the order the state applied
them (the stream stores them in that order), their acks awaited while the next input is
folded, the input acked once all of them are stored, a rejected client answered.

A part of `RouterService` (router_service.py): it owns the tasks storing folded inputs'
outputs, and tells the service the highest stream sequence stored (`on_stored`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from talaria.shared.bus import BUS_ERRORS, ATTEMPT_S, PUBLISH_TIMEOUT_S, RECONNECT_WAIT_S, emit, emit_async, event_msg_id
from talaria.shared.events import DEADLINE_UNREACHABLE, CallFailed, CallSubmitted
from talaria.shared.messages import ErrorReply
from talaria.shared.metrics import RouterMetrics
from talaria.shared.nats_auth import sender_headers
from talaria.shared.wire import encode


class RouterOutputs:
    def __init__(self, js, nc, log, policy_config, on_stored: Callable[[int], None],
                 metrics: RouterMetrics | None = None) -> None:
        self.js, self.nc, self.log = js, nc, log
        self.metrics = metrics or RouterMetrics()  # every output is shown to it in `start`
        self.policy_config = policy_config  # its retry_after_s is what a rejected client is told
        self.on_stored = on_stored
        self.storing: set[asyncio.Task] = set()  # inputs' outputs being stored (then the input is acked)

    def store_then_ack_soon(self, outputs, acks, msg) -> None:
        """Wait for the outputs' acks in the background (the next input is folded meanwhile),
        then ack the input."""
        task = asyncio.create_task(self._store_then_ack(outputs, acks, msg))
        self.storing.add(task)
        task.add_done_callback(self.storing.discard)

    def ack_after_stored(self, msg) -> None:
        """Ack an input that made no outputs once every output already on its way is stored.
        A redelivered copy of an input decided a moment ago (a consumer rebuilt from its ack
        floor) makes none: acked at once, it would ack the stream position while the first
        copy's outputs may still be unstored, and a crash then would lose that call."""
        if not self.storing:
            task = asyncio.create_task(_acked(msg, self.log))
        else:
            task = asyncio.create_task(self._after(list(self.storing), msg))
        self.storing.add(task)
        task.add_done_callback(self.storing.discard)

    async def _after(self, before, msg) -> None:
        await asyncio.gather(*before, return_exceptions=True)
        await _acked(msg, self.log)

    def store_soon(self, outputs, acks) -> None:
        """Wait for the outputs' acks in the background (reactions to an event the view read:
        there is no input to ack)."""
        task = asyncio.create_task(self._stored(outputs, acks))
        self.storing.add(task)
        task.add_done_callback(self.storing.discard)

    async def cancel_pending(self) -> None:
        """At stop: outputs not stored leave their inputs unacked, so they come back."""
        for task in self.storing:
            task.cancel()
        await asyncio.gather(*self.storing, return_exceptions=True)

    async def _store_then_ack(self, outputs, acks, msg) -> None:
        started = time.perf_counter()
        await self._stored(outputs, acks)
        self.metrics.phase.labels("store").observe(time.perf_counter() - started)
        await _acked(msg, self.log)

    async def publish_all(self, outputs) -> None:
        await self._stored(outputs, await self.start(outputs))

    async def start(self, outputs) -> list:
        """Publish each output now, in order (the stream stores them in that order); the
        futures of their acks. Never raises: a publish that could not start is retried."""
        self.metrics.observe_all(outputs)  # every output goes out here, once
        acks = []
        for out in outputs:
            try:
                acks.append(await emit_async(self.js, out))
            except BUS_ERRORS as exc:
                failed = asyncio.get_running_loop().create_future()
                failed.set_exception(exc)
                acks.append(failed)
        return acks

    async def _stored(self, outputs, acks) -> None:
        """Wait until every output is stored: the input waits for the slowest ack, not the sum
        of them. They are facts already folded into the state, and their message ids make a
        retry (or a redelivered input's republish) a no-op."""
        seqs = []
        for out, ack in zip(outputs, acks):
            try:
                # With a message id (a second copy is a no-op), past ATTEMPT_S the ack is taken
                # as lost (a stream leader's failover) and the output published again.
                wait_s = ATTEMPT_S if event_msg_id(out) else PUBLISH_TIMEOUT_S
                seqs.append((await asyncio.wait_for(ack, wait_s)).seq)
            except asyncio.CancelledError:
                raise
            except BUS_ERRORS as exc:
                self.log.warning("publish failed; retrying", kind=type(out).__name__, error=str(exc))
                seqs.append(await self._publish_one(out))
        if seqs:
            self.on_stored(max(seqs))
        for out in outputs:
            if isinstance(out, CallFailed) and out.reply_to:
                await self._reply_failed(out)  # a rejection, or a lost instance's call

    async def _publish_one(self, out) -> int:
        while True:
            try:
                return await emit(self.js, out)
            except BUS_ERRORS as exc:
                self.log.warning("publish failed; retrying", kind=type(out).__name__, error=str(exc))
                await asyncio.sleep(RECONNECT_WAIT_S)  # back off while NATS recovers

    async def _reply_failed(self, failed: CallFailed) -> None:
        """The router owes this client its answer: a rejection, or its agent was lost."""
        retry = getattr(self.policy_config, "retry_after_s", 1.0)
        code = "no_capacity" if failed.stage == "router" else "instance_lost"
        if failed.status == DEADLINE_UNREACHABLE:  # retrying the same call cannot help
            code, retry = "deadline_unreachable", None
        try:
            await self.nc.publish(failed.reply_to, encode(
                ErrorReply(failed.status, code, failed.reason, retry_after_s=retry, call_id=failed.call_id)),
                headers=sender_headers(self.nc))
        except BUS_ERRORS as exc:  # the failure is recorded; the gateway's timeout answers the client
            self.log.warning("could not answer the client", call_id=failed.call_id, error=str(exc))

    async def refuse_reused(self, call: CallSubmitted) -> None:
        """A new call under the id of one already decided: answered 409, and nothing is folded
        or recorded for it (its rows belong to the first call of that id)."""
        self.log.warning("call id reused by a new submission; refused", call_id=call.call_id)
        if not call.reply_to:
            return
        try:
            await self.nc.publish(call.reply_to, encode(ErrorReply(
                409, "duplicate_call_id", f"call id {call.call_id} was already used for an earlier call; "
                "send each call with a new `call_id`", param="call_id", call_id=call.call_id)),
                headers=sender_headers(self.nc))
        except BUS_ERRORS as exc:  # the gateway's timeout answers the client
            self.log.warning("could not answer the client", call_id=call.call_id, error=str(exc))

    async def all_stored(self, timeout: float) -> bool:
        """Wait up to `timeout` until every folded input's outputs are stored (a projection
        saved before that would count outputs the stream lacks)."""
        if not self.storing:
            return True
        _, pending = await asyncio.wait(list(self.storing), timeout=timeout)
        if pending:  # a restart replays this state instead
            self.log.warning("projection not saved: outputs still unstored", inputs=len(pending))
        return not pending


async def _acked(msg, log) -> None:
    try:
        await msg.ack()
    except BUS_ERRORS as exc:  # redelivered; the core skips it as already handled
        log.warning("ack failed", subject=msg.subject, error=str(exc))
