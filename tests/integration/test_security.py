"""Each attack from issue 14, replayed against real NATS, Postgres and services: every one
must be refused. (On the code before the issue each of these succeeded.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

import aiohttp
import asyncpg
import msgspec
from multidict import CIMultiDict
import nats
import pytest

from talaria.embedded import EmbeddedNats, free_port
from talaria.services.gateway.idempotency_rules import outcome_subject
from talaria.services.gateway.gateway_service import run as run_gateway
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.services.router.router_service import run as run_router
from talaria.services.telemetry.telemetry_service import run as run_telemetry
from talaria.shared.events import CallCompleted, CallRouted, CallSubmitted
from talaria.shared.messages import (
    CANCELLED_STATUS,
    CallRequest,
    CallResult,
    CancelCall,
    ErrorReply,
    REPLY_DECODER,
    TOKEN_DECODER,
)
from talaria.shared.wire import encode
from talaria.shared import subjects
from talaria.shared.bus import connect, emit
from talaria.shared.db.connection import upgrade
from talaria.shared.db.roles import drop_app_role, ensure_app_role
from talaria.shared.health import wait_for_router
from talaria.shared.nats_auth import generate_users
from talaria.shared.settings import Settings, asyncpg_dsn
from tests.conftest import _with_db
from tests.integration.harness import Services, wait_rows
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration

KEYS = ("victim:victim-key-0123456789", "mallory:mallory-key-0123456789")
CHAT = {"model": "qwen3-tiny", "max_tokens": 1, "temperature": 0}


@pytest.fixture
async def secure_nats(tmp_path):
    """An embedded NATS with per-service users and one client user per tenant of KEYS (as
    `talaria up` starts it), even in CI."""
    users = generate_users(["agent-0"], [key.split(":")[0] for key in KEYS])
    server = EmbeddedNats(tmp_path / "secure-nats", users=users).start()
    yield server.url, users
    server.stop()


def as_user(settings: Settings, user) -> Settings:
    return settings.with_(nats_user=user.name, nats_password=user.password)


async def start_stack(services: Services, settings: Settings, users=None) -> None:
    """Telemetry, router, gateway and one qwen3-tiny agent, each with its own NATS user."""
    pick = (lambda s, name: as_user(s, users[name])) if users else (lambda s, name: s)
    await services.start("telemetry", run_telemetry, pick(settings, "telemetry"))
    await services.start("router", run_router, pick(settings, "router"))
    await services.start("gateway", run_gateway, pick(settings, "gateway"))
    await services.start("agent-0", run_agent, pick(settings.with_(instance_id="agent-0", models=("qwen3-tiny",)),
                                                    "agent-agent-0"))


async def chat(settings, content: str, key: str | None, session: str, **extra) -> tuple[int, dict]:
    headers = {"X-Session-Id": session, **({"Authorization": f"Bearer {key}"} if key else {})}
    body = {**CHAT, "messages": [{"role": "user", "content": content}], **extra}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions", json=body,
                          headers=headers) as r:
            return r.status, await r.json()


class Violations:
    """Collects the server's permission-violation errors for one client connection."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.changed = asyncio.Event()

    async def on_error(self, exc: Exception) -> None:
        self.seen.append(str(exc))
        self.changed.set()

    async def wait_for(self, fragment: str, timeout: float = 10.0) -> None:
        async def find() -> None:
            while not any(fragment.lower() in s.lower() for s in self.seen):  # the client lowercases some
                self.changed.clear()
                await self.changed.wait()

        try:
            await asyncio.wait_for(find(), timeout)
        except TimeoutError:
            raise AssertionError(f"no violation {fragment!r} in {self.seen}") from None


async def router_ready(url: str, user, deployment: Deployment = DEP) -> None:
    nc = await nats.connect(url, **user.options())
    try:
        await wait_for_router(nc, instances=1, deployment=deployment)
    finally:
        await nc.close()


def forged_routed(call_id: str) -> CallRouted:
    call = CallSubmitted(call_id=call_id, session_id="forged", model="qwen3-tiny", prompt_ids=[256, 70, 79],
                           block_hashes=[], max_tokens=2, submitted_at=1.0)
    return CallRouted(call=call, call_index=0, instance_id="agent-0", policy="talaria", routed_at=1.0)


