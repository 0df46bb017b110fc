"""Router service: the asyncio shell around RouterCore.

Inputs come from a durable JetStream consumer (call submitted / completed / failed),
snapshots from `talaria.telemetry.*`. Each input is folded, a routed call's core-NATS
fast copy goes to its agent at once, and the input's output events are published to the
stream while the next input is folded (started in order, so the stream keeps the order
the state applied them in); the input is acked only once all of its outputs are stored,
so a crash re-delivers rather than loses it, and RouterCore's dedupe (a call is routed
once) makes re-delivery safe. A projection save waits until every folded input's outputs
are stored, so a saved state never counts an output the stream lacks.

Restart: load the last projection (state + stream sequence) from Postgres, replay
the stream after that sequence through `RouterState.apply`, then resume consuming.
"""

from __future__ import annotations

import asyncio
import gc
import time

import msgspec
from msgspec.structs import replace
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from talaria.services.router.router_core import RouterCore
from talaria.services.router.outputs import RouterOutputs
from talaria.services.router.policy.base import PolicyConfig
from talaria.services.router.policy.registry import create_policy
from talaria.services.router.projection import ProjectionStore
from talaria.services.router.state import RouterState
from talaria.shared import logs, metrics, subjects, tracing
from talaria.shared.metrics import RouterMetrics
from talaria.shared.health import INTERVAL_S as HEARTBEAT_INTERVAL_S, BusHearing, heartbeat_loop
from talaria.shared.logs import call_context
from talaria.shared.runtime import serve_until_stopped
from talaria.services.router.hot_pools import HotPools
from talaria.shared.bus import ACK_WAIT_S, PUBLISH_TIMEOUT_S, close, connect, publish_fast
from talaria.shared.nats_auth import sender_of, trusted
from talaria.shared.db.connection import create_engine
from talaria.shared.events import (
    CallRouted,
    CallSubmitted,
    EVENT_DECODER,
    InstanceLost,
    RoutingDecision,
)
from talaria.shared.snapshots import SNAPSHOT_DECODER
from talaria.shared.settings import Settings, SettingsError
from talaria.shared.tracing import extract_context

DURABLE = "router"


def input_subjects() -> list[str]:
    return [subjects.CALL_SUBMITTED, subjects.CALL_COMPLETED, subjects.CALL_FAILED,
            subjects.ROUND_SUMMARY, subjects.SWITCH_DONE]


TICK_S = 0.05
# After a (re)start, listen to heartbeats before deciding: routing with an empty instance
# table would reject every call waiting in the stream as "no healthy instance". The wait
# ends early once every instance of the restored table has been heard from again.
WARMUP_S = 1.2
SAVE_EVERY_S = 2.0
MAX_DELIVER = 20  # a message that keeps failing is given up (and logged) rather than looping


def policy_config(settings: Settings) -> PolicyConfig:
    return PolicyConfig(
        lease_timeout_s=settings.lease_timeout_s,
        adaptive_lease=settings.adaptive_lease,
        overload=settings.overload,
    )


