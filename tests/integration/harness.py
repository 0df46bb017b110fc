"""Run services in-process as asyncio tasks, each with its own stop event."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from shared.settings import Settings


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

