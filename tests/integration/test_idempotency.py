"""Idempotency-Key over real NATS + Postgres with in-process services: a retry with the key
attaches to the original call (its stored answer, or its outcome when it ends), the call runs
once, a different request under the key is refused, a failed attempt frees the key, and a
call whose gateway died is answered to the retrying client from what the stream kept."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import nats
import pytest

from talaria.shared.catalog import BUILTIN_MODELS
from talaria.services.gateway.http_api import parse_request
from talaria.services.gateway.idempotency import IdempotentCalls
from talaria.services.gateway.idempotency_rules import ORPHANED, outcome_subject, waiting_subject
from talaria.services.gateway.submitter import Submitter
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.shared import logs, subjects
from talaria.shared import messages as m
from talaria.shared.wire import encode, replace
from talaria.shared.bus import close, connect, emit_new
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from talaria.embedded import free_port
from tests.integration.harness import Services, wait_rows, wait_until
from tests.integration.test_security import Violations, router_ready, secure_nats, start_stack  # noqa: F401 (a fixture)
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "tenant-a:k-0123456789abcdef", "tenant-b:k-fedcba9876543210"


async def control_plane(nats_url, database_url, tmp_path, **changes):
    """Gateway (two tenants' keys), router, telemetry; agents are added by the tests."""
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="least-loaded",
                        http_port=free_port(), session_idle_s=3600, call_timeout_s=30,
                        api_keys=(KEY_A, KEY_B)).with_(**changes)
    services = Services()
    await services.start_control_plane(settings)
    return settings, services


@pytest.fixture
async def stack(nats_url, database_url, tmp_path):
    settings, services = await control_plane(nats_url, database_url, tmp_path)
    yield settings, services
    await services.close()


GRACE_S = 1.0  # short, so a call outlives it; a retry in these tests attaches within milliseconds


@pytest.fixture
async def short_grace_stack(nats_url, database_url, tmp_path):
    settings, services = await control_plane(nats_url, database_url, tmp_path, idempotent_orphan_s=GRACE_S,
                                             call_timeout_s=120)  # room for a long call on a busy machine
    yield settings, services
    await services.close()


async def start_agent(settings, services, nats_url) -> None:
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0", models=("qwen3-tiny",)))
    nc = await nats.connect(nats_url)
    try:
        await wait_for_router(nc, instances=1)  # it routes only to instances it has heard from
    finally:
        await nc.close()


def chat_body(content: str = "list the files", stream: bool = False) -> dict:
    return {"model": "qwen3-tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 5,
            "temperature": 0, "stream": stream}


def headers(session: str, key: str | None, api_key: str = KEY_A) -> dict[str, str]:
    out = {"X-Session-Id": session, "Authorization": f"Bearer {api_key.split(':', 1)[1]}"}
    return {**out, "Idempotency-Key": key} if key is not None else out


async def post(settings, body: dict, hdrs: dict, path: str = "/v1/chat/completions"):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}{path}", json=body, headers=hdrs) as r:
            text = await r.text()
            return r.status, (json.loads(text) if not body.get("stream") or r.status != 200 else text), r.headers


async def call_rows(db, session: str) -> list:
    return await db.fetch("SELECT call_id, outcome FROM calls WHERE session_id = $1 ORDER BY call_id",
                          f"tenant-a:{session}")


