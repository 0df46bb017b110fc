"""KV migration between two live agents over real NATS and Postgres (issue 40): a session
whose holder is repinned to another model returns on the other agent, which pulls the
session's pages from the holder's page server (CallRouted.kv_from) and answers the same
greedy text as a session that stayed, recorded kv_source = migrated with its bytes in
Postgres. With the holder gone the return still completes, by recompute, with that text.
`talaria drain` (the admin user's request to the routers) moves a session the same way."""

from __future__ import annotations

import asyncio

import asyncpg
import nats
import pytest

from talaria.embedded import free_port
from talaria.services.instance_agent import agent_service
from talaria.shared.bus import event_subject, publish_event
from talaria.shared.events import EVENT_DECODER, CallStarted, PoolPinned
from talaria.shared.health import wait_for_router
from talaria.drain import drain
from talaria.shared.messages import DRAIN_STATUS_DECODER, REPLY_DECODER, CallRequest, CallResult, DrainRequest
from talaria.shared.nats_auth import SENDER_HEADER, owner_sender
from talaria.shared.settings import Settings
from talaria.shared.snapshots import SNAPSHOT_DECODER
from talaria.shared.subjects import Deployment
from talaria.shared.wire import encode
from tests.integration.harness import Services, wait_rows, wait_until

pytestmark = pytest.mark.integration

DEP = Deployment()
BUSY = (3, 4, 5)  # sessions whose calls run on the drained agent when the drain starts
MODELS = ("qwen3-tiny", "gpt2-tiny")
FIRST = ("You are a careful coding agent. Read the failing test, find the bug in parser.py, "
         "fix it and run the suite again. The test says parse('a,b') returns ['a,b'].") * 2



async def api_call(nc, call_id: str, session: str, prompt: str) -> CallResult:
    """One call through the gateway's NATS API; a failure fails the test with its reply."""
    req = CallRequest(model="qwen3-tiny", prompt=prompt, session_id=session, call_id=call_id, max_tokens=8)
    reply = REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=60)).data)
    assert isinstance(reply, CallResult), reply
    return reply

async def test_a_moved_return_migrates_its_pages_and_answers_as_if_it_stayed(nats_url, database_url, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                           http_port=free_port(), session_idle_s=3600, call_timeout_s=60, models=MODELS)
    services = Services()
    nc = await nats.connect(nats_url)
    db = await asyncpg.connect(database_url)
    snaps: dict[str, object] = {}

    async def on_snapshot(msg):
        s = SNAPSHOT_DECODER.decode(msg.data)
        snaps[s.instance_id] = s

    try:
        await nc.subscribe(DEP.telemetry_wildcard, cb=on_snapshot)
        await services.start_control_plane(settings)
        await services.start("agent-0", agent_service.run, settings.with_(instance_id="agent-0"))
        await wait_for_router(nc, instances=1)
        # Two sessions open on agent-0 (the only agent); "stay"'s return will stay there.
        first = await api_call(nc, "m-1", "moved", FIRST)
        same = await api_call(nc, "s-1", "stay", FIRST)
        assert first.text == same.text and first.instance_id == "agent-0"
        follow = FIRST + first.text + " Tool output: 3 passed, 1 failed. Next step:"
        stayed = await api_call(nc, "s-2", "stay", follow)
        assert stayed.instance_id == "agent-0" and stayed.kv_source == "device"
        await services.start("agent-1", agent_service.run, settings.with_(instance_id="agent-1"))
        await wait_for_router(nc, instances=2)
        # agent-0 is repinned to the other model (an operator's or the router's hot-pool move):
        # "moved"'s return can no longer land on it, and its pages are still there.
        pin = PoolPinned("agent-0", "gpt2-tiny", None, 0.0, "test: the holder serves another model now")
        await publish_event(nc.jetstream(), event_subject(DEP, pin), pin, sender=owner_sender(pin))
        await wait_until(lambda: _pinned(snaps.get("agent-0")), "agent-0 repinned")
        assert snaps["agent-0"].page_address and snaps["agent-1"].page_address
        moved = await api_call(nc, "m-2", "moved", follow)
        assert moved.instance_id == "agent-1" and moved.kv_source == "migrated"
        assert moved.text == stayed.text  # the same greedy tokens as the session that stayed
        [row] = await wait_rows(db, "SELECT * FROM calls WHERE call_id='m-2' AND outcome='completed'", 1)
        assert row["kv_source"] == "migrated" and row["migrated_bytes"] > 0 and row["migrate_s"] > 0
        [audit] = await wait_rows(db, "SELECT * FROM lease_decisions WHERE call_id='m-2' AND outcome IS NOT NULL", 1)
        assert audit["kv_source"] == "migrated"
        # The holder goes away: the next moved return is recomputed, with the same text as one that stayed.
        second = await api_call(nc, "g-1", "gone", FIRST)
        assert second.instance_id == "agent-1"  # agent-0 serves gpt2-tiny only now
        await services.start("agent-2", agent_service.run, settings.with_(instance_id="agent-2"))
        await wait_for_router(nc, instances=3)
        pin1 = PoolPinned("agent-1", "gpt2-tiny", None, 0.0, "test: the holder serves another model now")
        await publish_event(nc.jetstream(), event_subject(DEP, pin1), pin1, sender=owner_sender(pin1))
        await wait_until(lambda: _pinned(snaps.get("agent-1")), "agent-1 repinned")
        holder = next(r for r in services.running if r.name == "agent-1")
        await holder.close()  # killed: its page server answers no more
        services.running.remove(holder)
        gone = await api_call(nc, "g-2", "gone", follow)
        assert gone.instance_id == "agent-2" and gone.kv_source == "recompute"
        assert gone.text == stayed.text
    finally:
        await db.close()
        await nc.close()
        await services.close()


