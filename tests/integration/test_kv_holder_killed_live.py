"""A live holder SIGKILLed in the middle of a transfer (issue 40): agent-0 runs as its own
process, as `talaria up` runs it (`python -m talaria.services.instance_agent`), with the
page server's stall fault on (TALARIA_FAULT_PAGE_STALL=STALL: each pull gets STALL pages,
then nothing). A session's return is forced onto agent-1 (a drain; a repin), agent-1 starts
pulling the session's pages, the test waits for agent-0's "stalled" log line and kills it.
The return still completes on agent-1 with the greedy text of a session that stayed, from
the STALL pages that arrived plus a recompute; Postgres records `kv_source = migrated` with
exactly those pages' bytes, the router declares agent-0 lost, and the drain ends non-zero
saying which sessions lost their context and why."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import asyncpg
import nats
import pytest

from talaria.drain import drain
from talaria.embedded import free_port
from talaria.services.instance_agent import agent_service
from talaria.shared.bus import event_subject, publish_event
from talaria.shared.events import EVENT_DECODER, InstanceLost, KvPushed, PoolPinned
from talaria.shared.health import wait_for_router
from talaria.shared.nats_auth import owner_sender
from talaria.shared.settings import Settings
from talaria.shared.snapshots import SNAPSHOT_DECODER
from talaria.shared.subjects import Deployment
from tests.integration.harness import Services, wait_rows, wait_until
from tests.integration.test_kv_migration_live import FIRST, MODELS, api_call

pytestmark = pytest.mark.integration

DEP = Deployment()
STALL = 2  # pages a pull gets from the holder before it stalls (the prompt spans ~20 pages)
PAGE = 16  # tokens a page holds (the torch engine's default page size)
STALLED = "kv page server stalled (fault injected)"
FOLLOW = " Tool output: 3 passed, 1 failed. Next step:"


def start_holder(settings: Settings, instance_id: str, log_path, transport: str) -> subprocess.Popen:
    """An agent process as `talaria up` starts one, with the stall fault on; its log to a file."""
    env = dict(os.environ, TALARIA_NATS_URL=settings.common.nats_url,
               TALARIA_DATABASE_URL=settings.common.database_url, TALARIA_DATA_DIR=str(settings.common.data_dir),
               TALARIA_POLICY="talaria", TALARIA_MODELS=",".join(MODELS), TALARIA_INSTANCE_ID=instance_id,
               TALARIA_LOG_LEVEL="info", PYTHONUNBUFFERED="1", TALARIA_FAULT_PAGE_STALL=str(STALL),
               TALARIA_PAGE_TRANSPORT=transport)
    with open(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "talaria.services.instance_agent"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)


async def kill_when_stalled(holder: subprocess.Popen, log_path, pulls: int = 1) -> None:
    """SIGKILL the holder once its page server says `pulls` pulls stalled (STALL pages left it for each)."""
    async def stalled() -> bool:
        assert holder.poll() is None, f"the holder exited ({holder.returncode}) before it stalled"
        return log_path.read_text(errors="replace").count(STALLED) >= pulls

    await wait_until(stalled, f"{pulls} pull(s) from the holder to stall mid-transfer", timeout=60)
    holder.send_signal(signal.SIGKILL)
    await asyncio.get_running_loop().run_in_executor(None, holder.wait)


class Heard:
    """The events a test waits on: the router's InstanceLost and the agents' KvPushed."""

    def __init__(self) -> None:
        self.lost: list[InstanceLost] = []
        self.pushed: list[KvPushed] = []
        self.changed = asyncio.Event()

    async def on_event(self, msg) -> None:
        event = EVENT_DECODER.decode(msg.data)
        (self.lost if isinstance(event, InstanceLost) else self.pushed).append(event)
        self.changed.set()

    async def until(self, condition, timeout: float = 30.0) -> None:
        async def wait():
            while not condition():
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(wait(), timeout)


async def open_sessions(nc, tag: str) -> tuple[str, str]:
    """`tag`-moved and `tag`-stay open on agent-0 with the same first call; `stay`'s return
    runs there too: (the returns' prompt, the text of the return that stayed)."""
    first = await api_call(nc, f"{tag}-m1", f"{tag}-moved", FIRST)
    same = await api_call(nc, f"{tag}-s1", f"{tag}-stay", FIRST)
    assert first.text == same.text and first.instance_id == same.instance_id == "agent-0"
    follow = FIRST + first.text + FOLLOW
    stayed = await api_call(nc, f"{tag}-s2", f"{tag}-stay", follow)
    assert (stayed.instance_id, stayed.kv_source) == ("agent-0", "device")
    return follow, stayed.text


def holder_transport(log_path) -> str:
    """How the holder's page server moves page bytes, as its start line says."""
    lines = [json.loads(x) for x in log_path.read_text().splitlines() if '"kv page transport"' in x]
    return lines[0]["transport"]


@pytest.fixture
async def live(request, nats_url, database_url, tmp_path):
    """Control plane in this process, agent-0 (the holder, stall fault on; its page transport
    the param: auto = Mooncake where it starts) as its own process, agent-1 in this process;
    the events heard, a Postgres connection."""
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                           http_port=free_port(), session_idle_s=3600, call_timeout_s=60, models=MODELS)
    services, heard = Services(), Heard()
    nc = await nats.connect(nats_url)
    db = await asyncpg.connect(database_url)
    log_path = tmp_path / "agent-0.log"
    holder = None
    try:
        await nc.subscribe(DEP.event("instance.lost"), cb=heard.on_event)
        await nc.subscribe(DEP.event("kv.pushed"), cb=heard.on_event)
        await services.start_control_plane(settings)
        holder = start_holder(settings, "agent-0", log_path, getattr(request, "param", "auto"))
        await wait_for_router(nc, instances=1, timeout=120)
        yield settings, services, nc, db, heard, holder, log_path
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        await db.close()
        await nc.close()
        await services.close()


