"""Gateway APIs over real NATS + Postgres with in-process services: bad input, overload, NATS API."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import nats
import pytest

from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.shared.messages import (
    CallRequest,
    CallResult,
    ErrorReply,
    REPLY_DECODER,
    TOKEN_DECODER,
    TokenChunk,
)
from talaria.shared.wire import encode
from talaria.shared.bus import event_subject
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from talaria.embedded import free_port
from tests.integration.harness import Services, wait_rows
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration


@pytest.fixture
async def stack(nats_url, database_url, tmp_path):
    """Gateway, router (least-loaded) and telemetry; agents are added by the tests that need them."""
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="least-loaded",
                        http_port=free_port(), session_idle_s=3600, call_timeout_s=30)
    services = Services()
    await services.start_control_plane(settings)
    yield settings, services
    await services.close()


async def post(settings, path, body, headers=None):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}{path}", data=body,
                          headers={"Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, await r.json(), r.headers


async def test_bad_requests_get_openai_errors_naming_the_field(stack):
    settings, _ = stack
    status, body, _ = await post(settings, "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body, _ = await post(settings, "/v1/chat/completions",
                                 b'{"model":"qwen3-tiny","messages":[{"role":"user","content":"x"}],"max_tokens":"lots"}')
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body, _ = await post(settings, "/v1/chat/completions",
                                 b'{"model":"no-such-model","messages":[{"role":"user","content":"x"}]}')
    assert status == 404 and body["error"]["code"] == "model_not_found"
    huge = msgspec.json.encode({"model": "gpt2-tiny", "prompt": "x" * 9000, "max_tokens": 4})
    status, body, _ = await post(settings, "/v1/completions", huge)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"


async def test_unknown_routes_and_methods_answer_json_in_each_apis_shape(stack):
    """An SDK must read a JSON 404 naming the route, not text: e.g. retrieving a stored
    response, which this stateless server does not keep."""
    settings, _ = stack
    status, body, _ = await post(settings, "/v1/responses/resp_1/cancel", b"{}")
    assert status == 404 and body["error"]["code"] == "not_found" and "/v1/responses/resp_1" in body["error"]["message"]
    status, body, _ = await post(settings, "/v1/responses", b"{}")  # served: a body without `model` is a 400
    assert status == 400 and body["error"]["param"] == "model"
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions") as r:
            assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
            assert "POST" in r.headers["Allow"]
        async with s.get(f"http://127.0.0.1:{settings.gateway.http_port}/v1/responses/resp_1") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        async with s.get(f"http://127.0.0.1:{settings.gateway.http_port}/v1/messages") as r:
            body = await r.json()
            assert r.status == 405 and body["type"] == "error" and body["error"]["type"] == "api_error"


async def test_no_instance_able_to_serve_is_503_with_retry_after_and_recorded(stack, db):
    settings, _ = stack
    status, body, headers = await post(settings, "/v1/chat/completions",
                                       b'{"model":"qwen3-tiny","messages":[{"role":"user","content":"x"}],"max_tokens":2}',
                                       {"X-Session-Id": "lonely"})
    assert status == 503 and int(headers["Retry-After"]) >= 1
    status, body, headers = await post(settings, "/v1/chat/completions",
                                       b'{"model":"qwen3-tiny","messages":[{"role":"user","content":"x"}],'
                                       b'"max_tokens":2,"stream":true}', {"X-Session-Id": "lonely-stream"})
    assert status == 503 and body["error"]["code"] == "no_capacity" and "Retry-After" in headers
    [row] = await wait_rows(db, "SELECT * FROM calls WHERE session_id='lonely' AND outcome='failed'", 1)
    assert row["failed_stage"] == "router" and row["status"] == 503


async def test_nats_api_serves_a_call_and_streams_its_tokens(stack, nats_url):
    settings, services = stack
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0", models=("qwen3-tiny",)))
    nc = await nats.connect(nats_url)
    try:
        await wait_for_router(nc, instances=1)  # it routes only to instances it has heard from
        got: list[TokenChunk] = []
        done = asyncio.Event()

        async def on_token(msg):
            got.append(TOKEN_DECODER.decode(msg.data))

        await nc.subscribe(DEP.tokens("", "call-stream-1"), cb=on_token)
        req = CallRequest(model="qwen3-tiny", prompt="hello", session_id="nats-s1", call_id="call-stream-1",
                            max_tokens=6, temperature=0, stream=True)
        reply = REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=60)).data)
        assert isinstance(reply, CallResult), reply
        n = reply.usage.completion_tokens
        assert 1 <= n <= 6 and reply.finish_reason == ("length" if n == 6 else "stop")
        assert reply.session_id == "nats-s1"
        await nc.flush()
        assert "".join(t.text for t in got) == reply.text[: len("".join(t.text for t in got))]
        assert got, "no tokens streamed"
        bad = REPLY_DECODER.decode((await nc.request(DEP.api_call, b"\xff not json", timeout=10)).data)
        assert isinstance(bad, ErrorReply) and bad.status == 400
        done.set()
    finally:
        await nc.close()


async def test_streamed_chat_matches_openai_chunks_and_the_final_answer(stack):
    import openai

    settings, services = stack
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0", models=("qwen3-tiny",)))
    nc = await nats.connect(settings.common.nats_url)
    await wait_for_router(nc, instances=1)  # it routes only to instances it has heard from
    await nc.close()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{settings.gateway.http_port}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "stream me"}]
    plain = await client.chat.completions.create(model="qwen3-tiny", messages=messages, max_tokens=8,
                                                 temperature=0, extra_headers={"X-Session-Id": "st"})
    chunks = [c async for c in await client.chat.completions.create(
        model="qwen3-tiny", messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Session-Id": "st2"})]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


async def test_a_call_id_reused_after_the_duplicate_window_is_refused_409_not_dropped(stack, nats_url, db):
    """Past JetStream's 2-minute duplicate window the gateway cannot see a reused call id; the
    router, which decided the first call of that id, answers 409 at once (it used to drop the
    submission as a redelivery, leaving the client to its timeout) and records nothing for it."""
    import time

    from talaria.shared.bus import connect, close, publish_event
    from talaria.shared.events import CallSubmitted
    from talaria.shared.nats_auth import sender_name

    settings, services = stack
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0", models=("qwen3-tiny",)))
    nc = await nats.connect(nats_url)
    gw, js = await connect(nats_url, sender_name("gateway"))  # stands in for a gateway
    try:
        await wait_for_router(nc, instances=1)
        req = CallRequest(model="qwen3-tiny", prompt="hello", session_id="reuse-s1", call_id="reused-1",
                          max_tokens=2, temperature=0)
        first = REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=60)).data)
        assert isinstance(first, CallResult), first
        inbox = f"{DEP.reply_prefix}.gateway.test.reused-1"
        replies = await nc.subscribe(inbox)
        later = CallSubmitted("reused-1", "reuse-s2", "qwen3-tiny", [1, 2, 3], [], 2, time.time(), reply_to=inbox)
        await publish_event(js, event_subject(DEP, later), later, msg_id="a-later-submission")  # a new message
        refused = REPLY_DECODER.decode((await replies.next_msg(timeout=20)).data)
        assert isinstance(refused, ErrorReply) and (refused.status, refused.code) == (409, "duplicate_call_id")
        [row] = await wait_rows(db, "SELECT session_id, outcome FROM calls WHERE call_id = 'reused-1' "
                                    "AND outcome = 'completed'", 1)
        assert row["session_id"] == "reuse-s1"  # the first call's row, untouched
    finally:
        await close(gw)
        await nc.close()
