"""`talaria up --nats-cluster 3`: three embedded JetStream servers with the services' users,
every stream on all three; a member killed with SIGKILL is restarted on its ports by the
supervisor while calls go on; a stranger pointed at the route ports stack.json lists is refused."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import nats
import openai
import pytest

from talaria.embedded import free_port
from talaria.shared.bus import servers
from talaria.shared.nats_auth import SERVICE_INBOX
from tests.e2e.test_stack import Stack
from tests.integration.test_cluster_routes import Stranger, assert_stranger_refused
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.e2e


async def stream_replicas(url: str, user: str, password: str, stream: str = DEP.events_stream) -> int:
    nc = await nats.connect(servers(url), user=user, password=password, inbox_prefix=SERVICE_INBOX)
    try:
        for attempt in range(4):  # a stream whose leader was on the restarted member may still be electing
            try:
                return (await nc.jetstream().stream_info(stream)).config.num_replicas
            except nats.errors.TimeoutError:
                if attempt == 3:
                    raise
    finally:
        await nc.close()


def test_a_three_node_cluster_serves_through_the_loss_of_a_member(tmp_path):
    data_dir, port = tmp_path / "data", free_port()
    stack = Stack(data_dir, port, "--nats-cluster", "3", agents=1)
    try:
        stack.wait_for(r"ready in", timeout=120)
        key = stack.wait_for(r"API key .*: (\S+)", timeout=10).group(1)
        described = json.loads((data_dir / "stack.json").read_text())
        members = {k: v for k, v in described["pids"].items() if k.startswith("EmbeddedNats:")}
        assert sorted(members) == ["EmbeddedNats:nats-0", "EmbeddedNats:nats-1", "EmbeddedNats:nats-2"]
        assert len(servers(described["nats"])) == 3
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)

        def call(i: int):
            return client.chat.completions.create(model="qwen3-tiny", max_tokens=4, temperature=0,
                                                  messages=[{"role": "user", "content": f"turn {i}"}],
                                                  extra_headers={"X-Session-Id": "cluster-e2e"})

        call(0)
        os.kill(members["EmbeddedNats:nats-1"], signal.SIGKILL)
        stack.wait_for(r"embedded nats-1 restarted on port", timeout=30)
        for i in range(1, 4):  # served after the loss (and the member's return)
            assert call(i).usage.completion_tokens >= 1
        again = json.loads((data_dir / "stack.json").read_text())["pids"]["EmbeddedNats:nats-1"]
        assert again != members["EmbeddedNats:nats-1"]
        # Every stream is on all three members (read as the router's user, from the auth config).
        auth = json.loads((data_dir / "nats-cluster" / "node-0" / "auth.conf").read_text())
        router = next(u for u in auth["authorization"]["users"] if u["user"].endswith("router"))
        assert asyncio.run(stream_replicas(described["nats"], router["user"], router["password"])) == 3
        gateway = next(u for u in auth["authorization"]["users"] if u["user"].endswith("gateway"))
        for stream in (DEP.replies_stream, DEP.idempotency_stream):  # the gateway's streams too
            assert asyncio.run(stream_replicas(described["nats"], gateway["user"], gateway["password"], stream)) == 3
        # The route ports stack.json lists take no stranger, even one that knows the cluster's name.
        cluster = described["nats_cluster"]
        assert cluster["name"] == "talaria" and len(cluster["routes"]) == 3
        assert all("@" not in route for route in cluster["routes"])  # no credentials in stack.json
        stranger = Stranger(tmp_path / "stranger", cluster["name"], cluster["routes"])
        try:
            asyncio.run(assert_stranger_refused(stranger, 3, described["nats"],
                                                {"user": router["user"], "password": router["password"]}))
        finally:
            stranger.stop()
    finally:
        if stack.proc.poll() is None:
            stack.proc.send_signal(signal.SIGINT)
            try:
                stack.proc.wait(60)
            except subprocess.TimeoutExpired:
                stack.proc.kill()
