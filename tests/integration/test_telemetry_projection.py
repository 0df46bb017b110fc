"""Telemetry projects the event stream into Postgres, exactly once, over real NATS + Postgres."""


import pytest

from talaria.services.telemetry.service import run as run_telemetry
from talaria.shared import messages as m
from talaria.shared import subjects
from talaria.shared.bus import connect
from talaria.shared.bus import emit as emit_as
from talaria.shared.nats_auth import owner_sender
from talaria.shared.settings import Settings
from tests.integration.harness import Services, wait_rows

pytestmark = pytest.mark.integration


async def emit(js, event):
    """Publish as the service that owns the event (the projector drops anyone else's)."""
    return await emit_as(js, event, sender=owner_sender(event))


def submitted(call_id, index_hint=0):
    return m.CallSubmitted(call_id=call_id, session_id="s1", model="qwen3-tiny", prompt_ids=[256, 1, 2],
                           block_hashes=[], max_tokens=4, submitted_at=100.0 + index_hint)


async def test_calls_and_decisions_are_projected_once_even_when_replayed(nats_url, database_url, db, tmp_path):
    settings = Settings(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, session_idle_s=3600)
    nc, js = await connect(nats_url, "test")
    for i in range(3):
        await emit(js, submitted(f"c{i}", i))
        await emit(js, m.RoutingDecision(f"c{i}", "s1", i, "qwen3-tiny", "least-loaded", "route", 100.0 + i,
                                         chosen="agent-0", candidates=[m.CandidateCost("agent-0", 0.5)]))
        await emit(js, m.CallRouted(call=submitted(f"c{i}", i), call_index=i, instance_id="agent-0",
                                    policy="least-loaded", routed_at=100.1 + i))
        await emit(js, m.CallCompleted(f"c{i}", "s1", i, "qwen3-tiny", "agent-0", 3, 4, "length",
                                       100.0 + i, 100.2 + i, 100.3 + i, 100.5 + i, kv_source="device"))
    await emit(js, m.LeaseIssued("s1", "qwen3-tiny", "agent-0", "c2", 102.5, 103.5))
    services = Services()
    try:
        await services.start("telemetry", run_telemetry, settings)
        rows = await wait_rows(db, "SELECT * FROM calls WHERE outcome='completed' ORDER BY call_index", 3)
        assert [r["call_index"] for r in rows] == [0, 1, 2]
        assert all(r["instance_id"] == "agent-0" and r["output_tokens"] == 4 for r in rows)
        assert rows[0]["ttft_s"] is not None
        decisions = await wait_rows(db, "SELECT * FROM lease_decisions WHERE outcome='completed'", 3)
        assert {d["kv_source"] for d in decisions} == {"device"}
        leases = await wait_rows(db, "SELECT * FROM lease_events", 1)
        assert leases[0]["kind"] == "issued"
        await services.close()
        # Lose the consumer's acks (as if telemetry died after committing): every event is
        # delivered again, and the committed offset must keep anything from counting twice.
        await js.delete_consumer(subjects.EVENTS_STREAM, "telemetry")
        await services.start("telemetry", run_telemetry, settings)
        await emit(js, m.CallFailed("c9", "s1", "qwen3-tiny", "gateway timeout", "gateway", 110.0, status=504))
        failed = await wait_rows(db, "SELECT * FROM calls WHERE call_id='c9'", 1)
        assert failed[0]["outcome"] == "failed" and failed[0]["failed_stage"] == "gateway"
        session = await db.fetchrow("SELECT * FROM sessions WHERE session_id='s1'")
        assert (session["calls"], session["completed"], session["failed"]) == (3, 3, 1)
    finally:
        await services.close()
        await nc.close()