async def test_a_drained_holder_killed_mid_push_loses_the_context_it_had_not_sent_and_the_return_completes(live):
    settings, services, nc, db, heard, holder, log_path = live
    follow, stayed = await open_sessions(nc, "d")
    await services.start("agent-1", agent_service.run, settings.with_(instance_id="agent-1"))
    await wait_for_router(nc, instances=2)
    # The drain pushes both sessions to agent-1; each pull stalls after STALL pages; agent-0 dies there.
    draining = asyncio.create_task(drain(settings.common.nats_url, "agent-0", timeout_s=60))
    await kill_when_stalled(holder, log_path, pulls=2)  # both pushes (they run at once) hold STALL pages
    code, line = await draining
    # Whether the router folded the broken pushes or noticed agent-0 gone first, the drain
    # ends 3 (not 0: context was lost), naming what was lost and why.
    assert code == 3 and "2 session(s) lost their KV context" in line and "0 moved" in line, line
    assert "transfer broke" in line or "agent-0 was lost while draining" in line, line
    await heard.until(lambda: any(e.instance_id == "agent-0" for e in heard.lost))  # the router noticed
    await heard.until(lambda: len(heard.pushed) == 2)
    pushed = next(e for e in heard.pushed if e.session_id == "d-moved")
    assert (pushed.instance_id, pushed.pages) == ("agent-1", STALL) and pushed.listed > STALL, pushed
    assert "transfer broke" in pushed.why, pushed
    # The return: on agent-1, from the STALL pushed pages plus a recompute, the same text.
    moved = await api_call(nc, "d-m2", "d-moved", follow)
    assert (moved.instance_id, moved.kv_source) == ("agent-1", "migrated") and moved.text == stayed
    [row] = await wait_rows(db, "SELECT * FROM calls WHERE call_id='d-m2' AND outcome='completed'", 1)
    assert row["kv_source"] == "migrated" and row["migrated_bytes"] == pushed.bytes > 0
    assert row["cached_tokens"] >= pushed.tokens > 0


@pytest.mark.parametrize("live", ["auto", "tcp"], indirect=True)
async def test_a_holder_killed_while_the_moved_return_pulls_leaves_a_prefix_and_the_call_completes(live, request):
    settings, services, nc, db, heard, holder, log_path = live
    follow, stayed = await open_sessions(nc, "r")
    await services.start("agent-1", agent_service.run, settings.with_(instance_id="agent-1"))
    await wait_for_router(nc, instances=2)
    pinned, per_token = asyncio.Event(), {}

    async def on_snapshot(msg):
        snap = SNAPSHOT_DECODER.decode(msg.data)
        per_token.update({m.model: m.kv_bytes_per_token for m in snap.models if snap.instance_id == "agent-1"})
        if snap.instance_id == "agent-0" and snap.pinned_model == "gpt2-tiny":
            pinned.set()

    await nc.subscribe(DEP.telemetry_wildcard, cb=on_snapshot)
    # agent-0 now serves the other model: the return lands on agent-1, which pulls from agent-0.
    pin = PoolPinned("agent-0", "gpt2-tiny", None, 0.0, "test: the holder serves another model now")
    await publish_event(nc.jetstream(), event_subject(DEP, pin), pin, sender=owner_sender(pin))
    await asyncio.wait_for(pinned.wait(), 30)
    t0 = time.monotonic()
    returning = asyncio.create_task(api_call(nc, "r-m2", "r-moved", follow))
    await kill_when_stalled(holder, log_path)
    moved = await returning
    took = time.monotonic() - t0
    assert (moved.instance_id, moved.kv_source) == ("agent-1", "migrated") and moved.text == stayed
    assert took < settings.gateway.call_timeout_s, took  # the dead holder held it no longer than its deadline
    [row] = await wait_rows(db, "SELECT * FROM calls WHERE call_id='r-m2' AND outcome='completed'", 1)
    # exactly the STALL pages that arrived before the kill: migrated, the rest recomputed
    assert row["kv_source"] == "migrated" and row["migrated_bytes"] == STALL * PAGE * per_token["qwen3-tiny"] > 0
    assert row["cached_tokens"] >= STALL * PAGE
    await heard.until(lambda: any(e.instance_id == "agent-0" for e in heard.lost))  # the router noticed
    if request.node.callspec.params["live"] == "tcp":  # the bytes went inline (auto: Mooncake where it starts)
        assert holder_transport(log_path) == "tcp"
