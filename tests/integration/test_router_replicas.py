"""Two router processes split the sessions; one is SIGKILLed under load. Its partitions are
taken over within one ownership TTL (plus the survivor's renewal period), no call is lost,
none is routed twice (the call-id fence), and each decision is audited once (stream and
Postgres)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import nats
import pytest

from talaria.services.gateway.gateway_service import run as run_gateway
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.services.router.ownership import RENEWALS_PER_TTL, partition_of
from talaria.services.router.router_service import durable
from talaria.services.telemetry.telemetry_service import run as run_telemetry
from talaria.shared.events import EVENT_DECODER
from talaria.shared.messages import CallRequest, CallResult, REPLY_DECODER
from talaria.shared.settings import Settings
from talaria.shared.wire import encode
from talaria.embedded import free_port
from tests.integration.harness import Owners, Services, stop_process, wait_rows
from tests.integration.test_router_restart import stream_events
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration
TTL_S = 2.0
PARTITIONS = 8
SESSIONS, CALLS = 8, 5


def start_router(settings: Settings, router_id: str) -> subprocess.Popen:
    env = dict(os.environ, TALARIA_NATS_URL=settings.common.nats_url, TALARIA_DATABASE_URL=settings.common.database_url,
               TALARIA_DATA_DIR=str(settings.common.data_dir), TALARIA_POLICY="talaria", TALARIA_LOG_LEVEL="warning",
               TALARIA_ROUTER_ID=router_id, TALARIA_ROUTER_PARTITIONS=str(PARTITIONS),
               TALARIA_ROUTER_OWNERSHIP_TTL_S=str(TTL_S))
    return subprocess.Popen([sys.executable, "-m", "talaria.services.router"], env=env)


async def test_a_router_killed_under_load_loses_no_call_and_routes_none_twice(nats_url, database_url, db, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        session_idle_s=3600, call_timeout_s=120)
    services = Services()
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    owners = Owners()
    await nc.subscribe(DEP.health("router"), cb=owners.on_beat)
    # Core-NATS copies of every publish, duplicates included (the stream would drop a second
    # CallRouted or RoutingDecision of a call as a duplicate: only these would show it).
    dispatched, decided = Counter(), Counter()
    victim: dict = {}  # once armed: router-1's partitions; then when it was killed

    async def on_dispatch(msg):
        routed = EVENT_DECODER.decode(msg.data)
        dispatched[routed.call.call_id] += 1
        # Kill router-1 right after it decided one of its calls: its submission is then most
        # likely not yet acked (acked once the outputs are stored), so the survivor gets it
        # again and the call-id fence must hold.
        if "parts" in victim and "at" not in victim and \
                partition_of(routed.call.session_id, PARTITIONS) in victim["parts"]:
            routers["router-1"].send_signal(signal.SIGKILL)
            victim["at"] = time.monotonic()
            killed.set()

    async def on_decision(msg):
        decided[EVENT_DECODER.decode(msg.data).call_id] += 1

    await nc.subscribe(f"{DEP.dispatch_prefix}.*", cb=on_dispatch)
    await nc.subscribe(DEP.event("decision"), cb=on_decision)
    routers = {rid: start_router(settings, rid) for rid in ("router-0", "router-1")}
    try:
        await services.start("telemetry", run_telemetry, settings)
        await services.start("gateway", run_gateway, settings)
        for i in range(2):
            await services.start(f"agent-{i}", run_agent,
                                 settings.with_(instance_id=f"agent-{i}", models=("qwen3-tiny",)))
        every = set(range(PARTITIONS))
        # Both routers up and the partitions split between them (one consumer each, no overlap).
        await owners.until(lambda o: len([r for r in o.values() if r]) == 2
                           and set.union(*o.values()) == every and sum(map(len, o.values())) == PARTITIONS, 60)
        victim_parts = set(owners.by_router["router-1"])
        killed = asyncio.Event()

        done = Counter()
        progressed = asyncio.Event()

        async def session(k: int) -> list[CallResult]:
            out = []
            for i in range(CALLS):
                req = CallRequest(model="qwen3-tiny", prompt=f"session {k} call {i}", session_id=f"sess-{k}",
                                  max_tokens=4, temperature=0)
                reply = REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=90)).data)
                assert isinstance(reply, CallResult), reply  # never an error: no call is lost
                out.append(reply)
                done["calls"] += 1
                if done["calls"] >= SESSIONS * CALLS // 3:
                    progressed.set()
            return out

        load = [asyncio.create_task(session(k)) for k in range(SESSIONS)]
        await asyncio.wait_for(progressed.wait(), 120)
        victim["parts"] = victim_parts
        await asyncio.wait_for(killed.wait(), 120)
        killed_at = victim["at"]
        routers["router-1"].wait(10)
        unacked = sum([(await js.consumer_info(DEP.events_stream, durable(p))).num_ack_pending
                       for p in victim_parts])
        # The survivor owns every partition within one TTL (its claims of router-1's lapse then)
        # plus one renewal period to notice, plus the catch-up and consumer recreation.
        await owners.until(lambda o: o.get("router-0") == every, TTL_S * 3 + 10)
        takeover_s = time.monotonic() - killed_at
        print(f"\ntakeover of {sorted(victim_parts)} after {takeover_s:.2f} s (TTL {TTL_S} s); "
              f"{unacked} submission(s) fetched by the dead router and not acked, delivered again")
        assert takeover_s <= TTL_S + TTL_S / RENEWALS_PER_TTL + 1.5
        results = await asyncio.wait_for(asyncio.gather(*load), 180)
        total = SESSIONS * CALLS
        assert sum(map(len, results)) == total
        call_ids = {r.call_id for rs in results for r in rs}
        assert len(call_ids) == total

        await nc.flush()
        assert set(dispatched) == call_ids and max(dispatched.values()) == 1, "a call was routed twice"
        assert set(decided) == call_ids and max(decided.values()) == 1, "a call was decided twice"
        routed = await stream_events(js, f"{DEP.call_routed_prefix}.>")
        assert Counter(e.call.call_id for e in routed) == Counter(call_ids)
        decisions = Counter(e.call_id for e in await stream_events(js, DEP.event("decision")))
        assert decisions == Counter(call_ids), "a decision is not in the audit log once"
        rows = await wait_rows(db, "SELECT call_id FROM lease_decisions", total, timeout=30)
        assert {r["call_id"] for r in rows} == call_ids
    finally:
        for proc in routers.values():
            stop_process(proc)
        await services.close()
        await nc.close()
