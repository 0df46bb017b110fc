"""Telemetry projects the event stream into Postgres, exactly once, over real NATS + Postgres."""

import asyncio

import asyncpg
import pytest

from talaria.services.telemetry.telemetry_service import run as run_telemetry
from talaria.shared.events import (
    CallCompleted,
    CallFailed,
    CallRouted,
    CallSubmitted,
    CandidateCost,
    LeaseExpired,
    LeaseIssued,
    RoutingDecision,
)
from talaria.shared.wire import encode
from talaria.shared.bus import connect, event_subject, publish_event
from talaria.shared.bus import emit as emit_as
from talaria.shared.nats_auth import owner_sender
from talaria.shared.settings import Settings, asyncpg_dsn
from tests.integration.harness import Services, acked, wait_rows, wait_until
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names


async def lock_waits(db) -> int:
    """Transactions waiting for the test's lock on `calls` (the projection's, held mid-batch)."""
    return await db.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'calls'::regclass")

pytestmark = pytest.mark.integration


async def emit(js, event):
    """Publish as the service that owns the event (the projector drops anyone else's)."""
    return await emit_as(js, event, sender=owner_sender(event))


def submitted(call_id, index_hint=0):
    return CallSubmitted(call_id=call_id, session_id="s1", model="qwen3-tiny", prompt_ids=[256, 1, 2],
                           block_hashes=[], max_tokens=4, submitted_at=100.0 + index_hint)


async def test_calls_and_decisions_are_projected_once_even_when_replayed(nats_url, database_url, db, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, session_idle_s=3600)
    nc, js = await connect(nats_url, "test")
    for i in range(3):
        await emit(js, submitted(f"c{i}", i))
        await emit(js, RoutingDecision(f"c{i}", "s1", i, "qwen3-tiny", "least-loaded", "route", 100.0 + i,
                                         chosen="agent-0", candidates=[CandidateCost("agent-0", 0.5)]))
        await emit(js, CallRouted(call=submitted(f"c{i}", i), call_index=i, instance_id="agent-0",
                                    policy="least-loaded", routed_at=100.1 + i))
        # the last call's prefix was pulled from another instance (issue 40): bytes and seconds kept
        moved = dict(kv_source="migrated", migrated_bytes=4096, migrate_s=0.25) if i == 2 else dict(kv_source="device")
        await emit(js, CallCompleted(f"c{i}", "s1", i, "qwen3-tiny", "agent-0", 3, 4, "length",
                                       100.0 + i, 100.2 + i, 100.3 + i, 100.5 + i, **moved))
    await emit(js, LeaseIssued("s1", "qwen3-tiny", "agent-0", "c2", 102.5, 103.5))
    services = Services()
    try:
        await services.start("telemetry", run_telemetry, settings)
        rows = await wait_rows(db, "SELECT * FROM calls WHERE outcome='completed' ORDER BY call_index", 3)
        assert [r["call_index"] for r in rows] == [0, 1, 2]
        assert all(r["instance_id"] == "agent-0" and r["output_tokens"] == 4 for r in rows)
        assert rows[0]["ttft_s"] is not None
        assert [(r["kv_source"], r["migrated_bytes"], r["migrate_s"]) for r in rows] == [
            ("device", 0, 0.0), ("device", 0, 0.0), ("migrated", 4096, 0.25)]
        decisions = await wait_rows(db, "SELECT * FROM lease_decisions WHERE outcome='completed'", 3)
        assert sorted(d["kv_source"] for d in decisions) == ["device", "device", "migrated"]
        leases = await wait_rows(db, "SELECT * FROM lease_events", 1)
        assert leases[0]["kind"] == "issued"
        await services.close()
        # Lose the consumer's acks (as if telemetry died after committing): every event is
        # delivered again, and the committed offset must keep anything from counting twice.
        await js.delete_consumer(DEP.events_stream, "telemetry")
        await services.start("telemetry", run_telemetry, settings)
        await emit(js, CallFailed("c9", "s1", "qwen3-tiny", "gateway timeout", "gateway", 110.0, status=504))
        failed = await wait_rows(db, "SELECT * FROM calls WHERE call_id='c9'", 1)
        assert failed[0]["outcome"] == "failed" and failed[0]["failed_stage"] == "gateway"
        session = await db.fetchrow("SELECT * FROM sessions WHERE session_id='s1'")
        assert (session["calls"], session["completed"], session["failed"]) == (3, 3, 1)
    finally:
        await services.close()
        await nc.close()


