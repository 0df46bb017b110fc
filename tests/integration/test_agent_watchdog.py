"""The agent watchdog over a real stack: a call whose engine step hangs is failed with a
clear error, the agent's heartbeat says it is unhealthy so the router sends new calls to
the other agent, and once the step returns the agent is healthy and serving again."""

from __future__ import annotations

import asyncio
import threading

import nats
import pytest

from talaria.embedded import free_port
from talaria.services.instance_agent import agent_service
from talaria.shared.messages import CallRequest, CallResult, ErrorReply, REPLY_DECODER
from talaria.shared.snapshots import SNAPSHOT_DECODER
from talaria.shared.wire import encode
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from tests.integration.harness import Services
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration


async def test_a_stuck_engine_step_fails_its_call_flags_the_agent_and_the_stack_keeps_serving(
        nats_url, database_url, tmp_path, monkeypatch):
    gate = threading.Event()  # holds the engine thread of whichever agent takes the "stuck" call
    build = agent_service._build_engine

    def build_with_hang(*args):
        engine = build(*args)

        def on_logits(call_ids, logits):  # runs on the engine thread, inside the step
            if any(c.startswith("stuck") for c in call_ids):
                gate.wait(60)

        engine.on_logits = on_logits
        return engine

    monkeypatch.setattr(agent_service, "_build_engine", build_with_hang)
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="least-loaded",
                        http_port=free_port(), session_idle_s=3600, call_timeout_s=60, watchdog_min_s=3.0)
    services = Services()
    nc = await nats.connect(nats_url)
    try:
        await services.start_control_plane(settings)
        for i in range(2):
            await services.start(f"agent-{i}", agent_service.run,
                                 settings.with_(instance_id=f"agent-{i}", models=("qwen3-tiny",)))
        await wait_for_router(nc, instances=2)
        health: dict[str, asyncio.Queue] = {"agent-0": asyncio.Queue(), "agent-1": asyncio.Queue()}

        async def on_snapshot(msg):
            snap = SNAPSHOT_DECODER.decode(msg.data)
            await health[snap.instance_id].put(snap)

        await nc.subscribe(DEP.telemetry_wildcard, cb=on_snapshot)

        async def call(call_id, session):
            req = CallRequest(model="qwen3-tiny", prompt="hello", session_id=session, call_id=call_id,
                                max_tokens=4)
            return REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=30)).data)

        stuck = await call("stuck-1", "w-stuck")
        assert isinstance(stuck, ErrorReply) and stuck.status == 500 and "watchdog" in stuck.message

        async def first(instance, pred):
            while not pred(snap := await health[instance].get()):
                pass
            return snap

        flagged = await asyncio.wait_for(_either(first("agent-0", lambda s: not s.healthy),
                                                 first("agent-1", lambda s: not s.healthy)), 10)
        sick = flagged.instance_id
        assert "step" in flagged.unhealthy_reason
        # While it is stuck, new calls go to the other agent and succeed.
        for i in range(4):
            reply = await call(f"ok-{i}", f"w-ok-{i}")
            assert isinstance(reply, CallResult) and reply.instance_id != sick, reply
        gate.set()  # the step returns: the agent releases the failed call and is healthy again
        healed = await asyncio.wait_for(first(sick, lambda s: s.healthy and s.running == 0), 10)
        assert healed.unhealthy_reason == ""
        reply = await call("ok-after", "w-after")
        assert isinstance(reply, CallResult)
    finally:
        gate.set()
        await nc.close()
        await services.close()


async def _either(*coros):
    tasks = [asyncio.ensure_future(c) for c in coros]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    return done.pop().result()
