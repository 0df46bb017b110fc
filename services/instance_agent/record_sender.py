"""A finished call's record is stored without holding up the scheduling loop.

The durable record (CallCompleted) is published to JetStream first, without waiting for its
ack, so it reaches the stream ahead of anything the client does next (the router learns of
the completion before the session's next call); the client's reply (and a stream's end) go
out on core NATS right after (and again if the connection dropped before the server confirmed
them: a broker restart must not leave a client waiting for its timeout). A background task waits for the record's ack, publishing it
again until the stream has it (its message id makes a retry a no-op), and only then is
`on_stored` run (the runner's `_closed`: the call counts as finished and its
JetStream message is acked). So the engine loop never waits for a stream ack, and the
guarantee is what it was: a call whose record is not stored is not acked, and a dead
agent's call is redelivered. While the record is stored the call is `closing`: a copy of
it arriving then is attached and acked with it (runner.accept). Scheduler records
(RoundSummary, SwitchDone) go out the same way (`note`), without the loop waiting for acks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec

from talaria.shared.bus import (ATTEMPT_S, BUS_ERRORS, PUBLISH_TIMEOUT_S, RECONNECT_WAIT_S, emit, emit_async,
                                event_msg_id)
from talaria.shared.nats_auth import sender_headers


class RecordSender:
    def __init__(self, nc, js, log) -> None:
        self.nc, self.js, self.log = nc, js, log
        self._tasks: set[asyncio.Task] = set()

    async def send(self, call_id: str, started_pub: asyncio.Future | None, record: msgspec.Struct,
                   replies: list[tuple[str, bytes]], on_stored: Callable[[], Awaitable[None]],
                   on_dropped: Callable[[], None]) -> asyncio.Task:
        """Publish `record`, reply, and wait for the record's ack in the background, then
        `on_stored()`. `on_dropped()` runs instead when the store is given up (the agent
        stops): the call stays unacked. Returns the task (await it to wait for the store)."""
        try:
            ack = await emit_async(self.js, record)
        except BUS_ERRORS as exc:  # not even queued (the connection is closed): the task retries
            ack = asyncio.get_running_loop().create_future()
            ack.set_exception(exc)
        reconnects = self.nc.stats["reconnects"]
        await self._reply(replies)
        task = asyncio.create_task(self._store(call_id, started_pub, record, ack, on_stored, on_dropped,
                                               replies, reconnects))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def note(self, event: msgspec.Struct) -> None:
        """Publish a scheduler record (RoundSummary, SwitchDone) without holding up the loop for
        its ack: a background task waits for it. As when the loop waited, a record the stream
        refuses is logged and lost (it carries no message id that would make a retry safe)."""
        try:
            ack = await emit_async(self.js, event)
        except BUS_ERRORS as exc:
            self.log.warning("scheduler record not published", kind=type(event).__name__, error=str(exc))
            return
        task = asyncio.create_task(self._noted(event, ack))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _noted(self, event, ack) -> None:
        try:
            await asyncio.wait_for(ack, PUBLISH_TIMEOUT_S)
        except BUS_ERRORS as exc:
            self.log.warning("scheduler record not stored", kind=type(event).__name__, error=str(exc))

    async def _reply(self, replies: list[tuple[str, bytes]]) -> None:
        for subject, data in replies:
            await self.nc.publish(subject, data, headers=sender_headers(self.nc))  # readers check it

    async def _delivered(self, call_id: str, replies: list[tuple[str, bytes]], reconnects: int) -> None:
        """Make sure the replies reached the server: a PONG answered after them on the same
        connection. A reconnect since they were published may have dropped them (bytes written
        to a socket the broker never read): publish them again. A duplicate is harmless (the
        gateway takes the first; the kept copy is the same answer)."""
        while True:
            try:
                await self.nc.flush(timeout=PUBLISH_TIMEOUT_S)
                if self.nc.stats["reconnects"] == reconnects:
                    return
            except asyncio.CancelledError:
                raise
            except BUS_ERRORS:  # disconnected: wait for the client to reconnect
                await asyncio.sleep(RECONNECT_WAIT_S)
                continue
            reconnects = self.nc.stats["reconnects"]
            self.log.info("replies sent again after a reconnect", call_id=call_id)
            try:
                await self._reply(replies)
            except BUS_ERRORS:
                await asyncio.sleep(RECONNECT_WAIT_S)

    async def _store(self, call_id: str, started_pub, record, ack, on_stored, on_dropped,
                     replies=(), reconnects: int = 0) -> None:
        try:
            await settled(started_pub)
            try:
                # Its message id makes a second copy a no-op: past ATTEMPT_S the ack is taken as
                # lost (a stream leader cut off) and the record sent again, as the router's
                # outputs are. The session's next call waits for this record.
                await asyncio.wait_for(ack, ATTEMPT_S if event_msg_id(record) else PUBLISH_TIMEOUT_S)
            except BUS_ERRORS as exc:  # lost or refused: publish it again until it is stored
                self.log.warning("outcome not stored yet; retrying", call_id=call_id, error=str(exc))
                while True:
                    try:
                        await emit(self.js, record)
                        break
                    except BUS_ERRORS as exc:  # the bus is down: it reconnects; the record must get there
                        self.log.warning("outcome not stored yet; retrying", call_id=call_id, error=str(exc))
                        await asyncio.sleep(RECONNECT_WAIT_S)
        except asyncio.CancelledError:  # the agent stops: unacked, so the call is redelivered
            on_dropped()
            raise
        try:
            await on_stored()
        except Exception as exc:  # e.g. the ack: redelivered later, and acked then as finished
            self.log.warning("acking a stored outcome failed", call_id=call_id, error=str(exc))
        if replies:
            await self._delivered(call_id, list(replies), reconnects)

    async def drain(self, timeout: float) -> None:
        """Wait for the records in flight (at shutdown); those not stored by `timeout` stay
        unacked, so their calls are redelivered."""
        tasks = list(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def settled(fut: asyncio.Future | None) -> None:
    """Wait for a background publish; its failure only loses a progress marker."""
    if fut is not None:
        try:
            await fut
        except BUS_ERRORS:
            pass
