"""The agent answers a call before its record is stored (issue 11: the stream ack is off
the scheduling loop), and the durability guarantee is what it was: the call's JetStream
message is acked only once its CallCompleted is stored, so an agent that dies in between
leaves the call to be redelivered; and the durable copy of a call that arrives while its
record is being stored is acked with it, never run a second time."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import nats
import pytest
import structlog
from nats.js.api import AckPolicy, ConsumerConfig

from talaria.embedded import free_port
from talaria.services.gateway.gateway_service import run as run_gateway
from talaria.services.instance_agent import agent_service, record_sender
from talaria.services.instance_agent.record_sender import RecordSender
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.services.router.router_service import run as run_router
from talaria.services.telemetry.telemetry_service import run as run_telemetry
from talaria.shared import events as ev
from talaria.shared import messages as m
from talaria.services.router.ownership import partition_of
from talaria.shared.session_slots import slot_of
from talaria.shared.bus import connect, emit
from talaria.shared.health import wait_for_router
from talaria.shared.nats_auth import owner_sender
from talaria.shared.settings import Settings
from talaria.shared.wire import encode
from tests.integration.harness import Owners, Services, acked, wait_rows, wait_until
from tests.integration.test_live_path import stack  # noqa: F401  (the same control plane)
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration
MODEL = "qwen3-tiny"
ACK_WAIT_S = 1.0  # the test consumer's: a message not acked comes back this soon
FINAL_ROW = "SELECT outcome FROM calls WHERE call_id = $1 AND outcome NOT IN ('submitted', 'routed', 'running')"


def completed(call_id: str) -> ev.CallCompleted:
    return ev.CallCompleted(call_id=call_id, session_id="s1", call_index=0, model=MODEL, instance_id="agent-0",
                           prompt_tokens=4, output_tokens=1, finish_reason="length", submitted_at=1000.0,
                           started_at=1000.1, first_token_at=1000.2, completed_at=1000.3)


def routed(call_id: str) -> ev.CallRouted:
    call = ev.CallSubmitted(call_id=call_id, session_id="s1", model=MODEL, prompt_ids=[5, 6, 7, 8],
                           block_hashes=[11], max_tokens=1, submitted_at=1000.0)
    return ev.CallRouted(call=call, call_index=0, instance_id="agent-0", policy="talaria", routed_at=1000.1)


def hold_records(monkeypatch, call_id: str) -> asyncio.Event:
    """The agent's record of `call_id` reaches the stream only once the returned event is set."""
    release, real_async = asyncio.Event(), record_sender.emit_async

    async def held(js, record, *a, **kw):
        if getattr(record, "call_id", None) != call_id:
            return await real_async(js, record, *a, **kw)
        ack = asyncio.get_running_loop().create_future()

        async def later():
            await release.wait()
            try:
                ack.set_result(await (await real_async(js, record, *a, **kw)))
            except Exception as exc:
                ack.set_exception(exc)

        asyncio.ensure_future(later())
        return ack

    monkeypatch.setattr(record_sender, "emit_async", held)
    return release


async def test_a_record_whose_ack_is_lost_is_sent_again_after_one_attempt(nats_url, monkeypatch):
    """A record published to a stream leader that was then cut off gets no ack; the session's
    next call waits for it, so it is sent again after bus.ATTEMPT_S (its message id makes the
    copy a no-op), not after the 10 s PUBLISH_TIMEOUT_S (results/multihost.md: every call of a
    partition stalled that long)."""
    nc, js = await connect(nats_url, "talaria-agent-agent-0")
    try:
        hold_records(monkeypatch, "c1")  # never released: the first ack never comes
        stored = asyncio.Event()

        async def closed():
            stored.set()

        sender = RecordSender(nc, js, structlog.get_logger())
        await sender.send("c1", None, completed("c1"), [], on_stored=closed, on_dropped=lambda: None)
        await asyncio.wait_for(stored.wait(), record_sender.ATTEMPT_S + 3.0)  # < PUBLISH_TIMEOUT_S
        assert len(await stored_records(js, "c1")) == 1
        await sender.drain(timeout=0)
    finally:
        await nc.close()


async def stored_records(js, call_id: str) -> list:
    sub = await js.pull_subscribe(DEP.event("call.completed"), stream=DEP.events_stream,
                                  config=ConsumerConfig(ack_policy=AckPolicy.NONE))
    try:
        msgs = await sub.fetch(100, timeout=1)
    except asyncio.TimeoutError:
        msgs = []
    await sub.unsubscribe()
    return [e for e in (ev.EVENT_DECODER.decode(x.data) for x in msgs) if e.call_id == call_id]


