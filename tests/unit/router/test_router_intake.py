"""RouterService._consume: a partition's consumer is made again from its ack floor after a
failed fetch or a reconnect (a delivery to a pull request that died with a broker node would
otherwise come back only after the 30 s ack wait), and the old one is read meanwhile. The
subscription and connection are test doubles: a delivery lost with a node cannot be staged on
a real server on cue; tests/integration/test_nats_cluster.py runs the real failover."""

from __future__ import annotations

import asyncio

import structlog

from talaria.services.router.router_service import RouterService
from talaria.shared.settings import Settings


class Sub:
    """Test double of a pull subscription: fetch answers from `script` (an exception to raise or
    a list of messages), then times out."""

    def __init__(self, name: str, script=()) -> None:
        self.name, self.script, self.fetches = name, list(script), 0

    async def fetch(self, n, timeout):
        self.fetches += 1
        await asyncio.sleep(0)
        if self.script:
            outcome = self.script.pop(0)
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        raise asyncio.TimeoutError

    async def unsubscribe(self):
        pass


class Nc:
    """Test double of the connection: only its reconnect counter is read."""

    def __init__(self) -> None:
        self.stats = {"reconnects": 0}


def service(fresh: Sub) -> tuple[RouterService, list[int]]:
    s = Settings.of()
    svc = RouterService(s.common, s.router, structlog.get_logger())
    svc.nc, rebuilt = Nc(), []

    async def ensure_consumer(p):
        rebuilt.append(p)
        return fresh

    async def handle(msg):
        pass

    svc._ensure_consumer, svc._handle = ensure_consumer, handle
    return svc, rebuilt


async def until(done) -> None:
    async def spin():
        while not done():
            await asyncio.sleep(0)
    await asyncio.wait_for(spin(), 5)


async def test_a_failed_fetch_rebuilds_the_partition_consumer_and_reads_the_new_one():
    fresh = Sub("fresh")
    svc, rebuilt = service(fresh)
    halt = asyncio.Event()
    task = asyncio.create_task(svc._consume(3, Sub("old", [RuntimeError("ServiceUnavailableError")]), halt))
    try:
        await until(lambda: fresh.fetches > 0)
    finally:
        halt.set()
        await asyncio.wait_for(task, 5)
    assert rebuilt == [3]


async def test_a_reconnect_rebuilds_it_too_and_a_quiet_consumer_is_left_alone():
    fresh, old = Sub("fresh"), Sub("old")
    svc, rebuilt = service(fresh)
    halt = asyncio.Event()
    task = asyncio.create_task(svc._consume(3, old, halt))
    try:
        await until(lambda: old.fetches >= 3)  # timeouts only: nothing to rebuild
        assert rebuilt == []
        svc.nc.stats["reconnects"] += 1
        await until(lambda: fresh.fetches > 0)
    finally:
        halt.set()
        await asyncio.wait_for(task, 5)
    assert rebuilt == [3]