def forged_completed(call_id: str) -> CallCompleted:
    return CallCompleted(call_id, "forged", 0, "qwen3-tiny", "agent-0", 123_456, 1, "stop",
                           1.0, 1.1, 1.2, 1.3)


async def test_nats_client_cannot_read_prompts_or_forge_routes_completions_or_replies(
        secure_nats, database_url, db, tmp_path):
    url, users = secure_nats
    settings = Settings.of(nats_url=url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=60, api_keys=KEYS)
    services = Services()
    violations = Violations()
    try:
        # No credentials: no connection at all.
        with pytest.raises(Exception, match="Authorization"):
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3)
        await start_stack(services, settings, users)
        await router_ready(url, users["client-mallory"])
        mallory = await nats.connect(url, error_cb=violations.on_error, **users["client-mallory"].options())
        # Read prompts: neither the event subjects nor the JetStream API are open to clients.
        prompts = await mallory.subscribe(DEP.events_wildcard)
        await violations.wait_for(f'subscription to "{DEP.events_wildcard}"')
        with pytest.raises(Exception):
            await mallory.jetstream(timeout=3).stream_info(DEP.events_stream)
        # Forge a routed call, a completion, and a reply to the gateway.
        await mallory.publish(DEP.call_routed("agent-0"), encode(forged_routed("forged-route")))
        await violations.wait_for(f'publish to "{DEP.call_routed("agent-0")}"')
        await mallory.publish(DEP.event("call.completed"), encode(forged_completed("forged-done")))
        await violations.wait_for(f'publish to "{DEP.event("call.completed")}"')
        reply_subject = DEP.reply_inbox("gateway", "x") + ".c1"
        await mallory.publish(reply_subject, encode(ErrorReply(200, "FORGED ANSWER", "FORGED ANSWER")))
        await violations.wait_for(f'publish to "{reply_subject}"')
        # The real path still works, and the NATS API answers a client with a key.
        status, body = await chat(settings, "the real secret prompt", "victim-key-0123456789", "v1")
        assert status == 200, body
        req = CallRequest(model="qwen3-tiny", prompt="hi", session_id="n1", max_tokens=1,
                            api_key="mallory-key-0123456789")
        reply = REPLY_DECODER.decode((await mallory.request(DEP.api_call, encode(req), timeout=60)).data)
        assert isinstance(reply, CallResult) and reply.session_id == "n1"
        with pytest.raises(nats.errors.TimeoutError):
            await prompts.next_msg(timeout=0.2)  # the prompt above never reached the subscriber
        await wait_rows(db, "SELECT * FROM calls WHERE session_id='mallory:n1' AND outcome='completed'", 1)
        forged = await db.fetch("SELECT * FROM calls WHERE call_id LIKE 'forged%' OR prompt_tokens=123456")
        assert forged == []
        await mallory.close()
    finally:
        await services.close()


async def test_a_tenants_nats_client_cannot_read_another_tenants_tokens_or_replies(
        secure_nats, database_url, db, tmp_path):
    """Each tenant has its own NATS API user, fenced to its own inboxes and token streams:
    Mallory cannot sniff the victim's streamed tokens or replies; both still get their own."""
    url, users = secure_nats
    settings = Settings.of(nats_url=url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=60, api_keys=KEYS)
    services = Services()
    violations = Violations()
    try:
        await start_stack(services, settings, users)
        await router_ready(url, users["client-victim"])
        mallory = await nats.connect(url, error_cb=violations.on_error, **users["client-mallory"].options())
        victim = await nats.connect(url, **users["client-victim"].options())
        for subject in (f"{DEP.tokens_prefix}.>", DEP.tokens("victim", "v-call"), "_INBOX.>",
                        "_INBOX.victim.>"):
            await mallory.subscribe(subject)
            await violations.wait_for(f'subscription to "{subject}"')
        streamed = []
        done = asyncio.Event()

        async def on_token(msg):
            chunk = TOKEN_DECODER.decode(msg.data)
            streamed.append(chunk)
            if chunk.done:
                done.set()

        await victim.subscribe(DEP.tokens("victim", "v-call"), cb=on_token)
        req = CallRequest(model="qwen3-tiny", prompt="the victim's secret", session_id="v", call_id="v-call",
                            max_tokens=4, temperature=0, stream=True, api_key="victim-key-0123456789")
        reply = REPLY_DECODER.decode((await victim.request(DEP.api_call, encode(req), timeout=60)).data)
        assert isinstance(reply, CallResult), reply
        await asyncio.wait_for(done.wait(), 30)
        assert "".join(c.text for c in streamed) == reply.text
        own = CallRequest(model="qwen3-tiny", prompt="hi", session_id="m", max_tokens=1,
                            api_key="mallory-key-0123456789")
        assert isinstance(REPLY_DECODER.decode((await mallory.request(DEP.api_call, encode(own),
                                                                        timeout=60)).data), CallResult)
        # The fence is the user's, not a convention: the default inbox prefix is refused too.
        plain = await nats.connect(url, error_cb=violations.on_error,
                                   **{k: v for k, v in users["client-mallory"].options().items() if k != "inbox_prefix"})
        with pytest.raises(Exception):
            await plain.request(DEP.api_call, encode(own), timeout=3)
        for nc in (mallory, victim, plain):
            await nc.close()
    finally:
        await services.close()