async def republish(js, event) -> int:
    """Publish an event again as a new stream message (past JetStream's msg-id dedupe),
    as a retried publisher or a replay would."""
    return await publish_event(js, event_subject(DEP, event), event, sender=owner_sender(event))


def completed(call_id, at=100.5, session="s1"):
    return CallCompleted(call_id, session, 0, "qwen3-tiny", "agent-0", 3, 4, "length", 100.0, 100.2, 100.3, at,
                           kv_source="device")


async def test_republished_and_reordered_events_count_once_and_failed_never_flips(
        nats_url, database_url, db, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, session_idle_s=3600)
    nc, js = await connect(nats_url, "test")
    services = Services()
    try:
        await services.start("telemetry", run_telemetry, settings)
        # r1: submitted and completed twice each (new stream messages, same call).
        for event in (submitted("r1"), submitted("r1"), completed("r1"), completed("r1")):
            await republish(js, event)
        # r2: failed by the gateway's timeout, then the agent's completion arrives anyway.
        await republish(js, submitted("r2"))
        await republish(js, CallFailed("r2", "s1", "qwen3-tiny", "no reply", "gateway", 101.0, status=504))
        await republish(js, completed("r2", at=102.0))
        # r3: completion and decision delivered before the submission (a redelivery reorders).
        await republish(js, completed("r3"))
        await republish(js, RoutingDecision("r3", "s1", 0, "qwen3-tiny", "least-loaded", "route", 100.0,
                                              chosen="agent-0", candidates=[CandidateCost("agent-0", 0.5)]))
        await republish(js, CallRouted(call=submitted("r3"), call_index=0, instance_id="agent-0",
                                         policy="least-loaded", routed_at=100.1))
        await republish(js, submitted("r3"))
        await republish(js, LeaseExpired("s1", "qwen3-tiny", "agent-0", 103.0))  # the last event: a marker
        await wait_rows(db, "SELECT 1 FROM lease_events WHERE kind='expired'", 1)
        rows = {r["call_id"]: r for r in await db.fetch("SELECT * FROM calls")}
        assert rows["r1"]["outcome"] == "completed"
        assert rows["r2"]["outcome"] == "failed" and rows["r2"]["status"] == 504
        assert rows["r3"]["outcome"] == "completed" and rows["r3"]["api"] == "nats"
        assert rows["r3"]["routed_at"] is not None
        session = await db.fetchrow("SELECT * FROM sessions WHERE session_id='s1'")
        assert (session["calls"], session["completed"], session["failed"]) == (3, 2, 1)
        decision = await db.fetchrow("SELECT * FROM lease_decisions WHERE call_id='r3'")
        assert decision["outcome"] == "completed" and decision["kv_source"] == "device"
    finally:
        await services.close()
        await nc.close()


async def test_a_poison_event_is_quarantined_and_the_stream_moves_on(nats_url, database_url, db, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, session_idle_s=3600)
    nc, js = await connect(nats_url, "test")
    services = Services()
    try:
        await services.start("telemetry", run_telemetry, settings)
        # A NUL in an id (the decoder refuses it) and one in JSON Postgres refuses (jsonb has no \u0000).
        nul_id = encode(submitted("ok"))
        nul_id = nul_id.replace(b'"call_id":"ok"', b'"call_id":"a\\u0000b"')
        bad_seq = (await js.publish(DEP.event("call.submitted"), nul_id)).seq
        jsonb = RoutingDecision("p2", "s1", 0, "qwen3-tiny", "least-loaded", "route", 100.0,
                                  candidates=[CandidateCost("agent-0", 0.5, reason="x\x00y")])
        jsonb_seq = await republish(js, jsonb)
        await republish(js, submitted("after"))
        await republish(js, completed("after"))
        await wait_rows(db, "SELECT 1 FROM calls WHERE call_id='after' AND outcome='completed'", 1)
        quarantined = await wait_rows(db, "SELECT * FROM quarantined_events ORDER BY seq", 2)
        assert [q["seq"] for q in quarantined] == [bad_seq, jsonb_seq]
        assert bytes(quarantined[0]["data"]) == nul_id and "call_id" in quarantined[0]["error"]
        assert [r["call_id"] for r in await db.fetch("SELECT call_id FROM calls")] == ["after"]
        # Nothing is left unacknowledged: the poison events do not come back.
        info = await js.consumer_info(DEP.events_stream, "telemetry")
        assert info.num_ack_pending == 0 and info.num_pending == 0
    finally:
        await services.close()
        await nc.close()


