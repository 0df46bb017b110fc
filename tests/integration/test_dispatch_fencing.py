"""An agent refuses a dispatch whose router's partition claim another router has taken since
(a router that stalled past its TTL and resumed), and the refusal reaches the audit; a
dispatch under the current claim runs. Real agent, telemetry, NATS and Postgres; this test
stands in for the gateway and two routers, and writes the ownership bucket as they would."""

from __future__ import annotations

import asyncio
import time

import pytest

from talaria.audit import AUDIT_DIR
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.services.router.claims import ClaimStore
from talaria.services.router.ownership import key_of, partition_of
from talaria.services.telemetry.telemetry_service import run as run_telemetry
from talaria.shared.bus import connect, emit, publish_fast
from talaria.shared.events import CallRouted, CallSubmitted, DispatchFence
from talaria.shared.messages import CallResult, REPLY_DECODER
from talaria.shared.nats_auth import owner_sender
from talaria.shared.settings import Settings
from talaria.shared.subjects import Deployment
from tests.integration.harness import Services, wait_rows

DEP = Deployment()
AGENT, PARTITIONS, MODEL = "agent-0", 8, "qwen3-tiny"
SESSION = "fenced-session"

pytestmark = pytest.mark.integration


async def test_a_superseded_routers_dispatch_is_refused_and_audited(nats_url, database_url, db, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, instance_id=AGENT,
                           models=(MODEL,))
    services = Services()
    nc, js = await connect(nats_url, "talaria-router")
    try:
        await services.start("telemetry", run_telemetry, settings)
        await services.start(AGENT, run_agent, settings)
        # router-0 claimed the session's partition; its claim lapsed and router-1 claimed it.
        claims = await ClaimStore.open(js, ttl_s=30.0, partitions=PARTITIONS)
        p = partition_of(SESSION, PARTITIONS)
        stale = await claims.create(p, "router-0")
        await claims.kv.delete(key_of(p))
        current = await claims.create(p, "router-1")
        assert current > stale

        replies: asyncio.Queue = asyncio.Queue()

        async def on_reply(msg):
            await replies.put(REPLY_DECODER.decode(msg.data))

        await nc.subscribe("_INBOX.fence.>", cb=on_reply)

        async def dispatch(call_id: str, fence: DispatchFence) -> None:
            call = CallSubmitted(call_id=call_id, session_id=SESSION, model=MODEL, prompt_ids=[5, 6, 7, 8],
                                 block_hashes=[], max_tokens=4, submitted_at=time.time(),
                                 reply_to=f"_INBOX.fence.{call_id}", deadline_at=time.time() + 60)
            seq = await emit(js, call, sender=owner_sender(call))
            routed = CallRouted(call=call, call_index=0, instance_id=AGENT, policy="talaria", routed_at=time.time(),
                                fence=fence)
            await publish_fast(js, DEP.dispatch(AGENT), routed)  # both copies, as a router sends them
            await emit(js, routed.by_reference(seq))

        await dispatch("stale-call", DispatchFence("router-0", p, stale))
        await dispatch("current-call", DispatchFence("router-1", p, current))
        answer = await asyncio.wait_for(replies.get(), 60)
        assert isinstance(answer, CallResult) and answer.call_id == "current-call"

        sql = (AUDIT_DIR / "refused_dispatches.sql").read_text()
        rows = await wait_rows(db, sql, 1, timeout=30)
        assert [(r["call_id"], r["instance_id"], r["router_id"], r["partition"], r["epoch"], r["holder"],
                 r["holder_epoch"]) for r in rows] == [("stale-call", AGENT, "router-0", p, stale, "router-1", current)]
        # The stale call never ran: no answer, no row beyond its submission.
        assert replies.empty()
        outcome = await db.fetchval("SELECT outcome FROM calls WHERE call_id = 'stale-call'")
        assert outcome in (None, "submitted", "routed")
        completed = await wait_rows(db, "SELECT call_id FROM calls WHERE outcome = 'completed'", 1, timeout=30)
        assert [r["call_id"] for r in completed] == ["current-call"]
    finally:
        await services.close()
        await nc.close()
