"""DurablePull (shared/durable_pull.py, the router's partition intake and an agent's routed
calls): the consumer is made again from its ack floor after a failed fetch or a reconnect (a
delivery to a pull request that died with a broker node would otherwise come back only after
the ack wait), and the old one is read meanwhile. The subscription and connection are test
doubles: a delivery lost with a node cannot be staged on a real server on cue;
tests/integration/test_durable_pull.py rebuilds a real consumer, test_nats_cluster.py runs the
real failover."""

from __future__ import annotations

import asyncio

import structlog

from talaria.shared import durable_pull
from talaria.shared.durable_pull import DurablePull


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


def pull(old: Sub, fresh: Sub, monkeypatch) -> tuple[DurablePull, list[str]]:
    rebuilt = []

    async def from_ack_floor(api, stream, config, log, start=None, **context):
        rebuilt.append(config)
        return fresh, 7

    monkeypatch.setattr(durable_pull, "from_ack_floor", from_ack_floor)
    return DurablePull(Nc(), None, "EVENTS", "partition-3", old, structlog.get_logger(), 0.0), rebuilt


async def read(intake: DurablePull, halt: asyncio.Event) -> None:
    while not halt.is_set():
        await intake.fetch(64, timeout=1.0)


async def until(done) -> None:
    async def spin():
        while not done():
            await asyncio.sleep(0)
    await asyncio.wait_for(spin(), 5)


async def test_a_failed_fetch_rebuilds_the_consumer_and_reads_the_new_one(monkeypatch):
    fresh = Sub("fresh")
    intake, rebuilt = pull(Sub("old", [RuntimeError("ServiceUnavailableError")]), fresh, monkeypatch)
    halt = asyncio.Event()
    task = asyncio.create_task(read(intake, halt))
    try:
        await until(lambda: fresh.fetches > 0)
    finally:
        halt.set()
        await asyncio.wait_for(task, 5)
    assert rebuilt == ["partition-3"]


async def test_a_reconnect_rebuilds_it_too_and_a_quiet_consumer_is_left_alone(monkeypatch):
    fresh, old = Sub("fresh"), Sub("old")
    intake, rebuilt = pull(old, fresh, monkeypatch)
    halt = asyncio.Event()
    task = asyncio.create_task(read(intake, halt))
    try:
        await until(lambda: old.fetches >= 3)  # timeouts only: nothing to rebuild
        assert rebuilt == []
        intake.nc.stats["reconnects"] += 1
        await until(lambda: fresh.fetches > 0)
    finally:
        halt.set()
        await asyncio.wait_for(task, 5)
    assert rebuilt == ["partition-3"]
