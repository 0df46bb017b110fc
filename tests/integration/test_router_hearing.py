"""A NATS pause is the router's silence, not the agents': it must not declare them lost
(issue 15: a 5 s pause failed a finished call's row through a false InstanceLost)."""

from __future__ import annotations

import asyncio
import os
import signal

import nats
import pytest

from talaria.embedded import EmbeddedNats, free_port
from talaria.services.gateway.gateway_service import run as run_gateway
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.services.router.router_core import LOST_AFTER_BEATS
from talaria.services.router.router_service import run as run_router
from talaria.shared.events import InstanceLost
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from tests.integration.harness import Services
from tests.integration.test_router_restart import call, stream_events
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration


@pytest.fixture
def own_nats(tmp_path):
    """A NATS server this test may pause (SIGSTOP), apart from the shared one."""
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server
    os.kill(server.proc.pid, signal.SIGCONT)
    server.stop()


async def test_a_nats_pause_longer_than_the_loss_bound_loses_no_instance(own_nats, database_url, tmp_path):
    settings = Settings.of(nats_url=own_nats.url, database_url=database_url, data_dir=tmp_path,
                        http_port=free_port(), call_timeout_s=60, policy="talaria")
    services = Services()
    try:
        await services.start("router", run_router, settings)
        await services.start("gateway", run_gateway, settings)
        await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0", models=("qwen3-tiny",)))
        nc = await nats.connect(own_nats.url)
        await wait_for_router(nc, instances=1)
        await call(nc, "s", "before the pause")
        # The fault itself: the bus stops for longer than the router's loss bound.
        os.kill(own_nats.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(LOST_AFTER_BEATS * settings.agent.heartbeat_s + 1.5)
        os.kill(own_nats.proc.pid, signal.SIGCONT)
        # The router publishes in order: anything it decided during the pause is on the stream
        # before the routing of this call.
        await call(nc, "s", "before the pause, and after it")
        lost = [e for e in await stream_events(nc.jetstream(), DEP.event("instance.lost")) if isinstance(e, InstanceLost)]
        assert lost == []
        await nc.close()
    finally:
        await services.close()
