"""Service heartbeats on talaria.health.<service>, so `/healthz` and `talaria up` see who is alive."""

from __future__ import annotations

import asyncio
import time

from talaria.shared.bus import deployment_of
from talaria.shared.subjects import Deployment
from talaria.shared.snapshots import HEARTBEAT_DECODER, ServiceHeartbeat
from talaria.shared.wire import encode

INTERVAL_S = 0.5


async def heartbeat_loop(nc, service: str, stop: asyncio.Event, detail=None) -> None:
    """`detail`: a dict, or a callable returning one, sent with every beat."""
    while not stop.is_set():
        info = (detail() if callable(detail) else detail) or {}
        try:
            await nc.publish(deployment_of(nc).health(service), encode(ServiceHeartbeat(service, time.time(), info)))
        except Exception:
            pass  # reconnecting; the next beat will go out
        try:
            await asyncio.wait_for(stop.wait(), INTERVAL_S)
        except TimeoutError:
            pass


class BusHearing:
    """When did this connection last hear the NATS server answer a PING? A service that judges
    others by their silence (the router) must know when the silence is its own.

    One PING in flight at a time and never timed out: nats-py leaves a timed-out flush's future
    in its PONG queue, and the late PONG then raises inside its read loop, which kills the
    connection's reader for good."""

    NEVER_S = 24 * 3600.0  # the flush timeout: in practice, until the PONG or a closed connection

    def __init__(self, nc, every_s: float, gap_s: float, log=None) -> None:
        """PING every `every_s`; an answer later than `gap_s` after the last one ends a deaf spell."""
        self.nc, self.every_s, self.gap_s, self.log = nc, every_s, gap_s, log
        self.heard_at = self.regained_at = time.time()
        self.deaf_from = self.deaf_until = 0.0  # the last deaf spell (0: none yet)

    def hears(self, now: float) -> bool:
        return now - self.heard_at <= self.gap_s

    def own_silence(self, now: float) -> list[tuple[float, float]]:
        """The stretches (from, until) in which others' silence was ours: the last deaf spell,
        and the one under way, where nothing has answered our PINGs for `gap_s` (the
        connection down, or this process too busy to read: what others sent waits unread)."""
        spells = [(self.deaf_from, self.deaf_until)] if self.deaf_until > 0 else []
        if not self.hears(now):
            spells.append((self.heard_at, now))
        return spells

    def silence_counts_from(self, since: float) -> float:
        """Others' silence counts only from when we could hear again (what they sent while we
        were deaf arrives after our own PONG, so they get their full grace from then)."""
        return max(since, self.regained_at)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.nc.flush(timeout=self.NEVER_S)
            except Exception:
                pass  # closed or reconnecting: not heard; try again
            else:
                now = time.time()
                if now - self.heard_at > self.gap_s:
                    self.deaf_from, self.regained_at, self.deaf_until = self.heard_at, now, now
                    if self.log is not None:
                        self.log.warning("NATS answered again: others' silence counted from now",
                                         deaf_s=round(now - self.heard_at, 2))
                self.heard_at = now
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
            except TimeoutError:
                pass


async def wait_for_router(nc, instances: int, timeout: float = 30.0, deployment: Deployment | None = None) -> None:
    """Until the router of `deployment` (by default: the connection's) reports it has heard
    from at least `instances` instances."""
    sub = await nc.subscribe((deployment or deployment_of(nc)).health("router"))
    try:
        deadline = time.monotonic() + timeout
        while True:
            beat = HEARTBEAT_DECODER.decode((await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))).data)
            if int(beat.detail.get("instances", "0")) >= instances:
                return
    finally:
        await sub.unsubscribe()