@pytest.mark.parametrize("agent_dies", [False, True])
async def test_the_call_is_acked_only_once_its_record_is_stored(nats_url, monkeypatch, agent_dies):
    nc, js = await connect(nats_url, "talaria-agent-agent-0")
    try:
        await emit(js, routed("c1"), sender=owner_sender(routed("c1")))
        sub = await js.pull_subscribe(DEP.call_routed("agent-0"), durable="t", stream=DEP.events_stream,
                                      config=ConsumerConfig(durable_name="t", ack_wait=ACK_WAIT_S))
        [msg] = await sub.fetch(1, timeout=5)
        release = hold_records(monkeypatch, "c1")
        replies = await nc.subscribe("test.reply.c1")
        stored, dropped = [], []

        async def closed():  # what the runner does once the record is stored: ack the call
            stored.append("c1")
            await msg.ack()

        sender = RecordSender(nc, js, structlog.get_logger())
        task = await sender.send("c1", None, completed("c1"), [("test.reply.c1", b"the answer")],
                                 on_stored=closed, on_dropped=lambda: dropped.append("c1"))
        assert (await replies.next_msg(timeout=5)).data == b"the answer"  # answered before it is stored
        assert (await js.consumer_info(DEP.events_stream, "t")).num_ack_pending == 1
        if agent_dies:  # before the record is stored: nothing acked, nothing recorded
            await sender.drain(timeout=0)
            assert (stored, dropped) == ([], ["c1"]) and await stored_records(js, "c1") == []
            [again] = await sub.fetch(1, timeout=ACK_WAIT_S + 10)  # so the call comes back: not lost
            assert ev.EVENT_DECODER.decode(again.data).call.call_id == "c1" and again.metadata.num_delivered == 2
        else:
            release.set()
            await task
            assert (stored, dropped) == (["c1"], [])
            assert len(await stored_records(js, "c1")) == 1
            assert (await js.consumer_info(DEP.events_stream, "t")).num_ack_pending == 0
    finally:
        await nc.close()


async def test_a_durable_copy_arriving_while_the_record_is_stored_is_not_run_again(stack, db, monkeypatch):
    """The agent starts calls from the router's core-NATS fast copy; the JetStream copy can
    arrive after the call finished, while its record is still being stored."""
    settings, services = stack
    call_id = "late-durable"
    release = hold_records(monkeypatch, call_id)
    replied, durable_in = asyncio.Event(), asyncio.Event()
    real_with_prompt = agent_service._with_prompt

    async def after_the_reply(js, runner, routed_call):  # the durable copy comes late
        if routed_call.call.call_id == call_id:
            await replied.wait()
            durable_in.set()  # the intake accepts it right after this returns
        return await real_with_prompt(js, runner, routed_call)

    monkeypatch.setattr(agent_service, "_with_prompt", after_the_reply)
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0"))
    nc = await nats.connect(settings.common.nats_url)
    results = []

    async def on_reply(msg):  # every answer any agent sends for the call
        reply = m.REPLY_DECODER.decode(msg.data)
        if reply.call_id == call_id:
            results.append(reply)
            replied.set()

    try:
        await wait_for_router(nc, instances=1)
        await nc.subscribe(f"{DEP.reply_prefix}.>", cb=on_reply)
        req = m.CallRequest(model=MODEL, prompt="late copy", session_id="late", max_tokens=1, temperature=0,
                            call_id=call_id)
        reply = m.REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=30)).data)
        assert isinstance(reply, m.CallResult), reply
        await asyncio.wait_for(durable_in.wait(), 10)
        js = nc.jetstream()
        info = await js.consumer_info(DEP.events_stream, "agent-agent-0")
        assert info.num_ack_pending == 1  # held: its record is not stored yet
        release.set()

        async def settled():
            info = await js.consumer_info(DEP.events_stream, "agent-agent-0")
            return info if info.num_ack_pending == 0 else None

        info = await wait_until(settled, "the durable copy to be acked after the record", timeout=10, every=0.05)
        await nc.flush()  # every answer the agent sent before its ack has reached us
        assert [type(r).__name__ for r in results] == ["CallResult"]  # answered once: never run again
        assert info.num_redelivered == 0
        rows = await wait_rows(db, FINAL_ROW, 1, call_id)
        assert [r["outcome"] for r in rows] == ["completed"]
    finally:
        await nc.close()


def hold_router_outputs(monkeypatch, call_id: str) -> None:
    """The router's outputs for `call_id` never reach the stream (its bus hangs for them)."""
    from talaria.services.router import outputs as router_outputs, router_service

    real_async, real = router_outputs.emit_async, router_outputs.emit

    def for_call(event) -> bool:
        return call_id in (getattr(event, "call_id", None), getattr(getattr(event, "call", None), "call_id", None))

    async def held_async(js, event, *a, **kw):
        if for_call(event):
            return asyncio.get_running_loop().create_future()  # an ack that never comes
        return await real_async(js, event, *a, **kw)

    async def held(js, event, *a, **kw):
        if for_call(event):
            await asyncio.Event().wait()
        return await real(js, event, *a, **kw)

    monkeypatch.setattr(router_outputs, "emit_async", held_async)
    monkeypatch.setattr(router_outputs, "emit", held)
    monkeypatch.setattr(router_outputs, "ATTEMPT_S", 0.5)  # retried sooner
    monkeypatch.setattr(router_service, "PUBLISH_TIMEOUT_S", 0.5)  # a stop need not wait long for them