VICTIM_KEY, MALLORY_KEY = (key.split(":", 1)[1] for key in KEYS)


async def keyed_chat(settings, content: str, key: str, session: str, max_tokens: int = 1):
    """The victim's keyed call over HTTP: (status, body, headers)."""
    headers = {"X-Session-Id": session, "Authorization": f"Bearer {VICTIM_KEY}", "Idempotency-Key": key}
    body = {**CHAT, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions", json=body,
                          headers=headers) as r:
            return r.status, await r.json(), r.headers


async def injected(mallory, reply_to: str, *requests: CallRequest) -> None:
    """Mallory's requests naming `reply_to` (not its own inbox) as their reply subject, then one
    of its own: the gateway checks each request's reply subject, in order, before anything of
    it runs, so once the last is answered every injection has been dealt with."""
    for req in requests:
        await mallory.publish(DEP.api_call, encode(req), reply=reply_to)
    own = CallRequest(model="qwen3-tiny", prompt="mallory's own", session_id="m", max_tokens=1, api_key=MALLORY_KEY)
    reply = REPLY_DECODER.decode((await mallory.request(DEP.api_call, encode(own), timeout=60)).data)
    assert isinstance(reply, CallResult), reply


# An error answer (would free the key: the retry runs the call again) and a whole answer of
# Mallory's with a much longer prompt (would be replayed to the victim as its own).
INJECTED_ERROR = CallRequest(model="no-such-model", prompt="x", max_tokens=1, api_key=MALLORY_KEY)
INJECTED_ANSWER = CallRequest(model="qwen3-tiny", prompt="mallory's answer " * 40, session_id="m", max_tokens=1,
                              api_key=MALLORY_KEY)


@pytest.mark.parametrize("injection", [INJECTED_ERROR, INJECTED_ANSWER], ids=["error", "answer"])
async def test_a_tenant_cannot_answer_another_tenants_keyed_call(secure_nats, database_url, db, tmp_path, injection):
    """Issue 25 item 1: the kept answer's subject is computable from the tenant and the (public)
    call id. Mallory's request naming it as its reply subject is dropped: the victim's retry
    still gets its own answer, replayed, and its call ran once."""
    url, users = secure_nats
    settings = Settings.of(nats_url=url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=60, api_keys=KEYS)
    services = Services()
    try:
        await start_stack(services, settings, users)
        await router_ready(url, users["client-victim"])
        status, first, h = await keyed_chat(settings, "the victim's question", "v-key-1", "v1")
        assert status == 200, first
        mallory = await nats.connect(url, **users["client-mallory"].options())
        await injected(mallory, outcome_subject(DEP, "victim", h["X-Talaria-Call-Id"]), injection)
        await mallory.close()
        status, again, h2 = await keyed_chat(settings, "the victim's question", "v-key-1", "v1")
        assert status == 200 and h2.get("Idempotent-Replayed") == "true", again
        assert again["id"] == first["id"] and again["usage"] == first["usage"]
        await wait_rows(db, "SELECT 1 FROM calls WHERE session_id = 'victim:v1' AND outcome = 'completed'", 1)
        rows = await db.fetch("SELECT outcome FROM calls WHERE session_id = 'victim:v1'")
        assert [r["outcome"] for r in rows] == ["completed"]
    finally:
        await services.close()


