"""The live call path (issue 11) over real NATS + Postgres with in-process services:
readiness, cancellation (NATS cancel and HTTP disconnect), large bodies off the loop."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import nats
import pytest

from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.shared.messages import (
    CANCELLED_STATUS,
    CallRequest,
    CallResult,
    CancelCall,
    ErrorReply,
    REPLY_DECODER,
)
from talaria.shared.wire import encode
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from talaria.embedded import free_port
from tests.integration.harness import Services, wait_rows, wait_until
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration
MODEL = "qwen3-tiny"


@pytest.fixture
async def stack(nats_url, database_url, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                        http_port=free_port(), session_idle_s=3600, call_timeout_s=60, models=(MODEL,))
    services = Services()
    await services.start_control_plane(settings)
    yield settings, services
    await services.close()


async def get(settings, path):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{settings.gateway.http_port}{path}") as r:
            return r.status, await r.json()


async def with_agent(settings, services):
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0"))
    nc = await nats.connect(settings.common.nats_url)
    await wait_for_router(nc, instances=1)
    return nc


async def test_readiness_is_503_until_every_configured_model_is_served(stack):
    settings, services = stack
    for path in ("/healthz", "/readyz"):
        status, body = await get(settings, path)
        assert status == 503 and body["status"] == "not_ready"
        assert body["checks"][f"model:{MODEL}"] == "no instance" and body["checks"]["nats"] == "ok"
    nc = await with_agent(settings, services)
    await nc.close()
    async def ready():  # the gateway hears the agent's heartbeat on its own schedule: poll the endpoint
        status, body = await get(settings, "/readyz")
        return (status, body) if status == 200 else None

    status, body = await wait_until(ready, "/readyz to say ready", every=0.1)
    assert status == 200 and body["checks"][f"model:{MODEL}"] == "ok" and body["models"][MODEL] == ["agent-0"]


async def test_a_cancel_on_nats_aborts_the_call_and_frees_its_slot(stack, db):
    settings, services = stack
    nc = await with_agent(settings, services)
    try:
        first = asyncio.Event()

        async def on_token(msg):
            first.set()

        await nc.subscribe(DEP.tokens("", "long-1"), cb=on_token)
        req = CallRequest(model=MODEL, prompt="write forever", session_id="c1", call_id="long-1",
                            max_tokens=4000, temperature=0, stream=True)
        pending = asyncio.ensure_future(nc.request(DEP.api_call, encode(req), timeout=60))
        await asyncio.wait_for(first.wait(), 30)
        await nc.request(DEP.api_cancel, encode(CancelCall("long-1", "test")), timeout=10)
        reply = REPLY_DECODER.decode((await pending).data)
        assert isinstance(reply, ErrorReply) and reply.status == CANCELLED_STATUS and reply.code == "cancelled"
        [row] = await wait_rows(db, "SELECT * FROM calls WHERE call_id='long-1' AND outcome='cancelled'", 1)
        assert row["failed_stage"] == "agent"
        # The slot and the KV refs are free: the next call runs at once and completes.
        req2 = CallRequest(model=MODEL, prompt="next", session_id="c2", max_tokens=2, temperature=0)
        reply2 = REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req2), timeout=30)).data)
        assert isinstance(reply2, CallResult), reply2
        # A cancel that arrives before its call is remembered: the call is refused on arrival.
        ack = await nc.request(DEP.api_cancel, encode(CancelCall("early-1", "test")), timeout=10)
        assert b"cancel_sent" in ack.data
        req3 = CallRequest(model=MODEL, prompt="x", session_id="c3", call_id="early-1", max_tokens=2)
        reply3 = REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req3), timeout=30)).data)
        assert isinstance(reply3, ErrorReply) and reply3.status == CANCELLED_STATUS
    finally:
        await nc.close()


async def test_an_http_client_that_disconnects_cancels_its_call(stack, db):
    settings, services = stack
    nc = await with_agent(settings, services)
    await nc.close()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream forever"}], "max_tokens": 4000,
            "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions", json=body,
                          headers={"X-Session-Id": "gone"}) as resp:
            async for line in resp.content:
                if b'"content": "' in line and b'"content": ""' not in line:
                    break  # the first real token: hang up
    [row] = await wait_rows(db, "SELECT * FROM calls WHERE session_id='gone' AND outcome='cancelled'", 1)
    assert "client disconnected" in row["error"]


async def test_a_large_body_is_parsed_off_the_loop_with_the_same_answer(stack):
    settings, _ = stack
    huge = msgspec.json.encode({"model": MODEL, "messages": [{"role": "user", "content": "x" * 200_000}],
                                "max_tokens": 4})
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions", data=huge,
                          headers={"Content-Type": "application/json"}) as r:
            status, body = r.status, await r.json()
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"


async def test_a_call_started_from_its_fast_copy_is_acked_once_durably(stack, db):
    settings, services = stack
    nc = await with_agent(settings, services)
    try:
        for i in range(3):
            req = CallRequest(model=MODEL, prompt=f"fast {i}", session_id="fast", max_tokens=2, temperature=0)
            reply = REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=30)).data)
            assert isinstance(reply, CallResult), reply
        await wait_rows(db, "SELECT * FROM calls WHERE session_id='fast' AND outcome='completed'", 3)
        js = nc.jetstream()
        async def settled():  # the durable copies are acked as they arrive: poll the consumer's state
            info = await js.consumer_info(DEP.events_stream, "agent-agent-0")
            return info if info.num_ack_pending == 0 else None

        info = await wait_until(settled, "the agent's consumer to ack everything", timeout=10, every=0.1)
        assert info.num_ack_pending == 0 and info.num_redelivered == 0 and info.delivered.consumer_seq >= 3
    finally:
        await nc.close()