async def test_events_are_acked_only_after_their_transaction_commits(nats_url, database_url, db, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, session_idle_s=3600)
    nc, js = await connect(nats_url, "test")
    services = Services()
    lock = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await services.start("telemetry", run_telemetry, settings)
        tx = lock.transaction()
        await tx.start()
        await lock.execute("LOCK TABLE calls IN ACCESS EXCLUSIVE MODE")  # the projection's writes now wait
        seq = await republish(js, submitted("held"))
        # The projection's transaction now waits for the lock: the event is delivered, not committed.
        await wait_until(lambda: lock_waits(db), "the event to be applied")
        info = await js.consumer_info(DEP.events_stream, "telemetry")
        assert info.num_ack_pending == 1 and info.ack_floor.stream_seq < seq  # not acked
        await tx.rollback()
        await wait_rows(db, "SELECT 1 FROM calls WHERE call_id='held'", 1)
        await wait_until(lambda: acked(js, "telemetry", seq), "the committed event to be acked")
    finally:
        await lock.close()
        await services.close()
        await nc.close()


async def test_a_consumer_left_with_ack_all_is_replaced_resuming_after_its_ack_floor(
        nats_url, database_url, db, tmp_path):
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, session_idle_s=3600)
    nc, js = await connect(nats_url, "test")
    services = Services()
    try:
        await republish(js, submitted("old-1"))
        await js.add_consumer(DEP.events_stream, ConsumerConfig(
            durable_name="telemetry", ack_policy=AckPolicy.ALL, deliver_policy=DeliverPolicy.ALL,
            filter_subject=DEP.events_wildcard))
        await republish(js, submitted("old-2"))
        await services.start("telemetry", run_telemetry, settings)
        await wait_rows(db, "SELECT 1 FROM calls WHERE call_id LIKE 'old-%'", 2)
        info = await js.consumer_info(DEP.events_stream, "telemetry")
        assert info.config.ack_policy == AckPolicy.EXPLICIT
    finally:
        await services.close()
        await nc.close()


async def test_telemetry_killed_mid_batch_loses_nothing_after_a_restart(nats_url, database_url, db, tmp_path):
    """SIGKILL telemetry while its transaction waits (events fetched, not acked), keep
    publishing, restart it: every event is projected once, without waiting out ack_wait."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "TALARIA_NATS_URL": nats_url, "TALARIA_DATABASE_URL": database_url,
           "TALARIA_DATA_DIR": str(tmp_path), "TALARIA_SESSION_IDLE_S": "3600"}
    nc, js = await connect(nats_url, "test")
    lock = await asyncpg.connect(asyncpg_dsn(database_url))
    procs = []

    def start():
        procs.append(subprocess.Popen([sys.executable, "-m", "talaria.services.telemetry"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    try:
        start()
        for i in range(3):
            await republish(js, submitted(f"k{i}", i))
        await wait_rows(db, "SELECT 1 FROM calls WHERE call_id LIKE 'k%'", 3)
        tx = lock.transaction()
        await tx.start()
        await lock.execute("LOCK TABLE calls IN ACCESS EXCLUSIVE MODE")
        for i in range(3, 6):
            await republish(js, submitted(f"k{i}", i))
        await wait_until(lambda: lock_waits(db), "the events to be fetched")
        procs[0].send_signal(signal.SIGKILL)
        await asyncio.to_thread(procs[0].wait, 10)
        await tx.rollback()
        for i in range(6, 9):
            await republish(js, submitted(f"k{i}", i))
        start()
        rows = await wait_rows(db, "SELECT call_id FROM calls WHERE call_id LIKE 'k%'", 9, timeout=20)
        assert sorted(r["call_id"] for r in rows) == [f"k{i}" for i in range(9)]
        assert await db.fetchval("SELECT calls FROM sessions WHERE session_id='s1'") == 9
    finally:
        for p in procs:
            p.kill()
            p.wait()
        await lock.close()
        await nc.close()