async def test_a_tenant_cannot_cut_another_tenants_keyed_stream(secure_nats, database_url, db, tmp_path):
    """An error injected on a running keyed stream's kept subject (or its token subject) used to
    end the victim's stream early while its row said completed: now the stream runs to its end,
    and NATS itself refuses the gateway's user a publish outside the inbox spaces."""
    url, users = secure_nats
    settings = Settings.of(nats_url=url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=60, api_keys=KEYS)
    services = Services()
    try:
        await start_stack(services, settings, users)
        await router_ready(url, users["client-victim"])
        mallory = await nats.connect(url, **users["client-mallory"].options())
        headers = {"X-Session-Id": "v2", "Authorization": f"Bearer {VICTIM_KEY}", "Idempotency-Key": "v-key-2"}
        body = {**CHAT, "max_tokens": 48, "stream": True, "messages": [{"role": "user", "content": "go on"}]}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions", json=body,
                              headers=headers) as r:
                assert r.status == 200
                call_id = r.headers["X-Talaria-Call-Id"]
                events = [await r.content.readline()]  # the first event: the call is running
                await injected(mallory, outcome_subject(DEP, "victim", call_id), INJECTED_ERROR)
                await injected(mallory, DEP.tokens("victim", call_id), INJECTED_ERROR)
                events.append(await r.content.read())
        sse = b"".join(events).decode()
        assert '"error"' not in sse and sse.rstrip().endswith("data: [DONE]"), sse[-500:]
        await mallory.close()
        [row] = await wait_rows(db, "SELECT outcome FROM calls WHERE session_id = 'victim:v2' "
                                    "AND outcome IN ('completed', 'failed', 'cancelled')", 1)
        assert row["outcome"] == "completed"
        violations = Violations()
        gateway = await nats.connect(url, error_cb=violations.on_error, **users["gateway"].options())
        await gateway.publish(outcome_subject(DEP, "victim", call_id), b"{}")
        await violations.wait_for(f'publish to "{outcome_subject(DEP, "victim", call_id)}"')
        await gateway.close()
    finally:
        await services.close()


async def test_events_not_from_their_owning_service_are_dropped_on_an_open_nats(
        nats_url, database_url, db, tmp_path):
    """Defence in depth where the NATS has no permissions: an agent runs only calls the router
    sent, the projector records only events their owner sent."""
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=60)
    services = Services()
    try:
        await start_stack(services, settings)
        nc, js = await connect(nats_url, "rogue")
        await emit(js, forged_routed("forged-route"))
        await emit(js, forged_completed("forged-done"))
        await emit(js, forged_routed("forged-as-agent"), sender="talaria-agent-agent-0")  # not the router
        await nc.close()
        await router_ready(nats_url, type("anon", (), {"options": lambda self: {}})())
        status, body = await chat(settings, "after the forgeries", None, "legit")
        assert status == 200, body
        await wait_rows(db, "SELECT * FROM calls WHERE session_id='legit' AND outcome='completed'", 1)
        forged = await db.fetch("SELECT * FROM calls WHERE call_id LIKE 'forged%' OR prompt_tokens=123456")
        assert forged == []
    finally:
        await services.close()