async def _pinned(snap) -> bool:
    return snap is not None and snap.pinned_model == "gpt2-tiny"


async def test_a_drained_instance_takes_no_return_its_sessions_migrate_and_drain_returns_0(
        nats_url, database_url, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                           http_port=free_port(), session_idle_s=3600, call_timeout_s=60, models=MODELS)
    services = Services()
    nc = await nats.connect(nats_url)

    try:
        await services.start_control_plane(settings)
        await services.start("agent-0", agent_service.run, settings.with_(instance_id="agent-0"))
        await wait_for_router(nc, instances=1)
        first = await api_call(nc, "d-1", "drained", FIRST)
        await api_call(nc, "k-1", "kept", FIRST)
        follow = FIRST + first.text + " Tool output: 3 passed, 1 failed. Next step:"
        stayed = await api_call(nc, "k-2", "kept", follow)
        await services.start("agent-1", agent_service.run, settings.with_(instance_id="agent-1"))
        await wait_for_router(nc, instances=2)
        # Only the admin user may drain: a request that does not come from it is refused.
        plain = await nc.request(DEP.admin_drain, encode(DrainRequest("agent-0")), timeout=10)
        assert DRAIN_STATUS_DECODER.decode(plain.data).error == "drain refused: not sent by the admin user"
        assert await drain(nats_url, "agent-9", timeout_s=5) == (2, "no instance 'agent-9' is known to this "
                                                                     "router (known: agent-0, agent-1)")
        # The admin user asks: agent-0 takes no call from now on. (Whether "drained" still counts
        # as live there depends on the gaps measured so far; test_router_drain.py covers the wait.)
        first_ask = await nc.request(DEP.admin_drain, encode(DrainRequest("agent-0")), timeout=10,
                                     headers={SENDER_HEADER: "talaria-admin"})
        status = DRAIN_STATUS_DECODER.decode(first_ask.data)
        # Accepted; k-2's completion may not be folded yet (the client is answered first), so
        # the call count here is 0 or 1: `drain` below waits for it either way.
        assert status.error == "" and status.instance_id == "agent-0" and status.calls <= 1
        draining = asyncio.create_task(drain(nats_url, "agent-0", timeout_s=60))
        moved = await api_call(nc, "d-2", "drained", follow)  # its session's context follows it
        # Pulled at the call ("migrated"), or pushed ahead by the drain just before it: then, if the
        # call is accepted between the pages' import and the push's own bookkeeping, it is labelled
        # "host" (a known race; the pushes test below asserts "migrated").
        assert moved.instance_id == "agent-1" and moved.kv_source in ("migrated", "host") and moved.text == stayed.text
        code, line = await draining  # no live session is left there: stopping it loses no context
        assert code == 0 and "agent-0 drained" in line
        fresh = await api_call(nc, "n-1", "new", FIRST)  # and no new session lands there
        assert fresh.instance_id == "agent-1"
        stopped = next(r for r in services.running if r.name == "agent-0")
        await stopped.close()
        services.running.remove(stopped)
        again = await api_call(nc, "d-3", "drained", follow + moved.text + " Done.")
        assert again.instance_id == "agent-1" and again.kv_source == "device"
    finally:
        await nc.close()
        await services.close()


