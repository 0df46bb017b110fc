"""Kill the router mid-run (SIGKILL) and restart it: no call lost or routed twice, live
leases come back and are consumed, leases that lapsed while it was down expire."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from talaria.services.gateway.gateway_service import run as run_gateway
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.services.telemetry.telemetry_service import run as run_telemetry
from talaria.shared.events import EVENT_DECODER
from talaria.shared.messages import CallRequest, CallResult, REPLY_DECODER
from talaria.shared.wire import encode
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from talaria.embedded import free_port
from tests.integration.harness import Services, stop_process
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration
TAU_S = 8.0


def start_router(settings: Settings) -> subprocess.Popen:
    env = dict(os.environ, TALARIA_NATS_URL=settings.common.nats_url, TALARIA_DATABASE_URL=settings.common.database_url,
               TALARIA_DATA_DIR=str(settings.common.data_dir), TALARIA_POLICY="talaria",
               TALARIA_LEASE_TIMEOUT_S=str(TAU_S), TALARIA_LOG_LEVEL="warning",
               TALARIA_ROUTER_ID="router-0")  # as `talaria up` runs it: a restart adopts its partitions at once
    return subprocess.Popen([sys.executable, "-m", "talaria.services.router"], env=env)


async def call(nc, session: str, prompt: str) -> CallResult:
    req = CallRequest(model="qwen3-tiny", prompt=prompt, session_id=session, max_tokens=4, temperature=0)
    reply = REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=90)).data)
    assert isinstance(reply, CallResult), reply
    return reply


async def stream_events(js, subject: str) -> list:
    sub = await js.pull_subscribe(subject, stream=DEP.events_stream,
                                  config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL))
    out = []
    while True:
        try:
            msgs = await sub.fetch(100, timeout=1.0)
        except asyncio.TimeoutError:
            break
        out += [EVENT_DECODER.decode(x.data) for x in msgs]
    await sub.unsubscribe()
    return out


async def test_router_killed_and_restarted_loses_nothing_and_keeps_its_leases(nats_url, database_url, db, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=120)
    services = Services()
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    router = start_router(settings)
    try:
        await services.start("telemetry", run_telemetry, settings)
        await services.start("gateway", run_gateway, settings)
        for i in range(2):
            await services.start(f"agent-{i}", run_agent,
                                 settings.with_(instance_id=f"agent-{i}", models=("qwen3-tiny",)))
        await wait_for_router(nc, instances=2)
        issued = await nc.subscribe(DEP.event("lease.issued"))
        first_a = await call(nc, "A", "session A, first call")
        await call(nc, "B", "session B, first call")
        leases = {}
        while len(leases) < 2:
            lease = EVENT_DECODER.decode((await issued.next_msg(timeout=10)).data)
            leases[lease.session_id] = lease
        assert leases["A"].instance_id == first_a.instance_id

        router.send_signal(signal.SIGKILL)
        router.wait(10)
        # Submitted while no router runs: it waits in the stream, it is not lost.
        pending = asyncio.create_task(call(nc, "A", "session A, first call" + first_a.text + " then more"))
        expired = await nc.subscribe(DEP.event("lease.expired"))
        router = start_router(settings)
        second_a = await asyncio.wait_for(pending, 90)
        assert second_a.instance_id == first_a.instance_id and second_a.call_index == 1
        assert second_a.kv_source == "device"
        # B's lease survived the restart and lapses on schedule, reported by the new router.
        lapsed = EVENT_DECODER.decode((await expired.next_msg(timeout=TAU_S + 20)).data)
        assert lapsed.session_id == "B" and lapsed.at >= leases["B"].expires_at

        routed = await stream_events(js, f"{DEP.call_routed_prefix}.>")
        ids = [e.call.call_id for e in routed]
        assert len(ids) == len(set(ids)) == 3, "a call was routed twice or lost"
        consumed = await stream_events(js, DEP.event("lease.consumed"))
        assert [(e.session_id, e.instance_id) for e in consumed] == [("A", first_a.instance_id)]
    finally:
        stop_process(router)
        await services.close()
        await nc.close()