async def test_http_api_refuses_calls_without_a_valid_key_in_each_apis_shape(nats_url, database_url, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        api_keys=KEYS)
    services = Services()
    base = f"http://127.0.0.1:{settings.gateway.http_port}"
    try:
        await services.start("gateway", run_gateway, settings)
        async with aiohttp.ClientSession() as s:
            for path in ("/healthz", "/readyz"):
                async with s.get(f"{base}{path}") as r:
                    # open: load balancers and `talaria up` poll it (503: nothing serves yet, issue 11)
                    assert r.status == 503 and (await r.json())["checks"]["router"] == "no heartbeat"
            for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"},
                            {"Authorization": "Basic dmljdGltOng="}, {"x-api-key": "nope"}):
                for path in ("/v1/chat/completions", "/v1/completions", "/v1/models"):
                    method = s.get if path == "/v1/models" else s.post
                    async with method(base + path, json={**CHAT, "prompt": "x"}, headers=headers) as r:
                        body = await r.json()
                        assert r.status == 401 and body["error"]["code"] == "invalid_api_key", (path, headers)
                async with s.post(f"{base}/v1/messages", json={}, headers=headers) as r:
                    body = await r.json()  # Anthropic-style clients get Anthropic's error shape
                    assert r.status == 401 and body == {"type": "error", "error": {
                        "type": "authentication_error", "message": body["error"]["message"]}}
            for headers in ({"Authorization": "Bearer victim-key-0123456789"}, {"x-api-key": "victim-key-0123456789"}):
                async with s.get(f"{base}/v1/models", headers=headers) as r:
                    assert r.status == 200
            # Two Authorization headers: which one a proxy checked is anyone's guess, so neither counts.
            doubled = CIMultiDict([("Authorization", "Bearer victim-key-0123456789"),
                                   ("Authorization", "Bearer wrong-key-0123456789")])
            async with s.get(f"{base}/v1/models", headers=doubled) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["code"] == "duplicate_header", body
            # /metrics on the API port takes a key (its open listener is TALARIA_METRICS_PORT, localhost).
            async with s.get(f"{base}/metrics") as r:
                assert r.status == 401
            async with s.get(f"{base}/metrics", headers={"x-api-key": "victim-key-0123456789"}) as r:
                assert r.status == 200 and "talaria_frontend" in await r.text()
        nc = await nats.connect(nats_url)
        try:
            req = CallRequest(model="qwen3-tiny", prompt="x", max_tokens=1)
            reply = REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=10)).data)
            assert isinstance(reply, ErrorReply) and reply.status == 401
        finally:
            await nc.close()
    finally:
        await services.close()


async def cached(settings, content: str, key: str, session: str) -> int:
    status, body = await chat(settings, content, key, session)
    assert status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_cached_tokens_oracle_is_closed_across_tenants(nats_url, database_url, tmp_path):
    """The issue's attack: after the victim's call, guesses under the *same session id*
    returned more cached tokens the more bytes of the secret they got right. Each guess here
    is its tenant's first call ever, so any cached token could only be the victim's."""
    guesses = ["PASSWORD=a", "PASSWORD=h", "PASSWORD=hunter1", "PASSWORD=hunter2"]
    guess_keys = [f"guess{i}-key-0123456789" for i in range(len(guesses))]
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=60, policy="least-loaded",
                        api_keys=KEYS + tuple(f"guess{i}:{k}" for i, k in enumerate(guess_keys)))
    services = Services()
    secret = "PASSWORD=hunter2;" + "x" * 64
    try:
        await start_stack(services, settings)
        await router_ready(nats_url, type("anon", (), {"options": lambda self: {}})())
        await cached(settings, secret, "victim-key-0123456789", "shared-id")
        leaked = [await cached(settings, g, k, "shared-id") for g, k in zip(guesses, guess_keys)]
        leaked.append(await cached(settings, secret, "mallory-key-0123456789", "shared-id"))
        assert leaked == [0] * (len(guesses) + 1)
        # Within a tenant reuse still works: the victim's own next call hits its cache.
        assert await cached(settings, secret + " next turn", "victim-key-0123456789", "shared-id") > len(secret) // 2
    finally:
        await services.close()


