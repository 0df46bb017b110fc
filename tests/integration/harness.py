"""Run services in-process as asyncio tasks, each with its own stop event."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from talaria.shared.settings import Settings


@dataclass
class Running:
    name: str
    task: asyncio.Task
    stop: asyncio.Event

    async def close(self, timeout: float = 30.0) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, timeout)


@dataclass
class Services:
    running: list[Running] = field(default_factory=list)

    async def start(self, name: str, run, settings: Settings, timeout: float = 120.0) -> Running:
        ready, stop = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(run(settings, ready, stop), name=name)
        waiter = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait({task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            waiter.cancel()
            task.result()  # raises the service's startup error
            raise RuntimeError(f"{name} returned before it was ready")
        if waiter not in done:
            waiter.cancel()
            stop.set()
            task.cancel()
            raise TimeoutError(f"{name} not ready after {timeout}s")
        running = Running(name, task, stop)
        self.running.append(running)
        return running

    async def close(self) -> None:
        for r in reversed(self.running):
            with contextlib.suppress(Exception):
                await r.close()
        self.running.clear()


async def wait_rows(conn, sql: str, n: int, *args, timeout: float = 20.0) -> list:
    """Re-query until `sql` returns at least n rows; fail on timeout.

    Telemetry projects events into Postgres asynchronously and publishes no "row written"
    event, so a deadline-bounded re-query is the synchronisation available.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        rows = await conn.fetch(sql, *args)
        if len(rows) >= n:
            return rows
        assert loop.time() < deadline, f"only {len(rows)} of {n} rows for: {sql}"
        await asyncio.sleep(0.05)