async def test_a_retry_with_the_key_gets_the_same_call_which_runs_once(stack, nats_url, db):
    settings, services = stack
    await start_agent(settings, services, nats_url)
    status, first, h1 = await post(settings, chat_body(), headers("idem-1", "key-1"))
    assert status == 200, first
    assert "Idempotent-Replayed" not in h1
    status, again, h2 = await post(settings, chat_body(), headers("idem-1", "key-1"))
    assert status == 200 and h2["Idempotent-Replayed"] == "true"
    assert again["id"] == first["id"] and h2["X-Talaria-Call-Id"] == h1["X-Talaria-Call-Id"]
    assert again["choices"] == first["choices"] and again["usage"] == first["usage"]
    # streamed, the retry gets the same answer whole
    status, sse, h3 = await post(settings, chat_body(stream=True), headers("idem-1", "key-1"))
    assert status == 200 and h3["X-Talaria-Call-Id"] == h1["X-Talaria-Call-Id"]
    chunks = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
    assert {c["id"] for c in chunks} == {first["id"]}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        first["choices"][0]["message"]["content"]
    # the same key with another request is refused, naming the key
    status, err, _ = await post(settings, chat_body("something else"), headers("idem-1", "key-1"))
    assert status == 422 and err["error"]["code"] == "idempotency_key_reused"
    assert err["error"]["param"] == "Idempotency-Key"
    # the same key from another tenant is another key
    status, other, _ = await post(settings, chat_body(), headers("idem-1", "key-1", KEY_B))
    assert status == 200 and other["id"] != first["id"]
    # a bad key is a 400 in each API's shape
    status, err, _ = await post(settings, chat_body(), headers("idem-1", "k\u00e9y"))
    assert status == 400 and err["error"]["code"] == "invalid_idempotency_key"
    anthropic = {"model": "qwen3-tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    status, err, _ = await post(settings, anthropic, headers("idem-1", "x" * 256), "/v1/messages")
    assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    rows = await wait_rows(db, "SELECT call_id FROM calls WHERE session_id = 'tenant-a:idem-1'", 1)
    assert [r["call_id"] for r in rows] == [h1["X-Talaria-Call-Id"]]  # ran once
    [row] = await wait_rows(db, "SELECT calls, completed FROM sessions WHERE session_id = 'tenant-a:idem-1' "
                                "AND completed = 1", 1)
    assert row["calls"] == 1


async def test_concurrent_requests_with_one_key_share_one_run(stack, nats_url, db):
    settings, services = stack
    await start_agent(settings, services, nats_url)
    anthropic = {"model": "qwen3-tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "go"}]}
    replies = await asyncio.gather(*(post(settings, anthropic, headers("idem-2", "key-2"), "/v1/messages")
                                     for _ in range(3)))
    assert [s for s, _, _ in replies] == [200, 200, 200], replies
    assert len({body["id"] for _, body, _ in replies}) == 1
    assert len({json.dumps(body["content"]) for _, body, _ in replies}) == 1
    assert sum(h.get("Idempotent-Replayed") == "true" for _, _, h in replies) == 2
    await wait_rows(db, "SELECT 1 FROM calls WHERE session_id = 'tenant-a:idem-2' AND outcome = 'completed'", 1)
    assert len(await call_rows(db, "idem-2")) == 1


async def test_a_failed_attempt_frees_the_key_for_a_new_run(stack, nats_url, db):
    settings, services = stack
    status, err, h = await post(settings, chat_body(), headers("idem-3", "key-3"))
    assert status == 503 and err["error"]["code"] == "no_capacity"  # no agent yet: the router refused it
    await start_agent(settings, services, nats_url)
    status, ok, h2 = await post(settings, chat_body(), headers("idem-3", "key-3"))
    assert status == 200 and "Idempotent-Replayed" not in h2
    status, again, h3 = await post(settings, chat_body(), headers("idem-3", "key-3"))
    assert status == 200 and again["id"] == ok["id"] and h3["Idempotent-Replayed"] == "true"
    rows = await wait_rows(db, "SELECT call_id, outcome FROM calls WHERE session_id = 'tenant-a:idem-3' "
                               "AND outcome IN ('failed', 'completed')", 2)
    assert sorted(r["outcome"] for r in rows) == ["completed", "failed"]


async def test_nats_api_honours_idempotency_key(stack, nats_url, db):
    settings, services = stack
    await start_agent(settings, services, nats_url)
    nc = await nats.connect(nats_url, inbox_prefix=subjects.client_inbox_prefix("tenant-a"))
    try:
        req = m.CallRequest(model="qwen3-tiny", prompt="hello", session_id="idem-4", max_tokens=4,
                            api_key=KEY_A.split(":", 1)[1], idempotency_key="nats-key")

        async def ask(r):
            return m.REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(r), timeout=60)).data)

        first, second = await ask(req), await ask(req)
        assert isinstance(first, m.CallResult) and first == second
        other = await ask(replace(req, prompt="bye"))
        assert isinstance(other, m.ErrorReply) and other.status == 422
        bad = await ask(replace(req, idempotency_key="tab\there"))
        assert isinstance(bad, m.ErrorReply) and bad.status == 400 and bad.param == "idempotency_key"
    finally:
        await nc.close()
    await wait_rows(db, "SELECT 1 FROM calls WHERE session_id = 'tenant-a:idem-4' AND outcome = 'completed'", 1)
    assert len(await call_rows(db, "idem-4")) == 1


