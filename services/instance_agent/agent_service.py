"""Instance-agent service: consumes calls routed to this instance, runs them on the engine.

The engine is blocking torch code, so it runs on one worker thread; the asyncio loop
keeps heartbeats and NATS flowing while it computes. Calls arrive on a durable
JetStream consumer and are acknowledged only after their outcome is published, so a
crashed agent's calls are redelivered rather than lost.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from talaria.services.instance_agent.kv_migration import KvMigration
from talaria.services.instance_agent.runner import CallRunner
from talaria.services import configs
from talaria.services.configs import Configuration
from talaria.services.instance_agent.telemetry import build_snapshot
from talaria.shared import logs, metrics, tracing
from talaria.shared.bus import BUS_ERRORS, PUBLISH_TIMEOUT_S, close, connect, deployment_of, elected, emit, retried_api, tap
from talaria.shared.durable_pull import DurablePull
from talaria.shared.metrics import AgentMetrics
from talaria.shared.limits import call_problem
from talaria.shared.runtime import serve_until_stopped
from talaria.services.instance_agent.fencing import DispatchFencing
from talaria.shared.nats_auth import parse_sender, sender_headers, sender_of, trusted
from talaria.shared.events import (CallFailed, CallRouted, CallSubmitted, EVENT_DECODER, KvPushed, KvPushRequested,
                                   PoolPinned, ROUTED_DECODER)
from talaria.shared.messages import CANCEL_DECODER, ErrorReply
from talaria.shared.wire import encode
from talaria.shared.settings import AgentSettings, CommonSettings, GatewaySettings, Settings
from talaria.services.instance_agent.engine.engine_registry import build_engine

FETCH_BATCH = 16


def held_call_ack_wait_s(call_timeout_s: float) -> float:
    """The agent consumer's ack_wait (not bus.ACK_WAIT_S: a held call is kept alive by an
    in_progress() every third of it, so only a dead agent's calls come back). A delivery lost
    on its way (a broker node killed with a pull request open) also comes back only after it:
    at most a quarter of a call's deadline, and no more than a minute."""
    return min(60.0, call_timeout_s / 4)


async def run(settings: Settings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    await serve(settings.common, settings.agent, ready, stop or asyncio.Event(), settings.gateway.call_timeout_s)


async def serve(common: CommonSettings, settings: AgentSettings, ready: asyncio.Event | None,
                stop: asyncio.Event, call_timeout_s: float = GatewaySettings.call_timeout_s) -> None:
    """`call_timeout_s`: the gateway's (TALARIA_CALL_TIMEOUT_S), which sizes the consumer's ack_wait."""
    log = logs.get("instance_agent").bind(instance_id=settings.instance_id)
    deployment = common.deployment
    provider = tracing.setup(f"agent-{settings.instance_id}", common)
    configuration = configs.selected(common, ablation=settings.ablation)  # a bad name fails before the engine loads
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(executor, _build_engine, common, settings, configuration)
    nc, js = await connect(common.nats_url, f"talaria-agent-{settings.instance_id}", **common.bus_options())
    runner = CallRunner(common, settings, engine, executor, nc, js, provider.get_tracer("talaria.agent"), log,
                        configuration)
    if configuration.scheduler.migrate and engine.capabilities.kv_migration:  # peers pull our pages, we pull theirs
        runner.migration = KvMigration(engine, runner.thread, log, settings.page_host, settings.page_port,
                                       settings.page_transport, settings.mooncake_protocol, settings.mooncake_device)
        await runner.migration.start()
    meter = AgentMetrics(settings.instance_id)  # fed by what the agent emits, its steps and snapshot
    tap(js, meter.observe)
    runner.thread.watchdog.on_step = meter.engine_step
    meter.snapshot_gauges(lambda: build_snapshot(settings, common.models, runner.thread.view, engine.specs, runner.core,
                                                 runner.version, time.time(), staging=configuration.scheduler.staging))
    # <data_dir>/metrics/<instance id>.url: the agent's name in stack.json (`agent-0`, `hot-<model>`)
    metrics_runner = await metrics.serve(meter, settings.instance_id, common, log)
    durable = f"agent-{settings.instance_id}"
    held_ack_wait_s = held_call_ack_wait_s(call_timeout_s)
    consumer = ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        filter_subject=deployment.call_routed(settings.instance_id),
        ack_wait=held_ack_wait_s,
        max_ack_pending=10_000,
        max_deliver=5,
    )
    sub = await js.pull_subscribe(consumer.filter_subject, durable=durable, stream=deployment.events_stream,
                                  config=consumer)
    # A routed call JetStream handed to a pull request that died with a broker node would come
    # back only after the ack_wait: made again from the ack floor at once.
    intake = DurablePull(nc, retried_api(nc), deployment.events_stream, consumer, sub, log, 0.5)
    # First heartbeat before the first fetch: the router then knows this incarnation (and
    # fails the predecessor's calls) by the time a predecessor's call is refused here.
    await runner.publish_snapshot()
    await nc.subscribe(deployment.event("instance.lost"), cb=runner.drops.on_instance_lost)

    async def on_cancel(msg) -> None:
        await _on_cancel(msg, runner, log)

    await nc.subscribe(deployment.call_cancel, cb=on_cancel)

    async def on_pool_pinned(msg) -> None:
        await _on_pool_pinned(msg, runner, settings, log)

    await nc.subscribe(deployment.event("pool.pinned"), cb=on_pool_pinned)

    pushes: set[asyncio.Task] = set()  # drains' pushes in flight (kept referenced until done)

    async def on_kv_push(msg) -> None:
        task = asyncio.ensure_future(_on_kv_push(msg, runner, log))
        pushes.add(task)
        task.add_done_callback(pushes.discard)

    await nc.subscribe(deployment.event("kv.push"), cb=on_kv_push)

    fencing = DispatchFencing(js, deployment.routers_bucket, settings.instance_id, log)

    async def on_dispatch(msg) -> None:
        # The fast copy of a routed call: start it now. Anything odd is left to the durable
        # copy, which refuses and records it (a refusal here would be recorded twice). A
        # superseded router's dispatch is refused here: its durable copy never comes (the
        # stream drops it as a duplicate of the new owner's).
        try:
            routed = ROUTED_DECODER.decode(msg.data)
            if (routed.instance_id == runner.instance_id and routed.call.model in common.models
                    and trusted(msg, routed)):
                if not runner.holds(routed.call.call_id) and await fencing.refused(routed):
                    return
                runner.accept(routed, None, headers=msg.headers)
        except Exception as exc:
            log.warning("fast dispatch ignored", error=str(exc))

    await nc.subscribe(deployment.dispatch(settings.instance_id), cb=on_dispatch)
    tasks = [
        asyncio.create_task(runner.heartbeat_loop(stop), name="heartbeat"),
        asyncio.create_task(runner.work_loop(stop), name="work"),
        asyncio.create_task(runner.closer.progress_loop(stop, held_ack_wait_s / 3), name="progress"),
        asyncio.create_task(runner.watchdog_loop(stop), name="watchdog"),
        asyncio.create_task(_fetch_loop(intake, runner, fencing, js, nc, log, stop), name="fetch"),
    ]
    await runner.publish_snapshot()
    log.info("instance agent ready", models=list(common.models), pool=settings.pool)
    if ready is not None:
        ready.set()
    try:
        # A core task that dies (e.g. the work loop) would leave an agent that heartbeats but
        # runs nothing, holding its calls until their 504.
        await serve_until_stopped("agent", stop, tasks)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.closer.sender.drain(PUBLISH_TIMEOUT_S)  # records in flight: stored, or redelivered
        if runner.migration is not None:
            await runner.migration.close()
        await close(nc)
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        executor.shutdown(wait=True, cancel_futures=True)
        provider.shutdown()


