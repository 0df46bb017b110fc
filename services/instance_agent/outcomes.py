"""A call's outcome leaves the agent without holding up the scheduling loop.

The client's reply (and a stream's end) go out on core NATS at once. The durable record
(CallCompleted / CallFailed) is published to JetStream by a background task, after the
call's CallStarted, retried until the stream has it (its message id makes a retry a
no-op), and only then is the call's JetStream message acked. So the engine loop never
waits for a stream ack, and the guarantee is what it was: a call whose record is not
stored is not acked, and a dead agent's call is redelivered.

While a record is being stored, the call is neither running nor finished: the durable copy
of its CallRouted may still arrive (it races the core-NATS fast copy the call ran from),
and must be acked with the record, not run a second time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from talaria.shared.bus import RECONNECT_WAIT_S, emit


class OutcomeSender:
    def __init__(self, nc, js, log, on_stored: Callable[[str], None]) -> None:
        self.nc, self.js, self.log = nc, js, log
        self.on_stored = on_stored  # the call is finished: a later copy of it is acked, not run
        self.storing: dict[str, object] = {}  # call id -> its Running (msg, started_pub)
        self._tasks: set[asyncio.Task] = set()

    def holds(self, call_id: str) -> bool:
        return call_id in self.storing

    def attach(self, call_id: str, msg) -> bool:
        """The durable copy of a call whose record is being stored: acked with it. False
        when the call is not being stored."""
        running = self.storing.get(call_id)
        if running is None:
            return False
        if msg is not None and running.msg is None:
            running.msg = msg
        return True

    async def send(self, call_id: str, running, record: msgspec.Struct,
                   replies: list[tuple[str, bytes]]) -> asyncio.Task:
        """Reply now; store `record` and ack the call's message in the background (the
        returned task; await it to wait for the store)."""
        self.storing[call_id] = running
        for subject, data in replies:
            await self.nc.publish(subject, data)
        task = asyncio.create_task(self._store(call_id, running, record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _store(self, call_id: str, running, record: msgspec.Struct) -> None:
        try:
            await _settled(running.started_pub)  # the record follows the call's start in the stream
            while True:
                try:
                    await emit(self.js, record)
                    break
                except Exception as exc:  # the bus is down: it reconnects; the record must get there
                    self.log.warning("outcome not stored yet; retrying", call_id=call_id, error=str(exc))
                    await asyncio.sleep(RECONNECT_WAIT_S)
        except asyncio.CancelledError:  # shutdown: unacked, so the call is redelivered
            self.storing.pop(call_id, None)
            raise
        self.storing.pop(call_id, None)
        self.on_stored(call_id)  # no await since the pop: a late copy finds it finished
        if running.msg is not None:
            try:
                await running.msg.ack()
            except Exception as exc:  # redelivered later, and acked then as finished
                self.log.warning("ack failed", call_id=call_id, error=str(exc))

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


async def _settled(fut: asyncio.Future | None) -> None:
    """Wait for a background publish; its failure only loses a progress marker."""
    if fut is not None:
        try:
            await fut
        except Exception:
            pass