async def dead_gateway(nats_url, settings, body: dict, session: str, key: str, submit: bool) -> m.CallSubmitted:
    """What a gateway SIGKILLed mid-call leaves behind: the key's claim, and (if `submit`) the
    call on the stream with its kept reply subject, but nobody listening for the answer."""
    nc, js = await connect(nats_url, "talaria-gateway")  # the sender the router trusts for submissions
    try:
        calls = IdempotentCalls(Submitter(nc, js, None, settings.gateway.call_timeout_s, logs.get("dead-gateway")),
                                settings.gateway.idempotency_window_s)
        call, _, _ = parse_request(BUILTIN_MODELS, json.dumps(body).encode(), True, headers(session, key), "tenant-a")
        claim = await calls.claim(call, key)
        assert claim.owner
        if submit:
            assert await emit_new(js, claim.call) is not None
        return claim.call
    finally:
        await close(nc)


async def test_a_call_whose_gateway_died_is_answered_to_the_retry_from_its_stored_outcome(stack, nats_url, db):
    settings, services = stack
    await start_agent(settings, services, nats_url)
    orphan = await dead_gateway(nats_url, settings, chat_body(), "idem-5", "key-5", submit=True)
    nc, js = await connect(nats_url, "talaria-test")
    try:  # the agent answered while no gateway listened: the stream kept it
        async def kept():
            try:
                return await js.get_last_msg(DEP.idempotency_stream, outcome_subject(DEP, orphan.tenant, orphan.call_id))
            except nats.js.errors.NotFoundError:
                return None

        stored = m.REPLY_DECODER.decode((await wait_until(kept, "the orphan's kept answer")).data)
    finally:
        await close(nc)
    assert isinstance(stored, m.CallResult)
    status, body, h = await post(settings, chat_body(), headers("idem-5", "key-5"))
    assert status == 200 and h["Idempotent-Replayed"] == "true"
    assert h["X-Talaria-Call-Id"] == orphan.call_id and body["choices"][0]["message"]["content"] == stored.text
    await wait_rows(db, "SELECT 1 FROM calls WHERE session_id = 'tenant-a:idem-5' AND outcome = 'completed'", 1)
    assert len(await call_rows(db, "idem-5")) == 1


async def test_a_call_whose_gateway_died_before_submitting_it_runs_once_for_the_retry(stack, nats_url, db):
    settings, services = stack
    await start_agent(settings, services, nats_url)
    claimed = await dead_gateway(nats_url, settings, chat_body(), "idem-6", "key-6", submit=False)
    status, body, h = await post(settings, chat_body(), headers("idem-6", "key-6"))
    assert status == 200 and h["X-Talaria-Call-Id"] == claimed.call_id  # re-submitted under its claim
    await wait_rows(db, "SELECT 1 FROM calls WHERE session_id = 'tenant-a:idem-6' AND outcome = 'completed'", 1)
    assert len(await call_rows(db, "idem-6")) == 1


async def test_a_client_that_drops_a_keyed_call_mid_stream_gets_it_on_retry(stack, nats_url, db):
    """Without a key a disconnect cancels the call; with one the client's retry attaches to it."""
    settings, services = stack
    await start_agent(settings, services, nats_url)
    body = {**chat_body(stream=True), "max_tokens": 64}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions", json=body,
                          headers=headers("idem-7", "key-7")) as r:
            assert r.status == 200
            call_id = r.headers["X-Talaria-Call-Id"]
            await r.content.readline()  # the first event: the call is running
    status, sse, h = await post(settings, body, headers("idem-7", "key-7"))
    assert status == 200 and h["X-Talaria-Call-Id"] == call_id
    [row] = await wait_rows(db, "SELECT outcome FROM calls WHERE session_id = 'tenant-a:idem-7' "
                                "AND outcome IN ('completed', 'cancelled', 'failed')", 1)
    assert row["outcome"] == "completed"
    assert len(await call_rows(db, "idem-7")) == 1


async def test_keys_work_under_per_service_nats_permissions(secure_nats, database_url, db, tmp_path):
    """As `talaria up` runs it: the gateway's own user claims keys and reads kept replies; a NATS
    client cannot read them."""
    url, users = secure_nats
    settings = Settings.of(nats_url=url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=60, api_keys=(KEY_A,))
    services = Services()
    try:
        await start_stack(services, settings, users)
        await router_ready(url, users["client-mallory"])
        status, first, _ = await post(settings, chat_body(), headers("idem-8", "key-8"))
        status2, again, h = await post(settings, chat_body(), headers("idem-8", "key-8"))
        assert (status, status2) == (200, 200) and again["id"] == first["id"] and h["Idempotent-Replayed"] == "true"
        violations = Violations()
        client = await nats.connect(url, error_cb=violations.on_error, **users["client-mallory"].options())
        try:
            await client.subscribe(f"{DEP.idempotent_replies}.*")
            await violations.wait_for(f'subscription to "{DEP.idempotent_replies}.*"')
            await client.publish(f"{DEP.idempotency_keys}.x", b"{}")
            await violations.wait_for(f'publish to "{DEP.idempotency_keys}.x"')
        finally:
            await client.close()
        await wait_rows(db, "SELECT 1 FROM calls WHERE session_id = 'tenant-a:idem-8' AND outcome = 'completed'", 1)
        assert len(await call_rows(db, "idem-8")) == 1
    finally:
        await services.close()



