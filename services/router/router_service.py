"""Router service: the asyncio shell around RouterCore.

Submissions come in on durable per-partition consumers (intake) and everything else a router folds
on one ephemeral consumer (view), in stream order; a submission is acked only once its outputs are
stored, and the call-id fence (RouterState.routed) makes a redelivery safe. Partitions change
hands only through the KV bucket's compare-and-set; a projection save records the view's position
so a restart folds the stream after it. How each step goes: `RouterService`.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid

import msgspec
import nats.errors
from msgspec.structs import replace
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.errors import NoRespondersError
from nats.js.errors import ServiceUnavailableError

from talaria.services.router.claims import ClaimStore
from talaria.services.router.ownership import Ownership, Partitioning, partition_of, slots_of
from talaria.services.router.router_core import PEER_OUTPUTS, RouterCore
from talaria.services.router.outputs import RouterOutputs
from talaria.services import configs
from talaria.services.configs import Configuration
from talaria.services.router.policy.registry import create_policy
from talaria.services.router.projection import ProjectionStore
from talaria.services.router.state import RouterState, rows_for
from talaria.shared import logs, metrics, tracing
from talaria.shared.metrics import RouterMetrics
from talaria.shared.health import INTERVAL_S as HEARTBEAT_INTERVAL_S, BusHearing, heartbeat_loop
from talaria.shared.logs import call_context
from talaria.shared.runtime import serve_until_stopped
from talaria.services.router.hot_pools import HotPools
from talaria.shared.bus import (BUS_ERRORS, ACK_WAIT_S, FAILOVER_S, PUBLISH_TIMEOUT_S, RECONNECT_WAIT_S, close, connect, origin_of,
                                publish_fast, retried_api, set_origin)
from talaria.shared.messages import DRAIN_DECODER, DrainStatus
from talaria.shared.wire import encode
from talaria.shared.nats_auth import ADMIN_ROLES, sender_of, sent_by, trusted
from talaria.shared.db.connection import DB_ERRORS, create_engine
from talaria.shared.durable_pull import DurablePull, from_ack_floor, unsubscribed
from talaria.shared.events import (
    CallRouted,
    CallSubmitted,
    EVENT_DECODER,
    InstanceLost,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    LeaseIssued,
    RoutingDecision,
)
from talaria.shared.snapshots import HEARTBEAT_DECODER, SNAPSHOT_DECODER
from talaria.shared.settings import CommonSettings, RouterSettings, Settings
from talaria.shared.subjects import Deployment
from talaria.shared.tracing import extract_context

def durable(partition: int) -> str:
    return f"router-p{partition}"


def intake_subjects(deployment: Deployment, partition: int, partitions: int) -> list[str]:
    if partitions == 1:
        return [deployment.call_submitted("*")]
    return [deployment.call_submitted(slot) for slot in slots_of(partition, partitions)]


VIEW_EVENTS = ("call.completed", "call.failed", "round.summary", "switch.done", "lease.issued", "lease.consumed",
               "lease.discarded", "lease.expired", "instance.lost", "pool.pinned", "kv.push", "kv.pushed")


def view_subjects(deployment: Deployment) -> list[str]:
    """What every router folds besides submissions: agents' reports and routers' outputs."""
    return [*(deployment.event(tag) for tag in VIEW_EVENTS), deployment.call_routed("*")]


TICK_S = 0.05
# After a (re)start, listen to heartbeats before deciding: routing with an empty instance
# table would reject every call waiting in the stream as "no healthy instance". The wait
# ends early once every instance of the restored table has been heard from again.
WARMUP_S = 1.2
SAVE_EVERY_S = 2.0
# A checkpoint may take at most this share of the router's time: past it the saves space out
# (a large session table; the restart replays a little more of the stream instead).
SAVE_SHARE = 0.05
MAX_DELIVER = 20  # a message that keeps failing is given up (and logged) rather than looping


def save_interval(spent_s: float) -> float:
    """Seconds to the next checkpoint after one that took `spent_s` (encode + write)."""
    return max(SAVE_EVERY_S, spent_s / SAVE_SHARE)


def configuration(common: CommonSettings, settings: RouterSettings) -> Configuration:
    """The named configuration this router runs (services/configs.py), with the router's own
    older knobs (TALARIA_LEASE_TIMEOUT_S, TALARIA_ADAPTIVE_LEASE, TALARIA_OVERLOAD) applied."""
    return configs.selected(common, policy=settings.policy, lease_timeout_s=settings.lease_timeout_s,
                            adaptive_lease=settings.adaptive_lease, overload=settings.overload)


class RouterService:
    """The asyncio shell around RouterCore.

    Two ways in from the event stream, snapshots from `talaria.telemetry.*`:

        intake  call submissions, one durable consumer per partition this router owns
                (`router-p<p>`, on its slots' `call.submitted.<slot>` subjects; ownership.py,
                claims.py). Each is decided, the routed call's core-NATS fast copy goes to its agent
                at once, and its outputs are published while the next is decided (in order, so the
                stream keeps the order the state applied them in); the submission is acked only
                once all of them are stored, so a crash redelivers rather than loses it, and the
                call-id fence (RouterState.routed: a call is decided once) makes redelivery safe.
        view    everything else a router folds, read in stream order by an ephemeral consumer:
                agents' completions, failures, round summaries, and other routers' outputs (their
                routed calls, leases, lost instances), so every router's state counts every
                router's placements and reservations. Its own outputs (Talaria-Origin: this
                process) are skipped: they were folded when made.

    A partition changes hands only through the KV bucket's compare-and-set. Taking one over
    (claimed, or adopted after a restart): wait until the view has folded the stream as it was
    at the claim (the previous owner's decisions are in the state: the fence holds), then
    recreate the partition's consumer from its ack floor (what the previous owner fetched and
    did not ack comes back at once; the recreation also cuts off a stalled previous owner's
    pulls) and consume. Releasing one (another router is preferred): stop consuming, wait for
    the outputs in flight to be stored and their submissions acked, then delete the key.

    A projection save waits until every output is stored, and records the view's position:
    a restart loads it from Postgres and folds the stream after that position (its own earlier
    outputs among them: the fold is idempotent) before it claims anything.
    """

    def __init__(self, common: CommonSettings, settings: RouterSettings, log) -> None:
        self.common, self.settings, self.log = common, settings, log
        self.deployment = common.deployment
        self.configuration = configuration(common, settings)  # a SettingsError naming the variable
        policy = create_policy(self.configuration.policy, self.configuration.router)
        self.router_id = settings.router_id or f"router-{uuid.uuid4().hex[:8]}"
        self.origin = uuid.uuid4().hex  # this process: its outputs, read back by the view, are skipped
        self.ownership = Ownership(self.router_id, settings.router_partitions, settings.router_ownership_ttl_s)
        # Owns nothing until a partition is claimed and the view has caught up with it.
        self.core = RouterCore(policy, pools=HotPools(z=self.configuration.hot_pools_z) if settings.hot_pools else None,
                               partitioning=Partitioning(settings.router_partitions, frozenset()))
        self.lock = asyncio.Lock()  # one input at a time: the core is single-threaded by design
        self.dirty = False
        self.seq = 0  # stream sequence the view has folded up to (saved with the state)
        self.listening_since = time.time()  # restored views are not "silent" before this
        # The end of the last stretch the lock was held waiting on the stream (a broker
        # failover): snapshots that arrived meanwhile were not folded, so silence counts from it.
        self.unblocked_at = 0.0
        self.warm = asyncio.Event()  # every restored instance heard from again
        self.expected: set[str] = set()
        self.peers: dict[str, float] = {}  # router id -> when its heartbeat was last heard
        self.intakes: dict[int, tuple[asyncio.Task, asyncio.Event]] = {}  # partition -> consumer task, its stop
        self.taking: set[int] = set()  # partitions being taken over right now (catching up)
        self.releasing: set[int] = set()  # partitions being handed over right now (draining)
        self.round_done = asyncio.Event()  # set after each ownership round (_claim_confirmed waits on it)
        self.caught_up_at = 0.0  # the issue time of the last view fetch that found nothing more
        self.view_moved = asyncio.Event()
        self.metrics = RouterMetrics()
        self.metrics.scrape_gauge("talaria_router_leases_active", "Live leases (soft reservations) by model",
                                  ("model",), self._live_leases)
        self.metrics.scrape_gauge("talaria_router_sessions", "Rows in the router's session table (bounded in "
                                  "bytes: TALARIA_ROUTER_SESSION_TABLE_BYTES)", (),
                                  lambda: {(): len(self.core.state.sessions)})
        self.metrics.scrape_gauge("talaria_router_instances", "Instances in the router's view",
                                  (), lambda: {(): len(self.core.state.instances)})
        self.metrics.scrape_gauge("talaria_router_partitions_owned", "Intake partitions this router consumes",
                                  (), lambda: {(): len(self.core.partitioning.owned)})

    def _live_leases(self) -> dict:
        book, now = self.core.state.leases, time.time()
        return {(m,): book.live_for(m, now) for m in book.by_model}

    async def run(self, ready: asyncio.Event | None, stop: asyncio.Event) -> None:
        provider = tracing.setup("router", self.common)
        self.tracer = provider.get_tracer("talaria.router")
        db = create_engine(self.common.database_url)
        store = ProjectionStore(db)
        self.nc, self.js = await connect(self.common.nats_url, "talaria-router", **self.common.bus_options())
        set_origin(self.nc, self.origin)
        self.api = retried_api(self.nc)  # consumer setup and stream reads: each is retried
        self.outputs = RouterOutputs(self.js, self.nc, self.log, self.core.policy.config,
                                     on_stored=lambda seq: None, metrics=self.metrics)
        self.claims = await ClaimStore.open(self.js, self.settings.router_ownership_ttl_s,
                                            self.settings.router_partitions, retried=self.api)
        if self.claims.ttl_s != self.ownership.ttl_s:
            self.log.warning("the ownership bucket's TTL differs from this router's; using the bucket's",
                             bucket_ttl_s=self.claims.ttl_s, setting=self.ownership.ttl_s)
            self.ownership.ttl_s = self.claims.ttl_s
        # one file per replica (<data_dir>/metrics/<router id>.url): replicas share a data directory
        metrics_runner = await metrics.serve(self.metrics, self.router_id, self.common, self.log)
        saved = await store.load()
        if saved is not None:
            pools = self.core.pools
            self.core.state, self.seq = saved
            if pools is None or self.core.pools is None:  # pools as configured now; saved ones resume
                self.core.pools = pools
        # Session memory in bytes: the table's rows and the output estimates kept per session.
        rows = rows_for(self.settings.router_session_table_bytes)
        self.core.state.sessions_kept = self.core.state.outputs.kept = rows
        tasks = [asyncio.create_task(self._view(stop))]
        await self._caught_up(await self._stream_last())  # the state as the stream is now
        self.log.info("router recovered", seq=self.seq, sessions=len(self.core.state.sessions))
        gc.collect()
        gc.freeze()  # the recovered tables are long-lived: keep them out of every GC scan
        self.listening_since = time.time()
        state = self.core.state
        # Instances the recovered state places anything on: routing waits to hear them all.
        self.expected = set(state.instances) | {p.instance_id for p in state.inflight_calls.values()} | {
            lease.instance_id for lease in state.leases.leases.values()}
        await self.nc.subscribe(self.deployment.telemetry_wildcard, cb=self._on_snapshot)
        await self.nc.subscribe(self.deployment.health("router"), cb=self._on_peer)
        await self.nc.subscribe(self.deployment.admin_drain, cb=self._on_drain)
        try:
            await asyncio.wait_for(self.warm.wait(), WARMUP_S)
        except TimeoutError:
            pass  # some restored instance stayed silent: heartbeat loss will settle it
        self.hearing = BusHearing(self.nc, TICK_S, HEARTBEAT_INTERVAL_S, self.log)
        tasks += [asyncio.create_task(self._tick(stop)), asyncio.create_task(self.hearing.run(stop)),
                  asyncio.create_task(self._save_loop(store, stop)),
                  asyncio.create_task(heartbeat_loop(self.nc, "router", stop, self._health))]
        await self._own_once()  # the first claims before saying ready: a lone router owns everything
        tasks.append(asyncio.create_task(self._own_loop(stop)))
        self.log.info("router ready", policy=self.core.policy.name, seq=self.seq, router_id=self.router_id)
        if ready is not None:
            ready.set()
        try:
            await serve_until_stopped("router", stop, tasks)
        finally:
            stop.set()
            for _, halt in self.intakes.values():
                halt.set()
            # Let each consumer finish the message in hand (it checks its stop between fetches).
            await asyncio.wait(tasks + [t for t, _ in self.intakes.values()], timeout=5)
            for t in tasks + [t for t, _ in self.intakes.values()]:
                t.cancel()
            await asyncio.gather(*tasks, *(t for t, _ in self.intakes.values()), return_exceptions=True)
            try:
                await self._save(store, drain_s=PUBLISH_TIMEOUT_S)
            except DB_ERRORS as exc:  # the replay on the next start covers what is not saved
                self.log.warning("final projection save failed", error=str(exc))
            await self.outputs.cancel_pending()  # not stored: their inputs stay unacked and come back
            await self._release_all()  # a clean stop hands its partitions over now, not a TTL later
            await close(self.nc)
            if metrics_runner is not None:
                await metrics_runner.cleanup()
            await db.dispose()
            provider.shutdown()

    def _health(self) -> dict[str, str]:
        return {"policy": self.core.policy.name, "instances": str(len(self.core.state.instances)),
                "router_id": self.router_id, "partitions": ",".join(map(str, sorted(self.core.partitioning.owned)))}

    async def _stream_last(self) -> int:
        """The events stream's last sequence; asked again through a failover (each try ATTEMPT_S)."""
        deadline = time.monotonic() + FAILOVER_S
        while True:
            try:
                return (await self.api.stream_info(self.deployment.events_stream)).state.last_seq
            except (nats.errors.TimeoutError, ServiceUnavailableError, NoRespondersError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(RECONNECT_WAIT_S)

    # ---- the view: every router's state folds every router's outputs -------------------

    async def _view(self, stop: asyncio.Event) -> None:
        """Fold the stream's view subjects in order from `self.seq + 1`, for good. A consumer
        that fails (a broker failover) is made again from where the fold stopped."""
        while not stop.is_set():
            try:
                sub = await self.api.pull_subscribe(
                    "", stream=self.deployment.events_stream,
                    config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                          opt_start_seq=self.seq + 1, filter_subjects=view_subjects(self.deployment),
                                          inactive_threshold=30))
            except BUS_ERRORS as exc:
                self.log.warning("view consumer not made; retrying", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            try:
                await self._view_from(sub, stop)
            except BUS_ERRORS as exc:
                self.log.warning("view consumer failed; resuming after the last event folded",
                                 seq=self.seq, error=str(exc))
                await asyncio.sleep(0.2)
            finally:
                await unsubscribed(sub)

    async def _view_from(self, sub, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            issued, reconnects = loop.time(), self.nc.stats["reconnects"]
            try:
                msgs = await sub.fetch(256, timeout=0.5)
            except asyncio.TimeoutError:
                msgs = []
            if self.nc.stats["reconnects"] != reconnects:  # deliveries may be lost: it never redelivers
                raise ConnectionError("reconnected while fetching")
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                if seq <= self.seq:
                    continue  # a recreated consumer's overlap
                await self._fold(msg)
                self.seq = seq
            if not msgs or msgs[-1].metadata.num_pending == 0:
                self.caught_up_at = issued  # nothing later than what this fetch saw is left
            self.view_moved.set()
            self.view_moved.clear()

    async def _caught_up(self, target: int) -> None:
        """Until the view has folded every view event up to stream sequence `target`."""
        asked = asyncio.get_running_loop().time()
        while self.seq < target and self.caught_up_at <= asked:
            await self.view_moved.wait()

    async def _fold(self, msg) -> None:
        try:
            event = EVENT_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        if origin_of(msg) == self.origin or not trusted(msg, event):
            return  # our own output (folded when made), or from a service that does not own it
        async with self.lock:
            now = time.time()
            if isinstance(event, PEER_OUTPUTS):
                if isinstance(event, CallRouted):
                    self.metrics.peer_lag.observe(max(0.0, now - event.routed_at))
                outputs = self.core.fold_peer(event, now)
            else:
                outputs = self.core.handle(event, now)  # reacts only for the sessions we own
                self.metrics.observe(event)
            self.dirty = True
            if outputs:
                self.outputs.store_soon(outputs, await self.outputs.start(outputs))

    # ---- ownership ---------------------------------------------------------------------

    async def _on_drain(self, msg) -> None:
        """`talaria drain INSTANCE` (the admin user only; every router marks it, and the
        command asks again until one says drained: a restarted router learns it again)."""
        if not sent_by(msg.headers, ADMIN_ROLES):
            status = DrainStatus("", error="drain refused: not sent by the admin user")
        else:
            try:
                req = DRAIN_DECODER.decode(msg.data)
            except msgspec.ValidationError as exc:
                status = DrainStatus("", error=f"drain refused: {exc}")
            except msgspec.DecodeError:
                status = DrainStatus("", error="drain refused: not a drain request")
            else:
                async with self.lock:
                    status, asks = self.core.drain(req.instance_id, time.time())
                    if asks:  # each asks an agent to pull a session's pages (drain_push.py)
                        self.dirty = True
                        self.outputs.store_soon(asks, await self.outputs.start(asks))
                if not status.error:
                    self.log.info("instance draining", instance_id=req.instance_id, calls=status.calls,
                                  sessions=status.sessions, pushes=len(asks), moved=status.moved,
                                  lost=status.lost, drained=status.drained)
        if msg.reply:
            await msg.respond(encode(status))

    async def _on_peer(self, msg) -> None:
        try:
            beat = HEARTBEAT_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        peer = beat.detail.get("router_id") if isinstance(beat.detail, dict) else None
        if peer:
            self.peers[peer] = time.time()

    def _members(self, now: float) -> set[str]:
        return {r for r, at in self.peers.items() if now - at <= self.ownership.ttl_s} | {self.router_id}

    async def _own_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.ownership.renew_every_s)
            except TimeoutError:
                pass
            if stop.is_set():
                return
            try:
                await self._own_once()
            except BUS_ERRORS as exc:  # the bucket is unreachable: claims lapse, intake stops with them
                self.log.warning("ownership round failed", error=str(exc))
            finally:
                self.round_done.set()  # intakes held for a confirmation look again

    async def _claim_confirmed(self, p: int) -> bool:
        """Wait until our claim on p is surely current (`Ownership.current`); False once it is
        lost. After a stall (SIGSTOP, a long pause) the claim may have lapsed and another router
        decided these submissions: nothing is decided until the next ownership round knows."""
        while p in self.ownership.owned and not self.ownership.current(p, time.time()):
            self.log.warning("deciding held: the partition claim is not confirmed", partition=p)
            self.round_done.clear()
            await self.round_done.wait()
        return p in self.ownership.owned

    async def _own_once(self) -> None:
        now = time.time()
        await self.claims.refresh_partitions(self.ownership.partitions)
        plan = self.ownership.plan(await self.claims.read(self.ownership.partitions), self._members(now), now)
        for p in plan.lost:
            self.log.warning("partition lost: its claim expired or another router holds it", partition=p)
            self.ownership.lost(p)
            await self._stop_intake(p, drain=False)
        for p in plan.reclaim:
            sent = time.time()
            revision = await self.claims.create(p, self.router_id)
            if revision is None:  # another router created it first
                self.log.warning("partition lost: another router claimed it after ours lapsed", partition=p)
                self.ownership.lost(p)
                await self._stop_intake(p, drain=False)
            else:
                self.log.warning("partition claim lapsed and was made again; its intake kept", partition=p)
                self.ownership.claimed(p, revision, sent)
                async with self.lock:  # its dispatches carry the new epoch
                    self._set_owned(self.core.partitioning.owned)
        for p, revision in plan.renew:
            if p in self.releasing:
                continue
            sent = time.time()
            new = await self.claims.renew(p, self.router_id, revision)
            if new is None:
                self.ownership.lost(p)
                await self._stop_intake(p, drain=False)
                continue
            self.ownership.renewed(p, new, sent)
            if p not in self.intakes and p not in self.taking:  # adopted after a restart under the same id
                self._spawn(self._take(p, "adopted"), p, self.taking)
        for p in plan.claim:
            sent = time.time()
            revision = await self.claims.create(p, self.router_id)
            if revision is not None:
                self.ownership.claimed(p, revision, sent)
                self._spawn(self._take(p, "claimed"), p, self.taking)
        for p, revision in plan.release:
            if p not in self.releasing and p not in self.taking:
                self._spawn(self._release(p, revision), p, self.releasing)

    def _spawn(self, coro, partition: int, doing: set[int]) -> None:
        doing.add(partition)
        task = asyncio.create_task(coro)
        task.add_done_callback(lambda t: (doing.discard(partition), t.cancelled() or t.exception() and
                                          self.log.error("partition change failed", partition=partition,
                                                         error=str(t.exception()))))

    async def _take(self, p: int, how: str) -> None:
        started = time.time()
        await self._caught_up(await self._stream_last())  # the previous owner's decisions are folded
        if p not in self.ownership.owned:
            return  # lost again meanwhile
        sub = await self._ensure_consumer(p)
        halt = asyncio.Event()
        async with self.lock:
            self._set_owned(self.core.partitioning.owned | {p})
        self.intakes[p] = (asyncio.create_task(self._consume(p, sub, halt)), halt)
        self.metrics.takeovers.labels(how).inc()
        self.log.info("partition taken", partition=p, how=how, catch_up_s=round(time.time() - started, 3))

    async def _release(self, p: int, revision: int) -> None:
        await self._stop_intake(p, drain=True)
        await self.claims.release(p, revision)
        self.ownership.released(p)
        self.log.info("partition handed over", partition=p)

    async def _release_all(self) -> None:
        for p, revision in list(self.ownership.owned.items()):
            try:
                await self.claims.release(p, revision)
            except BUS_ERRORS:
                pass  # it lapses a TTL later instead

    async def _stop_intake(self, p: int, drain: bool) -> None:
        async with self.lock:  # no decision for p starts after this
            self._set_owned(self.core.partitioning.owned - {p})
        running = self.intakes.pop(p, None)
        if running is None:
            return
        task, halt = running
        halt.set()
        self.round_done.set()  # an intake held for a confirmation sees the partition gone
        await asyncio.wait([task], timeout=PUBLISH_TIMEOUT_S)
        if drain:  # its decided submissions' outputs stored and the submissions acked
            await self.outputs.all_stored(PUBLISH_TIMEOUT_S)

    def _set_owned(self, owned) -> None:
        self.core.partitioning = self.ownership.fenced(owned, self.ownership.partitions)

    def _consumer_config(self, p: int) -> ConsumerConfig:
        return ConsumerConfig(durable_name=durable(p), ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                              filter_subjects=intake_subjects(self.deployment, p, self.ownership.partitions),
                              ack_wait=ACK_WAIT_S, max_deliver=MAX_DELIVER)

    async def _ensure_consumer(self, p: int) -> DurablePull:
        """Partition p's durable intake consumer, made again from its ack floor: what a previous
        owner had fetched and not acked is delivered at once (not after `ack_wait`, 30 s: a call
        submitted just before its death would time out), and its pending pulls end. Submissions
        already decided are skipped by the core (the call-id fence), as for any redelivery."""
        config = self._consumer_config(p)
        sub, _ = await from_ack_floor(self.api, self.deployment.events_stream, config, self.log, partition=p)
        return DurablePull(self.nc, self.api, self.deployment.events_stream, config, sub, self.log,
                           RECONNECT_WAIT_S, partition=p)

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

    async def _consume(self, p: int, intake: DurablePull, halt: asyncio.Event) -> None:
        """Partition p's submissions, in order. After a failed fetch (the consumer's leader
        lost) or a reconnect, the consumer is made again from its ack floor (DurablePull)."""
        try:
            while not halt.is_set():
                for msg in await intake.fetch(64, timeout=1.0):
                    await self._handle(msg)
        finally:
            await intake.close()

    async def _handle(self, msg) -> None:
        try:
            event = EVENT_DECODER.decode(msg.data)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable event dropped", subject=msg.subject, error=str(exc))
            await msg.term()
            return
        if not trusted(msg, event) or not isinstance(event, CallSubmitted):  # e.g. not from the gateway
            self.log.error("event from a service that does not own it dropped", subject=msg.subject,
                           sender=sender_of(msg), event_type=type(event).__name__)
            await msg.term()
            return
        call_id = getattr(event, "call_id", None)
        session_id = getattr(event, "session_id", None)
        if not await self._claim_confirmed(partition_of(session_id, self.ownership.partitions)):
            await msg.nak()  # lost while we stalled: its new owner decides it
            return
        if self.core.state.reused(call_id, msg.metadata.sequence.stream):
            await self.outputs.refuse_reused(event)  # past JetStream's duplicate window, the gateway could not tell
            await msg.ack()
            return
        try:
            with call_context(session_id, call_id) if call_id and session_id else _null():
                handled = await self._handle_event(event, msg)
        except Exception:  # never let one input stop the router: it is redelivered
            self.log.exception("input failed; will be redelivered", subject=msg.subject)
            await msg.nak(delay=1)
            return
        if handled is None:  # its partition was handed over meanwhile: left (unacked) to its new owner
            await msg.nak()
            return
        outputs, acks = handled
        if not outputs:  # e.g. a redelivered copy of a decided call: acked behind its first copy's outputs
            self.outputs.ack_after_stored(msg)
            return
        # Its outputs are on their way (published in order); their acks are awaited while
        # the next input is folded, and this input is acked only once all are stored.
        self.outputs.store_then_ack_soon(outputs, acks, msg)

    async def _handle_event(self, event, msg) -> tuple[list, list] | None:
        async with self.lock:
            if not self.core.owns(event):  # handed over while this batch was in hand: its new owner decides
                return None
            ctx = extract_context(msg.headers)
            with self.tracer.start_as_current_span("route", context=ctx, attributes=tracing.request_attributes(event)) \
                    if isinstance(event, CallSubmitted) else _null() as span:
                started = time.perf_counter()
                now = time.time()
                self._excuse_own_silence(now)
                outputs = self.core.handle(event, now)
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
                        await publish_fast(self.js, self.deployment.dispatch(out.instance_id), out)
                        self.metrics.phase.labels("dispatch").observe(time.perf_counter() - sent)
                if isinstance(event, CallSubmitted):  # the stream keeps the prompt ids once
                    seq = msg.metadata.sequence.stream
                    outputs = [o.by_reference(seq) if isinstance(o, CallRouted) else o for o in outputs]
                    self.core.state.decided(event.call_id, seq)
            # The state already counts these outputs, so they must reach the stream before the
            # input is acked: published now, in the order the state applied them.
            acks = await self.outputs.start(outputs)
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
            self._excuse_own_silence(now)
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

    def _excuse_own_silence(self, now: float) -> None:
        """Views fresh when the router went deaf count as heard when it could hear again, before
        anything judges them: liveness (each tick) and each decision, which may come first after
        a failover (its stale views would refuse the call 503 "no healthy instance")."""
        for deaf_from, until in self.hearing.own_silence(now):
            if until > self.listening_since:
                self.core.state.excuse_silence(deaf_from, until, self.core.policy.config.stale_after_s)

    def _waited_on_bus(self, started: float) -> None:
        """Called with the lock held since `started` for the stream's acks: past a tick, the
        snapshots that came meanwhile waited for the lock, and instances' silence is ours."""
        now = time.time()
        if now - started > TICK_S:
            self.unblocked_at = now
            self.core.state.excuse_silence(started, now, self.core.policy.config.stale_after_s)

    async def _save_loop(self, store: ProjectionStore, stop: asyncio.Event) -> None:
        wait = SAVE_EVERY_S
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), wait)
            except TimeoutError:
                pass
            if self.dirty:
                try:
                    wait = save_interval(await self._save(store, drain_s=SAVE_EVERY_S))
                except DB_ERRORS as exc:  # Postgres is off the hot path: routing goes on
                    self.log.warning("projection save failed", error=str(exc))

    async def _save(self, store: ProjectionStore, drain_s: float) -> float:
        """Checkpoint the state; returns the seconds the checkpoint itself took (the state's
        encoding, under the lock, and its write), not the wait for the stream's acks."""
        async with self.lock:  # a consistent cut: never in the middle of handling an input
            # ... and never ahead of the stream: every folded input's outputs are stored first.
            started = time.time()
            stored = await self.outputs.all_stored(drain_s)
            self._waited_on_bus(started)
            if not stored:  # the bus is slow or down: try later
                return 0.0
            encoding = time.perf_counter()
            seq, snapshot = self.seq, self.core.state.to_dict()
            self.dirty = False
            spent = time.perf_counter() - encoding
        writing = time.perf_counter()
        await store.save_dict(seq, snapshot)
        spent += time.perf_counter() - writing
        self.metrics.checkpoint.observe(spent)
        return spent


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


async def run(settings: Settings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    await RouterService(settings.common, settings.router, logs.get("router")).run(ready, stop or asyncio.Event())