async def test_a_drain_pushes_idle_sessions_ahead_so_they_restore_after_the_holder_stopped(
        nats_url, database_url, tmp_path):
    """Drain-then-stop loses no context under load: sessions idle on agent-0 (they come back
    only after it stopped), and three whose calls are running there when the drain starts, are
    pushed to agent-1 before `talaria drain` returns 0; their returns restore the pushed pages
    there (kv_source migrated, none recomputed) and answer the same greedy text as a session
    that stayed."""
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                           http_port=free_port(), session_idle_s=3600, call_timeout_s=60, models=MODELS)
    services = Services()
    nc = await nats.connect(nats_url)
    db = await asyncpg.connect(database_url)
    busy_ids = {f"p{k}-2": k for k in BUSY}
    started: dict[str, str] = {}  # call -> the agent that started it
    all_started = asyncio.Event()

    async def on_started(msg):
        event = EVENT_DECODER.decode(msg.data)
        if isinstance(event, CallStarted) and event.call_id in busy_ids:
            started[event.call_id] = event.instance_id
            if len(started) == len(busy_ids):
                all_started.set()

    try:
        await nc.subscribe(DEP.event("call.started"), cb=on_started)
        await services.start_control_plane(settings)
        await services.start("agent-0", agent_service.run, settings.with_(instance_id="agent-0"))
        await wait_for_router(nc, instances=1)
        # Sessions with their own prompts (no shared prefix between them). 1 and 2 each have a
        # twin whose return stays on agent-0: the reference text. 3-5 open on agent-0 too.
        prompts = {k: f"Session {k}. " + FIRST for k in (1, 2, *BUSY)}
        follows, stayed = {}, {}
        for k in (1, 2):
            first = await api_call(nc, f"p{k}-1", f"pushed-{k}", prompts[k])
            twin = await api_call(nc, f"t{k}-1", f"twin-{k}", prompts[k])
            assert first.instance_id == twin.instance_id == "agent-0" and first.text == twin.text
            follows[k] = prompts[k] + first.text + " Tool output: 3 passed, 1 failed. Next step:"
            stayed[k] = await api_call(nc, f"t{k}-2", f"twin-{k}", follows[k])
            assert stayed[k].instance_id == "agent-0" and stayed[k].kv_source == "device"
        for k in BUSY:
            first = await api_call(nc, f"p{k}-1", f"pushed-{k}", prompts[k])
            assert first.instance_id == "agent-0"
            follows[k] = prompts[k] + first.text + " Tool output: 3 passed, 1 failed. Next step:"
        # Under load: 3-5's returns run on agent-0 when the drain starts; each is pushed once its
        # call ends. They are sent before agent-1 starts: with an idle agent-1 to price, the router
        # may move a return there (CI: one of three), and then the drain has nothing to push for it.
        busy = {k: asyncio.create_task(nc.request(DEP.api_call, encode(CallRequest(
            model="qwen3-tiny", prompt=follows[k], session_id=f"pushed-{k}", call_id=f"p{k}-2", max_tokens=512)),
            timeout=60)) for k in BUSY}
        await asyncio.wait_for(all_started.wait(), 30)
        assert set(started.values()) == {"agent-0"}, started
        await services.start("agent-1", agent_service.run, settings.with_(instance_id="agent-1"))
        await wait_for_router(nc, instances=2)
        ask = await nc.request(DEP.admin_drain, encode(DrainRequest("agent-0")), timeout=10,
                               headers={SENDER_HEADER: "talaria-admin"})
        first_status = DRAIN_STATUS_DECODER.decode(ask.data)
        code, line = await drain(nats_url, "agent-0", timeout_s=60)
        assert code == 0 and f"{4 + len(BUSY)} session(s)' KV moved" in line, line
        loaded = {k: REPLY_DECODER.decode((await task).data) for k, task in busy.items()}
        assert all(isinstance(r, CallResult) and r.instance_id == "agent-0" for r in loaded.values()), loaded
        # The drain began while at least one ran (its first answer counts the calls there; one
        # that finished before the ask, on a loaded machine, is idle and pushed all the same).
        assert first_status.calls >= 1, first_status
        stopped = next(r for r in services.running if r.name == "agent-0")
        await stopped.close()  # the operator stops it; the sessions come back only now
        services.running.remove(stopped)
        for k in (1, 2):
            back = await api_call(nc, f"p{k}-3", f"pushed-{k}", follows[k])
            assert (back.instance_id, back.kv_source) == ("agent-1", "migrated"), k
            assert back.text == stayed[k].text
        for k in BUSY:
            nxt = follows[k] + loaded[k].text + " Tool output: 4 passed. Next step:"
            back = await api_call(nc, f"p{k}-3", f"pushed-{k}", nxt)
            assert (back.instance_id, back.kv_source) == ("agent-1", "migrated"), k
            if k == BUSY[0]:
                assert back.text == (await api_call(nc, f"r{k}-1", f"ref-{k}", nxt)).text  # as a fresh session's
        ids = [f"p{k}-3" for k in (1, 2, *BUSY)]
        rows = await wait_rows(db, "SELECT * FROM calls WHERE call_id = ANY($1::text[]) AND outcome='completed'",
                               len(ids), ids)
        assert [r["kv_source"] for r in rows] == ["migrated"] * len(ids)
        assert all(r["migrated_bytes"] > 0 and r["cached_tokens"] > 0 for r in rows)
    finally:
        await db.close()
        await nc.close()
        await services.close()