async def test_responses_api_honours_the_key(stack, nats_url, db):
    settings, services = stack
    await start_agent(settings, services, nats_url)
    body = {"model": "qwen3-tiny", "input": "list the files", "max_output_tokens": 5, "temperature": 0}
    status, first, h1 = await post(settings, body, headers("idem-9", "key-9"), "/v1/responses")
    status2, again, h2 = await post(settings, body, headers("idem-9", "key-9"), "/v1/responses")
    assert (status, status2) == (200, 200), (first, again)
    assert again["id"] == first["id"] and again["output"] == first["output"] and h2["Idempotent-Replayed"] == "true"
    status, err, _ = await post(settings, {**body, "input": "other"}, headers("idem-9", "key-9"), "/v1/responses")
    assert status == 422 and err["error"]["code"] == "idempotency_key_reused"
    await wait_rows(db, "SELECT 1 FROM calls WHERE session_id = 'tenant-a:idem-9' AND outcome = 'completed'", 1)
    assert len(await call_rows(db, "idem-9")) == 1


async def drop_mid_stream(settings, body: dict, hdrs: dict) -> tuple[str, float]:
    """Start a streamed call, read its first event and hang up: (its call id, when)."""
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions",
                          json={**body, "stream": True}, headers=hdrs) as r:
            assert r.status == 200
            call_id = r.headers["X-Talaria-Call-Id"]
            await r.content.readline()  # the first event: the call is running
    return call_id, time.monotonic()


LONG = {**chat_body("write forever"), "max_tokens": 4000}  # runs until it is cancelled


async def test_a_keyed_call_nobody_waits_for_is_cancelled_after_the_grace(short_grace_stack, nats_url, db):
    """Its client went away and no retry came: after the grace the agent aborts it (row `cancelled`)."""
    settings, services = short_grace_stack
    await start_agent(settings, services, nats_url)
    call_id, _ = await drop_mid_stream(settings, LONG, headers("idem-10", "key-10"))
    [row] = await wait_rows(db, "SELECT outcome, error, status FROM calls WHERE call_id = $1 "
                                "AND outcome IN ('completed', 'cancelled', 'failed')", 1, call_id)
    assert row["outcome"] == "cancelled" and row["status"] == m.CANCELLED_STATUS and ORPHANED in row["error"]


async def test_a_retry_within_the_grace_keeps_the_keyed_call_running_and_gets_its_answer(
        short_grace_stack, nats_url, db):
    settings, services = short_grace_stack
    await start_agent(settings, services, nats_url)
    body = {**LONG, "max_tokens": 2500}  # a few seconds here: longer than the grace
    call_id, left_at = await drop_mid_stream(settings, body, headers("idem-11", "key-11"))
    status, answer, h = await post(settings, body, headers("idem-11", "key-11"))  # the SDK's retry
    assert status == 200, answer
    assert h["X-Talaria-Call-Id"] == call_id and h["Idempotent-Replayed"] == "true"
    assert time.monotonic() - left_at > GRACE_S, "the call ended within the grace: this test needs a longer one"
    rows = await wait_rows(db, "SELECT call_id, outcome FROM calls WHERE session_id = 'tenant-a:idem-11' "
                               "AND outcome IN ('completed', 'cancelled', 'failed')", 1)
    assert [(r["call_id"], r["outcome"]) for r in rows] == [(call_id, "completed")]
    assert len(await call_rows(db, "idem-11")) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_retry_that_attached_as_its_call_was_given_up_runs_it_anew(stack, nats_url, db, stream):
    """The race the probe leaves: a retry attaches just after the last waiter's grace ran out and
    its probe found nobody. The call's cancel reaches the agent; the retry claims the key again
    (the cancelled attempt is taken over) and answers from the new run, not with the 499. A
    streamed retry's headers and chunk ids name the new run too."""
    settings, services = stack
    await start_agent(settings, services, nats_url)
    body = {**LONG, "max_tokens": 2500}
    orphan = await dead_gateway(nats_url, settings, body, "idem-12", "key-12", submit=True)
    retry = asyncio.ensure_future(post(settings, {**body, "stream": stream}, headers("idem-12", "key-12")))
    nc, js = await connect(nats_url, "talaria-gateway")  # the sender agents take cancels from
    try:
        async def attached():
            try:
                return await nc.request(waiting_subject(DEP, orphan.tenant, orphan.call_id), b"", timeout=1)
            except nats.errors.NoRespondersError:
                return None

        await wait_until(attached, "the retry to wait for the call")
        await Submitter(nc, js, None, settings.gateway.call_timeout_s, logs.get("test")).cancel(
            orphan.call_id, ORPHANED, "tenant-a")  # what the last waiter's grace sends
    finally:
        await close(nc)
    status, answer, h = await retry
    assert status == 200, answer
    assert h["X-Talaria-Call-Id"] != orphan.call_id and "Idempotent-Replayed" not in h
    if stream:
        assert f"chatcmpl-{h['X-Talaria-Call-Id']}" in answer and orphan.call_id not in answer
    rows = await wait_rows(db, "SELECT call_id, outcome FROM calls WHERE session_id = 'tenant-a:idem-12' "
                               "AND outcome IN ('completed', 'cancelled', 'failed')", 2)
    assert {(r["call_id"], r["outcome"]) for r in rows} == {(orphan.call_id, "cancelled"),
                                                            (h["X-Talaria-Call-Id"], "completed")}