async def test_app_role_cannot_run_programs_and_migrations_run_as_the_owner(postgres_server):
    name, role = f"t_{uuid.uuid4().hex[:12]}", f"talaria_app_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(asyncpg_dsn(postgres_server))
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    admin_url = _with_db(postgres_server, name)
    password = uuid.uuid4().hex
    try:
        await ensure_app_role(admin_url, role, password)
        host = asyncpg_dsn(admin_url).split("@", 1)[1]
        app_url = f"postgresql://{role}:{password}@{host}"
        await asyncio.get_running_loop().run_in_executor(None, upgrade, app_url)  # as the owner
        conn = await asyncpg.connect(asyncpg_dsn(app_url))
        try:
            assert await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user") is False
            assert await conn.fetchval("SELECT count(*) FROM pg_tables WHERE schemaname='talaria'") >= 6
            for attack in ("COPY (SELECT 1) TO PROGRAM 'id > /tmp/talaria-pwned'",
                           "SELECT pg_read_file('/etc/passwd')", f"CREATE ROLE evil_{role} SUPERUSER",
                           "CREATE TABLE public.x (a int)"):
                with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError):
                    await conn.execute(attack)
        finally:
            await conn.close()
    finally:
        await drop_app_role(admin_url, role)
        admin = await asyncpg.connect(asyncpg_dsn(postgres_server))
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def test_two_deployments_share_one_nats_without_seeing_each_others_calls(nats_url, database_url, db, tmp_path):
    """Deployment `blue` on the NATS that also holds deployment `talaria`'s stream: blue's
    calls are served on blue's subjects and stream; nothing lands in talaria's."""
    nc, js = await connect(nats_url, "talaria-test")  # creates TALARIA_EVENTS, as a `talaria` service would
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=60, deployment="blue")
    services = Services()
    try:
        with contextlib.suppress(Exception):
            await js.delete_stream("BLUE_EVENTS")  # an external NATS may keep one from an earlier run
        await start_stack(services, settings)
        await router_ready(nats_url, type("anon", (), {"options": lambda self: {}})(), Deployment("blue"))
        status, body = await chat(settings, "blue call", None, "blue-1")
        assert status == 200, body
        await wait_rows(db, "SELECT * FROM calls WHERE session_id='blue-1' AND outcome='completed'", 1)
        assert (await js.stream_info("BLUE_EVENTS")).state.messages > 0
        assert (await js.stream_info("TALARIA_EVENTS")).state.messages == 0
    finally:
        await services.close()
        with contextlib.suppress(Exception):
            await js.delete_stream("BLUE_EVENTS")
        await nc.close()


async def test_embedded_postgres_requires_passwords_even_on_a_data_dir_from_before(tmp_path):
    """A `.talaria/` from before issue 14 holds a trust-auth cluster: its next start sets
    passwords and requires them; services get the application role, never the superuser."""
    import os
    import subprocess

    from pathlib import Path

    from talaria.embedded import EmbeddedPostgres, _prepare_root, _reachable, _reachable_install
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    pgdata, bin_dir = (tmp_path / "pg").resolve() / "pgdata", Path(POSTGRES_BIN_PATH)
    if os.geteuid() == 0:  # where EmbeddedPostgres puts them as root (pytest's tmp root is 0700)
        pgdata, bin_dir = _reachable(pgdata), _reachable_install(bin_dir)
    pgdata.mkdir(parents=True, exist_ok=True)
    user = _prepare_root(pgdata, bin_dir) if os.geteuid() == 0 else None
    subprocess.run([str(bin_dir / "initdb"), "-D", str(pgdata), "-U", "postgres", "--auth=trust",
                    "--no-sync"], check=True, user=user, capture_output=True)
    server = await asyncio.get_running_loop().run_in_executor(None, EmbeddedPostgres(tmp_path / "pg").start)
    try:
        assert (tmp_path / "pg" / "credentials.json").stat().st_mode & 0o777 == 0o600
        conn = await asyncpg.connect(asyncpg_dsn(server.url))
        assert await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user") is False
        await conn.close()
        with pytest.raises(asyncpg.exceptions.InvalidPasswordError):
            await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{server.port}/talaria")
    finally:
        server.stop()
        if pgdata != (tmp_path / "pg").resolve() / "pgdata":
            import shutil

            shutil.rmtree(pgdata, ignore_errors=True)


@pytest.mark.parametrize("kind", ["user", "token", "nkey"])
async def test_external_nats_credentials_from_settings(kind, tmp_path):
    """Each credential kind an external NATS may demand, read from the environment."""
    import json
    import os
    import subprocess

    import nkeys

    from talaria.embedded import nats_server_binary, wait_for_port

    env: dict[str, str] = {}
    if kind == "user":
        auth, env = {"users": [{"user": "svc", "password": "pw-123"}]}, {"TALARIA_NATS_USER": "svc",
                                                                         "TALARIA_NATS_PASSWORD": "pw-123"}
    elif kind == "token":
        auth, env = {"token": "tok-123"}, {"TALARIA_NATS_TOKEN": "tok-123"}
    else:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        (tmp_path / "user.nk").write_bytes(seed)
        public = nkeys.from_seed(bytearray(seed)).public_key.decode()
        auth, env = {"users": [{"nkey": public}]}, {"TALARIA_NATS_NKEY_SEED": str(tmp_path / "user.nk")}
    port = free_port()
    (tmp_path / "nats.conf").write_text(json.dumps({"authorization": auth}))
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd",
                             str(tmp_path / "js"), "-c", str(tmp_path / "nats.conf"), "-l", str(tmp_path / "log")])
    try:
        wait_for_port(port, proc, "nats", 20, tmp_path / "log")
        url = f"nats://127.0.0.1:{port}"
        settings = Settings.from_env({"TALARIA_NATS_URL": url, **env})
        nc, js = await connect(url, "talaria-gateway", **settings.common.nats_options())
        assert (await js.stream_info(DEP.events_stream)).config.name == DEP.events_stream
        await nc.close()
        with pytest.raises(Exception):
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3)
    finally:
        proc.terminate()
        proc.wait(10)