def _build_engine(common: CommonSettings, settings: AgentSettings, configuration: Configuration):
    import torch

    torch.set_num_threads(max(1, settings.torch_threads))
    engine = build_engine(settings.engine, common.data_dir, list(common.models), catalogue=common.catalogue(),
                          device=settings.device, hkvr=configuration.scheduler.hkvr,
                          staging=configuration.scheduler.staging,
                          **settings.engine_options())
    engine.ensure_weights()
    return engine


async def _fetch_loop(intake: DurablePull, runner: CallRunner, fencing: DispatchFencing, js, nc, log,
                      stop: asyncio.Event) -> None:
    try:
        while not stop.is_set():
            await _intake(await intake.fetch(FETCH_BATCH, timeout=1.0), runner, fencing, js, nc, log)
    finally:
        await intake.close()


async def _intake(msgs, runner: CallRunner, fencing: DispatchFencing, js, nc, log) -> None:
    for msg in msgs:
        try:
            routed = ROUTED_DECODER.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.error("undecodable routed call dropped", error=str(exc), seq=msg.metadata.sequence.stream)
            await msg.term()
            continue
        if routed.instance_id != runner.instance_id or not trusted(msg, routed):
            # Only the router dispatches: a CallRouted from anyone else is never run.
            log.error("routed call not from the router dropped", call_id=routed.call.call_id,
                      sender=sender_of(msg))
            await msg.term()
            continue
        try:
            if not runner.holds(routed.call.call_id) and await fencing.refused(routed):
                await msg.ack()  # its partition's new owner placed the call
                continue
            routed = await _with_prompt(js, runner, routed)
            if routed is None:  # its submission is gone from the stream: the client may retry
                await msg.ack()
                continue
            problem = call_problem(routed.call)
            if problem is not None:  # published past the gateway's checks: fail it alone
                await _refuse(js, nc, routed, f"invalid {problem[0]}: {problem[1]}", status=400)
                await msg.ack()
                continue
            refused = runner.accept(routed, msg)
            if refused is not None:
                await _refuse(js, nc, routed, refused)
                await msg.ack()
        except Exception:  # never let one message stop intake
            log.exception("intake failed", call_id=routed.call.call_id)
            await msg.nak(delay=1)