async def test_an_owner_whose_call_was_given_up_while_its_client_waits_runs_it_anew(stack, nats_url, db):
    """An attached retry's grace can end while the owner's gateway cannot answer probes (e.g.
    reconnecting to NATS): the owner's client is still there, so it runs the call anew instead
    of answering 499."""
    settings, services = stack
    await start_agent(settings, services, nats_url)
    owner = asyncio.ensure_future(post(settings, {**LONG, "max_tokens": 2500}, headers("idem-13", "key-13")))
    [first] = await wait_rows(db, "SELECT call_id FROM calls WHERE session_id = 'tenant-a:idem-13'", 1)
    nc, js = await connect(nats_url, "talaria-gateway")
    try:
        await Submitter(nc, js, None, settings.gateway.call_timeout_s, logs.get("test")).cancel(
            first["call_id"], ORPHANED, "tenant-a")  # what another waiter's grace sends
    finally:
        await close(nc)
    status, answer, h = await owner
    assert status == 200, answer
    assert h["X-Talaria-Call-Id"] != first["call_id"] and "Idempotent-Replayed" not in h
    rows = await wait_rows(db, "SELECT call_id, outcome FROM calls WHERE session_id = 'tenant-a:idem-13' "
                               "AND outcome IN ('completed', 'cancelled', 'failed')", 2)
    assert {(r["call_id"], r["outcome"]) for r in rows} == {(first["call_id"], "cancelled"),
                                                            (h["X-Talaria-Call-Id"], "completed")}


async def test_the_orphan_grace_works_under_per_service_nats_permissions(secure_nats, database_url, db, tmp_path):
    """As `talaria up` runs it: the gateway's user may answer and send probes on the waiting
    subject (a retry that attached keeps the call; a call nobody waits for is cancelled)."""
    url, users = secure_nats
    settings = Settings.of(nats_url=url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=120, api_keys=(KEY_A,), idempotent_orphan_s=GRACE_S)
    services = Services()
    try:
        await start_stack(services, settings, users)
        await router_ready(url, users["client-mallory"])
        body = {**LONG, "max_tokens": 2500}
        kept, left_at = await drop_mid_stream(settings, body, headers("idem-13", "key-13"))
        status, answer, h = await post(settings, body, headers("idem-13", "key-13"))
        assert status == 200 and h["X-Talaria-Call-Id"] == kept, answer
        assert time.monotonic() - left_at > GRACE_S, "the call ended within the grace: this test needs a longer one"
        dropped, _ = await drop_mid_stream(settings, LONG, headers("idem-14", "key-14"))
        [row] = await wait_rows(db, "SELECT outcome, error FROM calls WHERE call_id = $1 "
                                    "AND outcome IN ('completed', 'cancelled', 'failed')", 1, dropped)
        assert row["outcome"] == "cancelled" and ORPHANED in row["error"]
        rows = await wait_rows(db, "SELECT call_id, outcome FROM calls WHERE session_id = 'tenant-a:idem-13' "
                                   "AND outcome IN ('completed', 'cancelled', 'failed')", 1)
        assert [(r["call_id"], r["outcome"]) for r in rows] == [(kept, "completed")]
    finally:
        await services.close()