class RouterService:
    def __init__(self, settings: Settings, log) -> None:
        self.settings, self.log = settings, log
        try:
            policy = create_policy(settings.policy, policy_config(settings))
        except (KeyError, ValueError) as exc:  # unknown policy or a bad knob: a config error
            raise SettingsError("TALARIA_POLICY", settings.policy, str(exc)) from None
        self.core = RouterCore(policy, pools=HotPools() if settings.hot_pools else None)
        self.lock = asyncio.Lock()  # one input at a time: the core is single-threaded by design
        self.dirty = False
        self.seq = 0  # JetStream sequence of the last input folded in (saved with the state)
        self.listening_since = time.time()  # restored views are not "silent" before this
        # The end of the last stretch the lock was held waiting on the stream (a broker
        # failover): snapshots that arrived meanwhile were not folded, so silence counts from it.
        self.unblocked_at = 0.0
        self.warm = asyncio.Event()  # every restored instance heard from again
        self.expected: set[str] = set()
        self.metrics = RouterMetrics()
        self.metrics.scrape_gauge("talaria_router_leases_active", "Live leases (soft reservations) by model",
                                  ("model",), self._live_leases)
        self.metrics.scrape_gauge("talaria_router_instances", "Instances in the router's view",
                                  (), lambda: {(): len(self.core.state.instances)})

    def _live_leases(self) -> dict:
        book, now = self.core.state.leases, time.time()
        return {(m,): book.live_for(m, now) for m in book.by_model}

    async def run(self, ready: asyncio.Event | None, stop: asyncio.Event) -> None:
        provider = tracing.setup("router", self.settings)
        self.tracer = provider.get_tracer("talaria.router")
        db = create_engine(self.settings.database_url)
        store = ProjectionStore(db)
        self.nc, self.js = await connect(self.settings.nats_url, "talaria-router",
                                         replicas=self.settings.nats_replicas, **self.settings.nats_options())
        self.outputs = RouterOutputs(self.js, self.nc, self.log, self.core.policy.config,
                                     on_stored=self._stored_up_to, metrics=self.metrics)
        metrics_runner = await metrics.serve(self.metrics, "router", self.settings, self.log)
        await self._recover(store)
        gc.collect()
        gc.freeze()  # the recovered tables are long-lived: keep them out of every GC scan
        self.listening_since = time.time()
        state = self.core.state
        # Instances the recovered state places anything on: routing waits to hear them all.
        self.expected = set(state.instances) | {p.instance_id for p in state.inflight_calls.values()} | {
            lease.instance_id for lease in state.leases.leases.values()}
        await self.nc.subscribe(subjects.TELEMETRY_WILDCARD, cb=self._on_snapshot)
        try:
            await asyncio.wait_for(self.warm.wait(), WARMUP_S)
        except TimeoutError:
            pass  # some restored instance stayed silent: heartbeat loss will settle it
        await self._ensure_consumer()
        sub = await self.js.pull_subscribe_bind(DURABLE, stream=subjects.EVENTS_STREAM)
        self.hearing = BusHearing(self.nc, TICK_S, HEARTBEAT_INTERVAL_S, self.log)
        tasks = [asyncio.create_task(self._consume(sub, stop)), asyncio.create_task(self._tick(stop)),
                 asyncio.create_task(self.hearing.run(stop)),
                 asyncio.create_task(self._save_loop(store, stop)),
                 asyncio.create_task(heartbeat_loop(self.nc, "router", stop, self._health))]
        self.log.info("router ready", policy=self.core.policy.name, seq=self.seq)
        if ready is not None:
            ready.set()
        try:
            await serve_until_stopped("router", stop, tasks)
        finally:
            stop.set()
            # Let the consumer finish the message in hand (it checks `stop` between fetches).
            await asyncio.wait(tasks, timeout=5)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await self._save(store, drain_s=PUBLISH_TIMEOUT_S)
            except Exception as exc:  # the replay on the next start covers what is not saved
                self.log.warning("final projection save failed", error=str(exc))
            await self.outputs.cancel_pending()  # not stored: their inputs stay unacked and come back
            await close(self.nc)
            if metrics_runner is not None:
                await metrics_runner.cleanup()
            await db.dispose()
            provider.shutdown()

    def _stored_up_to(self, seq: int) -> None:
        """Outputs up to stream sequence `seq` are stored (a save may count them)."""
        self.seq = max(self.seq, seq)

    def _health(self) -> dict[str, str]:
        return {"policy": self.core.policy.name, "instances": str(len(self.core.state.instances))}

    async def _ensure_consumer(self) -> None:
        """The durable input consumer. Inputs a killed predecessor had fetched but not acked
        would come back only after `ack_wait` (30 s: a call submitted just before the kill would
        time out); recreating the consumer from its ack floor delivers them at once. Submissions
        already routed are skipped by the core, as for any redelivery."""
        config = ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT,
                                deliver_policy=DeliverPolicy.ALL, filter_subjects=input_subjects(),
                                ack_wait=ACK_WAIT_S, max_deliver=MAX_DELIVER)
        try:
            info = await self.js.consumer_info(subjects.EVENTS_STREAM, DURABLE)
        except NotFoundError:
            info = None
        if info is not None and not info.num_ack_pending:
            return
        if info is not None:
            start = info.ack_floor.stream_seq + 1
            self.log.warning("resuming the input consumer after its ack floor", resume_at=start,
                             unacked=info.num_ack_pending)
            await self.js.delete_consumer(subjects.EVENTS_STREAM, DURABLE)
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, start
        await self.js.add_consumer(subjects.EVENTS_STREAM, config=config)

    # ---- recovery ----------------------------------------------------------------------

    async def _recover(self, store: ProjectionStore) -> None:
        saved = await store.load()
        if saved is not None:
            self.core.state, self.seq = saved
        info = await self.js.stream_info(subjects.EVENTS_STREAM)
        last = info.state.last_seq
        start = self.seq + 1
        replayed = 0
        if last >= start:
            sub = await self.js.pull_subscribe(
                "", stream=subjects.EVENTS_STREAM,
                config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                      opt_start_seq=start, inactive_threshold=30))
            seq = start - 1
            while seq < last:
                try:
                    msgs = await sub.fetch(256, timeout=2.0)
                except asyncio.TimeoutError:
                    break
                for msg in msgs:
                    seq = msg.metadata.sequence.stream
                    self._replay_one(msg, seq)
                    replayed += 1
            await sub.unsubscribe()
        self.log.info("router recovered", from_seq=start, to_seq=last, replayed=replayed,
                      sessions=len(self.core.state.sessions))

    def _replay_one(self, msg, seq: int) -> None:
        try:
            event = EVENT_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        if not trusted(msg, event):
            self.seq = max(self.seq, seq)
            return
        # Submissions are decided by the live consumer (which skips calls already routed);
        # everything else, including our own past outputs, is folded back in.
        if not isinstance(event, CallSubmitted):
            self.core.state.apply(event)
        self.seq = max(self.seq, seq)

    # ---- live --------------------------------------------------------------------------

    async def _on_snapshot(self, msg) -> None:
        try:
            snap = SNAPSHOT_DECODER.decode(msg.data)
        except msgspec.DecodeError as exc:
            self.log.warning("undecodable snapshot", subject=msg.subject, error=str(exc))
            return
        async with self.lock:
            outputs = self.core.observe(snap, time.time())
            if self.expected and not self.warm.is_set():
                views = self.core.state.instances
                if all(i in views and views[i].received_at >= self.listening_since for i in self.expected):
                    self.warm.set()
            if outputs:  # a restarted agent: its predecessor's calls are failed, clients told
                self.log.warning("instance restarted; its in-flight calls failed", instance_id=snap.instance_id,
                                 calls=len(outputs) - 1)
                await self.outputs.publish_all(outputs)
                self.dirty = True

    async def _consume(self, sub, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(64, timeout=1.0)
            except asyncio.TimeoutError:
                continue
            except Exception as exc:
                self.log.warning("fetch failed", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await self._handle(msg)

    async def _handle(self, msg) -> None:
        try:
            event = EVENT_DECODER.decode(msg.data)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable event dropped", subject=msg.subject, error=str(exc))
            await msg.term()
            return
        if not trusted(msg, event):  # e.g. a CallCompleted not from an agent: never folded in
            self.log.error("event from a service that does not own it dropped", subject=msg.subject,
                           sender=sender_of(msg), event_type=type(event).__name__)
            await msg.term()
            return
        call_id = getattr(event, "call_id", None)
        session_id = getattr(event, "session_id", None)
        if isinstance(event, CallSubmitted) and self.core.state.reused(call_id, msg.metadata.sequence.stream):
            await self.outputs.refuse_reused(event)  # past JetStream's duplicate window, the gateway could not tell
            await msg.ack()
            return
        try:
            with call_context(session_id, call_id) if call_id and session_id else _null():
                outputs, acks = await self._handle_event(event, msg)
        except Exception:  # never let one input stop the router: it is redelivered
            self.log.exception("input failed; will be redelivered", subject=msg.subject)
            await msg.nak(delay=1)
            return
        if not outputs:
            await msg.ack()
            return
        # Its outputs are on their way (published in order); their acks are awaited while
        # the next input is folded, and this input is acked only once all are stored.
        self.outputs.store_then_ack_soon(outputs, acks, msg)

    async def _handle_event(self, event, msg) -> tuple[list, list]:
        async with self.lock:
            ctx = extract_context(msg.headers)
            with self.tracer.start_as_current_span("route", context=ctx, attributes=tracing.request_attributes(event)) \
                    if isinstance(event, CallSubmitted) else _null() as span:
                started = time.perf_counter()
                outputs = self.core.handle(event, time.time())
                self.metrics.observe(event)  # a completion: how far off its queue estimate was
                if isinstance(event, CallSubmitted):  # the audit row's decision time, measured here
                    decision_us = (time.perf_counter() - started) * 1e6
                    self.metrics.phase.labels("decide").observe(decision_us / 1e6)
                    for out in outputs:
                        if isinstance(out, RoutingDecision):
                            span.set_attributes(tracing.decision_attributes(out))
                    outputs = [replace(o, decision_us=decision_us) if isinstance(o, RoutingDecision) else o
                               for o in outputs]
                for out in outputs:  # the fast copy first: the agent need not wait for the stream
                    if isinstance(out, CallRouted):
                        sent = time.perf_counter()
                        await publish_fast(self.js, subjects.dispatch(out.instance_id), out)
                        self.metrics.phase.labels("dispatch").observe(time.perf_counter() - sent)
                if isinstance(event, CallSubmitted):  # the stream keeps the prompt ids once
                    seq = msg.metadata.sequence.stream
                    outputs = [o.by_reference(seq) if isinstance(o, CallRouted) else o for o in outputs]
                    self.core.state.decided(event.call_id, seq)
            # The state already counts these outputs, so they must reach the stream before the
            # input is acked: published now, in the order the state applied them.
            acks = await self.outputs.start(outputs)
            self.seq = max(self.seq, msg.metadata.sequence.stream)
            self.dirty = True
        return outputs, acks

    async def _tick(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self._tick_once()
            except Exception:
                self.log.exception("tick failed")
            try:
                await asyncio.wait_for(stop.wait(), TICK_S)
            except TimeoutError:
                pass

    async def _tick_once(self) -> None:
        async with self.lock:
            now = time.time()
            # While the bus does not answer us within a heartbeat (NATS paused, partitioned or
            # slow), agents' silence is ours, not theirs: no instance is declared lost.
            since = self.hearing.silence_counts_from(max(self.listening_since, self.unblocked_at))
            lost = self.core.check_liveness(now, since) if self.hearing.hears(now) else []
            for event in lost:
                if isinstance(event, InstanceLost):
                    self.log.warning("instance lost", instance_id=event.instance_id, reason=event.reason,
                                     calls=len(event.calls))
            outputs = lost + self.core.tick(now)
            if outputs:
                await self.outputs.publish_all(outputs)
                self._waited_on_bus(now)
                self.dirty = True

    def _waited_on_bus(self, started: float) -> None:
        """Called with the lock held since `started` for the stream's acks: past a tick, the
        snapshots that came meanwhile waited for the lock, and instances' silence is ours."""
        now = time.time()
        if now - started > TICK_S:
            self.unblocked_at = now

    async def _save_loop(self, store: ProjectionStore, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), SAVE_EVERY_S)
            except TimeoutError:
                pass
            if self.dirty:
                try:
                    await self._save(store, drain_s=SAVE_EVERY_S)
                except Exception as exc:  # Postgres is off the hot path: routing goes on
                    self.log.warning("projection save failed", error=str(exc))

    async def _save(self, store: ProjectionStore, drain_s: float) -> None:
        async with self.lock:  # a consistent cut: never in the middle of handling an input
            # ... and never ahead of the stream: every folded input's outputs are stored first.
            started = time.time()
            stored = await self.outputs.all_stored(drain_s)
            self._waited_on_bus(started)
            if not stored:  # the bus is slow or down: try later
                return
            seq, snapshot = self.seq, self.core.state.to_dict()
            self.dirty = False
        await store.save_dict(seq, snapshot)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


async def run(settings: Settings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    await RouterService(settings, logs.get("router")).run(ready, stop or asyncio.Event())
