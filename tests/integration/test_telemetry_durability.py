"""Telemetry acks an event only once its transaction is durable: Postgres killed with an
immediate shutdown (as `pg_ctl stop -m immediate`) right after the acks loses no row, even
on a server running with synchronous_commit=off (as the embedded one does). Issue 15 lost
decision rows this way."""

from __future__ import annotations

import asyncio
import signal

import asyncpg
import pytest

from talaria.embedded import EmbeddedPostgres
from talaria.services.telemetry.telemetry_service import run as run_telemetry
from talaria.shared.events import CandidateCost, RoutingDecision
from talaria.shared.bus import connect, emit
from talaria.shared.nats_auth import owner_sender
from talaria.shared.db.connection import upgrade
from talaria.shared.settings import Settings, asyncpg_dsn
from tests.integration.harness import Services, acked, wait_until

pytestmark = pytest.mark.integration

N = 40


def decision(i: int) -> RoutingDecision:
    return RoutingDecision(f"d{i}", "s1", i, "qwen3-tiny", "least-loaded", "route", 100.0 + i, chosen="agent-0",
                             candidates=[CandidateCost("agent-0", 0.5)])


async def test_acked_events_survive_an_immediate_postgres_shutdown(nats_url, tmp_path):
    pg = await asyncio.to_thread(EmbeddedPostgres(tmp_path / "pg", database="talaria").start)
    services = Services()
    nc, js = await connect(nats_url, "test")
    try:
        await asyncio.to_thread(upgrade, pg.url)
        settings = Settings.of(nats_url=nats_url, database_url=pg.url, data_dir=tmp_path, session_idle_s=3600)
        await services.start("telemetry", run_telemetry, settings)
        last = 0
        for i in range(N):
            last = await emit(js, decision(i), sender=owner_sender(decision(i)))
        await wait_until(lambda: acked(js, "telemetry", last), "the events to be acked", timeout=30, every=0.005)
        pg.proc.send_signal(signal.SIGQUIT)  # immediate shutdown: no checkpoint, unflushed WAL is gone
        await asyncio.to_thread(pg.proc.wait, 30)
        await services.close()
        await asyncio.to_thread(pg.start)  # crash recovery replays the durable WAL
        conn = await asyncpg.connect(asyncpg_dsn(pg.url))
        try:
            assert await conn.fetchval("SELECT count(*) FROM lease_decisions") == N
        finally:
            await conn.close()
    finally:
        await services.close()
        await nc.close()
        await asyncio.to_thread(pg.stop)
