"""Service heartbeats on talaria.health.<service>, so `/healthz` and `talaria up` see who is alive."""

from __future__ import annotations

import asyncio
import time

from talaria.shared import subjects
from talaria.shared.snapshots import ServiceHeartbeat
from talaria.shared.wire import encode

INTERVAL_S = 0.5


async def heartbeat_loop(nc, service: str, stop: asyncio.Event, detail=None) -> None:
    """`detail`: a dict, or a callable returning one, sent with every beat."""
    while not stop.is_set():
        info = (detail() if callable(detail) else detail) or {}
        try:
            await nc.publish(subjects.health(service), encode(ServiceHeartbeat(service, time.time(), info)))
        except Exception:
            pass  # reconnecting; the next beat will go out
        try:
            await asyncio.wait_for(stop.wait(), INTERVAL_S)
        except TimeoutError:
            pass


async def wait_for_router(nc, instances: int, timeout: float = 30.0) -> None:
    """Until the router reports it has heard from at least `instances` instances."""
    from talaria.shared.snapshots import HEARTBEAT_DECODER

    sub = await nc.subscribe(subjects.health("router"))
    try:
        deadline = time.monotonic() + timeout
        while True:
            beat = HEARTBEAT_DECODER.decode((await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))).data)
            if int(beat.detail.get("instances", "0")) >= instances:
                return
    finally:
        await sub.unsubscribe()
