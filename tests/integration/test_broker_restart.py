"""Issue 25 item 3: replies survive a broker restart. A reply is a core-NATS message: a gateway
cut off from NATS while it was sent never sees it. It is kept (the REPLIES stream; a keyed
call's in the idempotency stream), the gateway looks up every waiting call's reply when its
connection comes back, and an agent whose connection dropped after replying sends it again,
so the client is answered within seconds, never at the call timeout."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import aiohttp
import nats
import pytest
import structlog
from nats.js.errors import NotFoundError
from opentelemetry import trace

from talaria.embedded import EmbeddedNats, free_port
from talaria.services.gateway.idempotency_rules import is_outcome_subject
from talaria.services.gateway.submitter import Submitter
from talaria.services.instance_agent.record_sender import RecordSender
from talaria.shared import messages as m
from talaria.shared.health import wait_for_router
from talaria.shared.bus import close, connect
from talaria.shared.events import CallSubmitted
from talaria.shared.nats_auth import sender_headers
from talaria.shared.settings import Settings
from talaria.shared.wire import encode
from tests.integration.harness import Services, wait_rows, wait_until
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration
TIMEOUT_S = 60.0  # the call timeout: an answer must come long before it


def result(call_id: str) -> m.CallResult:
    return m.CallResult(call_id=call_id, session_id="s1", call_index=0, model="qwen3-tiny", instance_id="agent-0",
                        text="kept", finish_reason="length", usage=m.Usage(2, 1, 3, 0),
                        timings=m.Timings(0.0, 0.0, 0.0, 0.0, 0.0, 0.0))


@contextlib.asynccontextmanager
async def missed_reply(nats_url: str, call_id: str):
    """A gateway's call whose answer the agent sent while the gateway was cut off (what a broker
    restart does to its subscription): yields (submitter, its JetStream context, the pending
    answer to the client), and stops everything after."""
    gw_nc, gw_js = await connect(nats_url, "talaria-gateway")
    agent_nc, _ = await connect(nats_url, "talaria-agent-agent-0")
    submitter = Submitter(gw_nc, gw_js, trace.get_tracer("test"), TIMEOUT_S, structlog.get_logger())
    await submitter.start()
    try:
        call = CallSubmitted(call_id=call_id, session_id="s1", model="qwen3-tiny", prompt_ids=[1, 2],
                             block_hashes=[], max_tokens=1, submitted_at=time.time())
        pending = asyncio.ensure_future(submitter.submit(call))

        async def submitted():  # the stream acked it: no event says so
            return call_id in submitter._calls

        await wait_until(submitted, f"call {call_id} submitted", timeout=10, every=0.01)
        await submitter._sub.unsubscribe()
        submitter._sub = None
        reply_to = submitter._calls[call_id].reply_to
        await agent_nc.publish(reply_to, encode(result(call_id)), headers=sender_headers(agent_nc))
        await agent_nc.flush()
        stream = DEP.idempotency_stream if is_outcome_subject(reply_to) else DEP.replies_stream

        async def kept():  # the stream stores a plain publish after the server has taken it
            try:
                return await gw_js.get_last_msg(stream, reply_to) is not None
            except NotFoundError:
                return False

        await wait_until(kept, f"the reply to {call_id} kept in {stream}", timeout=10, every=0.01)
        yield submitter, gw_js, pending
    finally:
        await submitter.stop()
        await close(gw_nc)
        await close(agent_nc)


async def test_a_reply_the_gateway_missed_is_found_when_its_connection_comes_back(nats_url):
    async with missed_reply(nats_url, "lost-1") as (submitter, _, pending):
        assert await submitter.recover() == 1  # what the gateway does when its connection is back
        reply = await asyncio.wait_for(pending, 5.0)
        assert isinstance(reply, m.CallResult) and reply.text == "kept"


class _ElectingJs:
    """The gateway's JetStream context with a stream that answers its first reply lookup with a
    timeout, as one whose leader is being elected does (a test double of that moment: a real
    election cannot be started on cue); everything else goes to the real context."""

    def __init__(self, js) -> None:
        self.js, self.lookups = js, 0

    async def get_last_msg(self, stream, subject):
        self.lookups += 1
        if self.lookups == 1:
            raise nats.errors.TimeoutError
        return await self.js.get_last_msg(stream, subject)

    def __getattr__(self, name):
        return getattr(self.js, name)


async def test_a_kept_reply_is_looked_up_again_when_its_stream_is_electing_a_leader(nats_url):
    async with missed_reply(nats_url, "lost-2") as (submitter, gw_js, pending):
        submitter.js = electing = _ElectingJs(gw_js)
        assert await submitter.recover() == 1 and electing.lookups == 2
        assert (await asyncio.wait_for(pending, 5.0)).text == "kept"


class _Nc:
    """A NATS connection that reconnects (a test double: the broker dropping the bytes of a
    publish that was written to its socket cannot be arranged on a real one on cue)."""

    def __init__(self) -> None:
        self.stats = {"reconnects": 0}
        self.options = {"name": "talaria-agent-agent-0"}
        self.sent: list[str] = []
        self.flushes = 0

    async def publish(self, subject, data, headers=None):
        self.sent.append(subject)

    async def flush(self, timeout=None):
        self.flushes += 1
        if self.flushes == 1:  # the first flush finds the connection replaced since the reply
            self.stats["reconnects"] += 1


async def test_an_agent_sends_its_replies_again_after_a_reconnect():
    nc = _Nc()
    sender = RecordSender(nc, None, structlog.get_logger())
    await asyncio.wait_for(sender._delivered("c1", [("reply.c1", b"{}")], reconnects=0), 5.0)
    assert nc.sent == ["reply.c1"]  # published again once, then confirmed on a steady connection


async def test_calls_in_flight_when_the_broker_is_killed_are_answered_within_seconds(
        database_url, db, tmp_path):
    """SIGKILL of nats-server under load, restarted on the same port and store (as the
    supervisor does): every call is answered 200 long before the call timeout, and runs once."""
    server = EmbeddedNats(tmp_path / "nats").start()
    settings = Settings.of(nats_url=server.url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=TIMEOUT_S, models=("qwen3-tiny",))
    services = Services()
    try:
        await services.start_control_plane(settings)
        from talaria.services.instance_agent.agent_service import run as run_agent
        await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0"))
        nc = await nats.connect(server.url)
        await wait_for_router(nc, instances=1)
        await nc.close()

        async def call(i: int, s: aiohttp.ClientSession) -> tuple[int, float]:
            t0 = time.monotonic()
            body = {"model": "qwen3-tiny", "max_tokens": 64, "temperature": 0,
                    "messages": [{"role": "user", "content": f"call {i}"}]}
            async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions", json=body,
                              headers={"X-Session-Id": f"k{i}", "Idempotency-Key": f"key-{i}"}) as r:
                await r.read()
                return r.status, time.monotonic() - t0

        watcher = await nats.connect(server.url, allow_reconnect=False)
        started = await watcher.subscribe(DEP.event("call.started"))
        async with aiohttp.ClientSession() as s:
            calls = [asyncio.ensure_future(call(i, s)) for i in range(6)]
            await started.next_msg(timeout=60)  # an agent is running a call
            await watcher.close()
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
            server.start()
            answers = await asyncio.gather(*calls)
        assert all(status == 200 for status, _ in answers), answers
        assert max(t for _, t in answers) < TIMEOUT_S / 3, answers
        await wait_rows(db, "SELECT 1 FROM calls WHERE outcome = 'completed'", 6, timeout=60)
        rows = await db.fetch("SELECT session_id, count(*) AS n FROM calls GROUP BY 1")
        assert all(r["n"] == 1 for r in rows), rows  # none ran twice
    finally:
        await services.close()
        server.stop()
