"""Service heartbeats on talaria.health.<service>, so `/healthz` and `talaria up` see who is alive."""

from __future__ import annotations

import asyncio
import time

from shared import subjects
from shared.messages import ServiceHeartbeat, encode

INTERVAL_S = 0.5


async def heartbeat_loop(nc, service: str, stop: asyncio.Event, detail: dict[str, str] | None = None) -> None:
    while not stop.is_set():
        try:
            await nc.publish(subjects.health(service), encode(ServiceHeartbeat(service, time.time(), detail or {})))
        except Exception:
            pass  # reconnecting; the next beat will go out
        try:
            await asyncio.wait_for(stop.wait(), INTERVAL_S)
        except TimeoutError:
            pass