def _command_for(runner: CallRunner, msg, kind, what: str, log):
    """A router command decoded, if it is for this agent and from a trusted sender; else None
    (an undecodable one is logged and dropped: one bad message never stops the agent)."""
    try:
        command = msgspec.json.decode(msg.data, type=kind)
    except msgspec.DecodeError as exc:
        log.warning(f"undecodable {what} dropped", error=str(exc))
        return None
    if command.instance_id != runner.instance_id or not trusted(msg, command):
        return None
    return command


async def _on_pool_pinned(msg, runner: CallRunner, settings: AgentSettings, log) -> None:
    """The router's hot-pool decision for this agent: keep that model resident (or none).
    The scheduler finishes what it holds first (RoundScheduler.repin); the next snapshot
    says `pinned_model`, so the router sends this instance that model's calls only."""
    pinned = _command_for(runner, msg, PoolPinned, "pool decision", log)
    if pinned is None:
        return
    if settings.pool == "hot" or (pinned.model is not None and pinned.model not in runner.models):
        log.warning("pool decision ignored: this agent cannot serve it", model=pinned.model, pool=settings.pool)
        return
    runner.core.sched.repin(pinned.model)
    log.info("hot pool repinned", model=pinned.model, previous=pinned.previous, reason=pinned.reason)
    await runner.publish_snapshot()


async def _on_kv_push(msg, runner: CallRunner, log) -> None:
    """A drain asks this agent to pull a session's pages from the drained holder ahead of the
    session's next call (router/drain_push.py); what arrived is reported as KvPushed."""
    ask = _command_for(runner, msg, KvPushRequested, "kv push", log)
    if ask is None:
        return
    if runner.migration is None or ask.model not in runner.models:
        why = "this agent takes no KV pages" if runner.migration is None else f"this agent does not serve {ask.model}"
        done = KvPushed(runner.instance_id, ask.session_id, ask.model, ask.holder, time.time(), listed=1, why=why)
    else:
        try:
            done = await runner.migration.push(ask)
        except (OSError, ValueError, RuntimeError) as exc:  # the session's next call recomputes
            log.warning("kv push failed", session_id=ask.session_id, error=str(exc))
            done = KvPushed(runner.instance_id, ask.session_id, ask.model, ask.holder, time.time(), listed=1,
                            why=f"push failed here: {type(exc).__name__}")
    await runner.closer.sender.note(done)


async def _on_cancel(msg, runner: CallRunner, log) -> None:
    try:
        cancel = CANCEL_DECODER.decode(msg.data)
    except msgspec.DecodeError as exc:
        log.warning("undecodable cancel dropped", error=str(exc))
        return
    if parse_sender(sender_of(msg))[0] != "gateway":  # clients reach agents only through the gateway
        log.warning("cancel not sent by the gateway dropped", call_id=cancel.call_id, sender=sender_of(msg))
        return
    try:
        await runner.cancel(cancel.call_id, cancel.reason, cancel.tenant)
    except Exception:  # one bad cancel must not stop the subscription
        log.exception("cancel failed", call_id=cancel.call_id)


async def _with_prompt(js, runner: CallRunner, routed: CallRouted) -> CallRouted | None:
    """The stream's copy of a routed call refers to its CallSubmitted for the prompt ids (they
    are stored once). Usually the fast copy already started the call and nothing is fetched;
    otherwise (a restart, a lost fast copy) the submission is read back from the stream, asked
    again through a leader election (refusing would fail a call the stream still holds)."""
    call = routed.call
    if call.prompt_ids or not routed.submitted_seq or runner.holds(call.call_id):
        return routed
    api = retried_api(runner.nc)  # each try short: an election answers nobody
    try:
        raw = await elected(lambda: api.get_msg(deployment_of(js).events_stream, routed.submitted_seq))
        submitted = EVENT_DECODER.decode(raw.data)
    except (*BUS_ERRORS, msgspec.DecodeError) as exc:
        await _refuse(js, runner.nc, routed, f"its submission could not be read back from the stream: {exc}")
        return None
    if (not isinstance(submitted, CallSubmitted) or submitted.call_id != call.call_id
            or not trusted(raw, submitted)):
        await _refuse(js, runner.nc, routed, "its stream reference does not name its gateway submission", status=400)
        return None
    return msgspec.structs.replace(routed, call=submitted, submitted_seq=0)


async def _refuse(js, nc, routed: CallRouted, reason: str, status: int = 503) -> None:
    call = routed.call
    await emit(js, CallFailed(call.call_id, call.session_id, call.model, reason, "agent", time.time(),
                              status=status, instance_id=routed.instance_id, call_index=routed.call_index))
    if call.reply_to:
        reply = (ErrorReply(503, "not_served", reason, call_id=call.call_id, retry_after_s=1.0) if status == 503
                 else ErrorReply(status, "invalid_request", reason, call_id=call.call_id))
        await nc.publish(call.reply_to, encode(reply), headers=sender_headers(nc))
