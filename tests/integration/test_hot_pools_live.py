"""Hot pools chosen by the router from measured demand, over real NATS: the router hears the
calls it routes and completes, decides that the model every session asks for should keep an
instance resident (services/router/hot_pools.py), publishes PoolPinned, and the agent named
repins and says so in its heartbeat; calls keep being served, and a restarted router finds
the pools in its checkpoint."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest

from talaria.embedded import free_port
from talaria.services.instance_agent import agent_service
from talaria.services.router.projection import ProjectionStore
from talaria.services.router.router_service import run as run_router
from talaria.shared.db.connection import create_engine
from talaria.shared.events import PoolPinned
from talaria.shared.health import wait_for_router
from talaria.shared.messages import REPLY_DECODER, CallRequest, CallResult
from talaria.shared.settings import Settings
from talaria.shared.snapshots import SNAPSHOT_DECODER
from talaria.shared.wire import encode
from tests.integration.harness import Services
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration

MODELS = ("qwen3-tiny", "gpt2-tiny")


async def test_the_router_pins_the_model_the_traffic_asks_for_and_the_agent_serves_it_hot(
        nats_url, database_url, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                        http_port=free_port(), session_idle_s=3600, call_timeout_s=60, hot_pools=True,
                        models=MODELS)
    services = Services()
    nc = await nats.connect(nats_url)
    try:
        await services.start_control_plane(settings)
        for i in range(2):
            await services.start(f"agent-{i}", agent_service.run, settings.with_(instance_id=f"agent-{i}"))
        await wait_for_router(nc, instances=2)
        decisions: asyncio.Queue = asyncio.Queue()
        pinned: asyncio.Queue = asyncio.Queue()

        async def on_decision(msg):
            await decisions.put(msgspec.json.decode(msg.data, type=PoolPinned))

        async def on_snapshot(msg):
            snap = SNAPSHOT_DECODER.decode(msg.data)
            if snap.pinned_model:
                await pinned.put(snap)

        await nc.subscribe(DEP.event("pool.pinned"), cb=on_decision)
        await nc.subscribe(DEP.telemetry_wildcard, cb=on_snapshot)

        async def call(call_id, session):
            req = CallRequest(model="gpt2-tiny", prompt="hello there", session_id=session, call_id=call_id,
                              max_tokens=4)
            return REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=30)).data)

        for k in range(4):  # every session asks for gpt2-tiny: its demand share is all of it
            reply = await call(f"hp-{k}", f"hp-session-{k}")
            assert isinstance(reply, CallResult), reply
        decision = await asyncio.wait_for(decisions.get(), 20)
        assert decision.model == "gpt2-tiny" and decision.previous is None  # a cold agent turns hot
        assert decision.instance_id in ("agent-0", "agent-1") and "instances of demand" in decision.reason
        snap = await asyncio.wait_for(_first(pinned, lambda s: s.instance_id == decision.instance_id), 20)
        assert snap.pool == "hot" and snap.pinned_model == "gpt2-tiny"
        reply = await call("hp-after", "hp-session-0")  # still served, by a hot instance or the other
        assert isinstance(reply, CallResult), reply
        # The router stops (saving its checkpoint) and restarts: the saved state holds the pools
        # as the controller left them, the sessions it measured included, and serving goes on.
        router = next(r for r in services.running if r.name == "router")
        await router.close()
        services.running.remove(router)
        store = ProjectionStore(create_engine(database_url))
        try:
            saved, _ = await store.load()
        finally:
            await store.db.dispose()
        assert saved.pools is not None and saved.pools.pins[decision.instance_id] == "gpt2-tiny"
        measured = dict(saved.pools.to_dict()["models"])["gpt2-tiny"]
        assert measured["calls"] >= 4 and measured["total_work"] > 0  # the completions it measured
        await services.start("router", run_router, settings)
        reply = await call("hp-restarted", "hp-session-1")
        assert isinstance(reply, CallResult), reply
        while not decisions.empty():  # nothing was ever pinned to the model no one asked for
            assert (await decisions.get()).model == "gpt2-tiny"
    finally:
        await nc.close()
        await services.close()


async def _first(queue: asyncio.Queue, pred):
    while not pred(item := await queue.get()):
        pass
    return item
