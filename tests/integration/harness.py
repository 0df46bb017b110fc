"""Run services in-process as asyncio tasks, each with its own stop event."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from dataclasses import dataclass, field

from talaria.shared.settings import Settings
from talaria.shared.snapshots import HEARTBEAT_DECODER
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names


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

    async def start_control_plane(self, settings: Settings) -> None:
        """Telemetry, router and gateway, in the order they depend on each other; the tests
        add the agents they need."""
        from talaria.services.gateway.gateway_service import run as run_gateway
        from talaria.services.router.router_service import run as run_router
        from talaria.services.telemetry.telemetry_service import run as run_telemetry

        await self.start("telemetry", run_telemetry, settings)
        await self.start("router", run_router, settings)
        await self.start("gateway", run_gateway, settings)

    async def close(self) -> None:
        for r in reversed(self.running):
            with contextlib.suppress(Exception):
                await r.close()
        self.running.clear()


async def wait_until(probe, what: str, timeout: float = 20.0, every: float = 0.05):
    """Re-run the async `probe` until it returns something truthy (returned); fail on timeout.

    For state another process owns and announces with no event (rows telemetry projected,
    a consumer's ack floor, a lock wait, an endpoint's readiness): a deadline-bounded
    re-read is the synchronisation available.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await probe()
        if value:
            return value
        assert loop.time() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(every)


async def acked(js, durable: str, seq: int) -> bool:
    """Whether consumer `durable` has acknowledged every event up to stream sequence `seq`."""
    return (await js.consumer_info(DEP.events_stream, durable)).ack_floor.stream_seq >= seq


async def wait_rows(conn, sql: str, n: int, *args, timeout: float = 20.0) -> list:
    """Re-query until `sql` returns at least n rows; fail on timeout."""
    async def enough():
        rows = await conn.fetch(sql, *args)
        return rows if len(rows) >= n else None

    return await wait_until(enough, f"{n} rows for: {sql}", timeout)


class Owners:
    """Each router's partitions, as its heartbeats say; waiters for a condition on them."""

    def __init__(self) -> None:
        self.by_router: dict[str, set[int]] = {}
        self.changed = asyncio.Event()

    async def on_beat(self, msg) -> None:
        beat = HEARTBEAT_DECODER.decode(msg.data)
        parts = beat.detail.get("partitions", "")
        self.by_router[beat.detail.get("router_id", "")] = {int(p) for p in parts.split(",") if p}
        self.changed.set()

    async def until(self, condition, timeout: float) -> None:
        async def wait():
            while not condition(self.by_router):
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(wait(), timeout)


def stop_process(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM a service process still running, then SIGKILL it if it outlives the grace."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