async def submission_seq(js, session_id: str, call_id: str) -> int:
    """The stream sequence of the call's submission (the last on its session's slot: the
    test's only one), read by a direct lookup, not a fetch that may time out on a busy loop."""
    msg = await js.get_last_msg(DEP.events_stream, DEP.call_submitted(slot_of(session_id)))
    assert ev.EVENT_DECODER.decode(msg.data).call_id == call_id
    return msg.seq


async def test_a_router_that_dies_before_storing_its_outputs_has_not_acked_the_call(
        nats_url, database_url, db, tmp_path, monkeypatch):
    """The router folds the next input while one input's outputs are stored (the agent runs
    the call from the fast copy meanwhile); the input is acked only once they are stored, so
    a router that dies first gets the call back on restart: recorded, answered once."""
    from talaria.services.router import router_service

    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                        http_port=free_port(), session_idle_s=3600, call_timeout_s=60, models=(MODEL,))
    call_id = "router-dies"
    services = Services()
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    answers = []
    owners = Owners()  # each router's partitions, as its heartbeats say
    await nc.subscribe(DEP.health("router"), cb=owners.on_beat)
    partition = partition_of("rd", settings.router.router_partitions)  # the session's

    async def on_reply(msg):
        if m.REPLY_DECODER.decode(msg.data).call_id == call_id:
            answers.append(msg)

    try:
        await services.start("telemetry", run_telemetry, settings)
        hold_router_outputs(monkeypatch, call_id)
        router = await services.start("router", run_router, settings)
        await services.start("gateway", run_gateway, settings)
        await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0"))
        await wait_for_router(nc, instances=1)
        await nc.subscribe(f"{DEP.reply_prefix}.>", cb=on_reply)
        req = m.CallRequest(model=MODEL, prompt="router dies", session_id="rd", max_tokens=1, temperature=0,
                            call_id=call_id)
        reply = m.REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=30)).data)
        assert isinstance(reply, m.CallResult), reply  # served from the fast copy: the stream did not gate it
        seq = await submission_seq(js, "rd", call_id)
        intake = router_service.durable(partition)
        info = await js.consumer_info(DEP.events_stream, intake)
        assert info.ack_floor.stream_seq < seq  # not acked: its outputs are not stored
        await owners.until(lambda by: any(partition in parts for parts in by.values()), timeout=30)
        [dead] = [r for r, parts in owners.by_router.items() if partition in parts]

        await router.close()  # dies with the outputs unstored (its final save skips that state)
        services.running.remove(router)
        monkeypatch.undo()
        await services.start("router", run_router, settings)  # the bus works again (a new router id)
        # Its take-over deletes the partition's consumer and makes it again from the ack floor
        # (the unacked call comes back at once): read in between, the consumer is not found.
        # So the ack floor is read once the new router's heartbeat lists the partition, which
        # it does only after the consumer is made again.
        # A restart replays the stream and waits for the agent's heartbeat: slow on a loaded machine.
        await owners.until(lambda by: any(partition in parts for r, parts in by.items() if r != dead), timeout=60)
        await wait_until(lambda: acked(js, intake, seq), "the restarted router to ack the call",
                         timeout=60)
        rows = await wait_rows(db, FINAL_ROW, 1, call_id, timeout=60)
        assert [r["outcome"] for r in rows] == ["completed"]  # not lost
        await nc.flush()
        assert len(answers) == 1  # and not run a second time
    finally:
        await services.close()
        await nc.close()


async def test_a_call_run_from_its_durable_copy_is_acked_only_after_its_record(stack, db, monkeypatch):
    """The usual order on a loaded agent: the durable copy is in hand while the call runs. Its
    client is answered at once; the copy is acked only once the record is stored."""
    settings, services = stack
    call_id = "durable-first"
    release = hold_records(monkeypatch, call_id)

    class FastCopyLost(agent_service.CallRunner):
        def accept(self, routed, msg, headers=None):
            if msg is None and routed.call.call_id == call_id:
                return None  # the core-NATS fast copy never arrived: the call runs from the durable one
            return super().accept(routed, msg, headers)

    monkeypatch.setattr(agent_service, "CallRunner", FastCopyLost)
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0"))
    nc = await nats.connect(settings.common.nats_url)
    try:
        await wait_for_router(nc, instances=1)
        req = m.CallRequest(model=MODEL, prompt="durable first", session_id="df", max_tokens=1, temperature=0,
                            call_id=call_id)
        reply = m.REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=30)).data)
        assert isinstance(reply, m.CallResult), reply  # answered while its record is held
        js = nc.jetstream()
        assert (await js.consumer_info(DEP.events_stream, "agent-agent-0")).num_ack_pending == 1
        release.set()

        async def settled():
            info = await js.consumer_info(DEP.events_stream, "agent-agent-0")
            return info if info.num_ack_pending == 0 else None

        await wait_until(settled, "the call acked once its record is stored", timeout=10, every=0.05)
        rows = await wait_rows(db, FINAL_ROW, 1, call_id)
        assert [r["outcome"] for r in rows] == ["completed"]
    finally:
        await nc.close()