async def test_a_call_id_is_not_enough_to_cancel_another_tenants_call(nats_url, database_url, db, tmp_path):
    """Cancels go through the gateway, which stamps the key's tenant; an agent stops only that
    tenant's call. Mallory knows the victim's call id and still cannot stop it; the victim can."""
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        call_timeout_s=60, policy="least-loaded", api_keys=KEYS)
    services = Services()
    try:
        await start_stack(services, settings)
        await router_ready(nats_url, type("anon", (), {"options": lambda self: {}})())
        # Each tenant's client replies in its own inbox space (else the gateway drops the request).
        nc = await nats.connect(nats_url, inbox_prefix=subjects.client_inbox_prefix("victim"))
        other = await nats.connect(nats_url, inbox_prefix=subjects.client_inbox_prefix("mallory"))
        streaming = asyncio.Event()

        async def on_token(msg):
            streaming.set()

        await nc.subscribe(DEP.tokens("victim", "victim-call"), cb=on_token)

        async def victim_call(call_id: str, max_tokens: int):
            req = CallRequest(model="qwen3-tiny", prompt="go on", session_id="v", call_id=call_id,
                                max_tokens=max_tokens, temperature=0, stream=True, api_key="victim-key-0123456789")
            return REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=60)).data)

        async def cancel(call_id: str, key: str | None):
            msg = await (other if key and key.startswith("mallory") else nc).request(DEP.api_cancel, encode(CancelCall(call_id, "x", api_key=key)), timeout=10)
            return msgspec.json.decode(msg.data)

        pending = asyncio.ensure_future(victim_call("victim-call", 48))
        await asyncio.wait_for(streaming.wait(), 30)
        assert (await cancel("victim-call", None))["status"] == 401  # no key: refused at the gateway
        assert (await cancel("victim-call", "mallory-key-0123456789"))["type"] == "cancel_sent"
        reply = await pending
        assert isinstance(reply, CallResult) and reply.usage.completion_tokens == 48, reply
        # Mallory's early cancel of an id the victim will use later does not stop it either.
        await cancel("victim-later", "mallory-key-0123456789")
        assert isinstance(await victim_call("victim-later", 2), CallResult)
        # The victim's own cancel works.
        await cancel("victim-own", "victim-key-0123456789")
        own = await victim_call("victim-own", 2)
        assert isinstance(own, ErrorReply) and own.status == CANCELLED_STATUS
        await nc.close()
        await other.close()
    finally:
        await services.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only: Postgres then runs as another user")
async def test_embedded_postgres_as_root_never_opens_the_data_directorys_parents(tmp_path):
    """Issue 25: as root, the setup made every parent of the data directory world-readable (a
    0700 directory became 0755). A closed parent stays closed; the cluster lives elsewhere."""
    import shutil

    from talaria.embedded import EmbeddedPostgres

    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    closed.chmod(0o700)
    pg = EmbeddedPostgres(closed / "data")
    try:
        pg.start()
        assert closed.stat().st_mode & 0o777 == 0o700
        conn = await asyncpg.connect(asyncpg_dsn(pg.admin_url))
        assert await conn.fetchval("SELECT 1") == 1
        await conn.close()
        assert (closed / "data" / "pgdata").is_symlink()
    finally:
        pg.stop()
        home = (closed / "data" / "pgdata").resolve()
        if home != closed / "data" / "pgdata":
            shutil.rmtree(home, ignore_errors=True)
