"""The closed-loop replayer and the router in the loop.

    session call i ready ──► CallSubmitted ──► RouterCore.handle ──► CallRouted ──► instance
          ▲                                                                            │
          └── + gap(i+1) ◄── CallCompleted ──► RouterCore.handle (leases) ◄────────────┘

The router is the project's own `RouterCore` on the virtual clock; instances report
snapshots as live agents heartbeat; no oracle: a call carries its client's `max_tokens`,
never its true length. Snapshots, router replicas, retries and what a call carries are
`Cluster`'s docstring.
"""

from __future__ import annotations

import math

import sys
import time
from dataclasses import dataclass, field, replace

import msgspec

from talaria.services.instance_agent.scheduler import SchedulerConfig
from talaria.services.router.hot_pools import HotPools
from talaria.services.router.ownership import Partitioning
from talaria.services.router.router_core import PEER_OUTPUTS, RouterCore
from talaria.services.router.policy.base import PolicyConfig
from talaria.services.router.policy.registry import create_policy
from talaria.shared.events import (
    CallCompleted,
    CallFailed,
    CallRouted,
    CallSubmitted,
    InstanceLost,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    LeaseIssued,
    PoolPinned,
    RoutingDecision,
)
from talaria.services.router.prefix_index import INDEXED_BLOCKS
from talaria.sim.agents import PromptHashes, RetryPolicy
from talaria.sim.anonymous_sessions import AnonymousSessions
from talaria.sim.event_loop import EventLoop
from talaria.sim.device_view import DeviceView
from talaria.sim.executor import Job, SimExecutor, instance_config
from talaria.sim.profiles import ServerProfile
from talaria.traces.caps import client_cap
from talaria.traces.format import Session
from talaria.traces.gaps import GapModel


@dataclass(frozen=True)
class RunConfig:
    server: ServerProfile
    instances: int = 1
    policy: str = "least-loaded"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    scheduler: SchedulerConfig = field(default_factory=instance_config)  # executor.instance_config
    gaps: GapModel = field(default_factory=GapModel)
    heartbeat_s: float = 0.5
    label: str = ""
    progress: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)  # what a session does on a 503
    max_wall_s: float | None = None  # stop the run after this much wall time (result incomplete)
    # Stop once SCT p95 <= this is out of reach (more sessions than p95 allows are past it, done
    # or not): the verdict of a capacity search (capacity.py) without simulating the rest.
    stop_above_p95_s: float | None = None
    max_decode_steps: int = 4096  # simulator speed: decode tokens per event (exact, see executor.py)
    log_actions: bool = False  # keep each instance's executed actions (schedule_bound.py)
    # Per instance (in order), the model a hot-pool instance is pinned to, or None for a cold
    # one; empty: every instance cold. A static per-model pool deployment (deployment.py).
    pinned: tuple[str | None, ...] = ()
    # The router chooses the hot pools online from measured demand (services/router/hot_pools.py),
    # starting from `pinned` (which must pin every instance): talaria's own machinery.
    hot_pools: bool = False
    hot_pools_z: float = 1.0  # its noise margin in standard errors (hot_pools.py; swept in the notes)
    # model -> leading prompt tokens every session of it shares (a system prompt and tool
    # schema); the prompt hashes and the instances' prefix caches see them (workloads.py)
    shared_prefix: dict[str, int] = field(default_factory=dict)
    # An instance also snapshots when a call finishes there, at most this often: the live
    # agent's SNAPSHOT_ON_CHANGE_MIN_S (its runner; kept here so the simulator imports no I/O shell).
    snapshot_on_change_s: float = 0.05
    # Router replicas: sessions split over this many routers, each seeing the others' outputs
    # (and the completions it did not receive) this much later.
    routers: int = 1
    propagation_s: float = 0.0
    # What the router gets when clients name no session: named (the true id) | inferred
    # (talaria's gateway) | per-call (a peer's router without a key); anonymous_sessions.py
    session_ids: str = "named"


@dataclass
class RouterCounters:
    routed: int = 0
    rejected: int = 0  # 503 answers (a call rejected twice counts twice)
    retries: int = 0  # resubmissions after a 503
    gave_up: int = 0  # calls that exhausted the retry bound (their sessions never complete)
    returns: int = 0
    same_instance_returns: int = 0
    model_residency_hits: int = 0
    avoidable_cold_opens: int = 0  # measured by the simulator, same rule for every policy
    policy_avoidable_cold_opens: int = 0  # as the policy itself flagged them
    model_opens_needed: int = 0
    leases_issued: int = 0
    leases_consumed: int = 0
    repins: int = 0  # hot-pool moves the router made (RunConfig.hot_pools)
    leases_discarded: int = 0
    leases_expired: int = 0
    decision_us: float = 0.0


@dataclass
class RunResult:
    config: RunConfig
    sessions: list[Session]
    jobs: list[Job]
    instances: list[SimExecutor]
    router: RouterCounters
    gaps_applied: dict[tuple[str, int], float]
    virtual_s: float
    wall_s: float
    events: int


class Cluster:
    """The router is the project's own `RouterCore` with a policy from the registry, driven on
    the virtual clock. Instances report `InstanceSnapshot`s the way live agents heartbeat:
    lazily, right before a routing decision, each instance whose last snapshot is older than
    `heartbeat_s` sends a fresh one (equivalent to periodic heartbeats for every decision the
    router makes, without simulating idle heartbeats). Like a live agent, an instance also
    sends one when a call finishes there, at most every `snapshot_on_change_s` (the router
    learns of freed capacity and the session's KV at once, not a heartbeat later).
    `RouterCore.tick` runs before each decision and once at the end, so lease expiry is
    observed at decision times.

    Router replicas (`routers` > 1): N RouterCores, each owning the sessions of its partitions
    (ownership.Partitioning) as live; snapshots reach every router at once (core NATS, as
    live), but one router's outputs (routed calls, leases) and the completions it did not
    receive reach the others `propagation_s` later (the stream-view lag measured live): until
    then they place with a stale view of that instance.

    A rejected call (503) is retried the way agents retry (talaria/sim/agents.py): after the
    decision's Retry-After, up to a bound; its schedule-aware TTFT keeps counting from the
    original release, and a call that gives up leaves its session incomplete (SCT = inf).
    Each call carries the block hashes the gateway would compute for its prompt.

    No oracle: a call is submitted with its client's `max_tokens` (the trace's, else a client
    default, traces/caps.py), never its true output length, which only the instance executing
    it learns (it stops there, as a live engine stops at EOS). Every policy sees what a live
    router sees.
    """

    def __init__(self, sessions: list[Session], config: RunConfig) -> None:
        self.sessions = sessions
        self.config = config
        self.loop = EventLoop()
        if config.hot_pools and not config.pinned:
            raise ValueError("hot_pools needs the starting pins (None: a cold instance)")

        def pools():  # each router's own controller (partition 0's owner decides)
            return HotPools({f"inst-{k:02d}": m for k, m in enumerate(config.pinned)}, z=config.hot_pools_z,
                            models=tuple(config.server.models)) if config.hot_pools else None

        n = config.routers
        self.routers = [RouterCore(create_policy(config.policy, config.policy_config), pools=pools(),
                                   partitioning=Partitioning(n, frozenset({r})) if n > 1 else None)
                        for r in range(n)]
        self.router = self.routers[0]
        view = DeviceView(config.server)  # profile-only snapshot parts, computed once for all
        self.instances: dict[str, SimExecutor] = {}
        if config.pinned and len(config.pinned) != config.instances:
            raise ValueError(f"pinned names {len(config.pinned)} instances, the run has {config.instances}")
        for k in range(config.instances):
            iid = f"inst-{k:02d}"
            sched = config.scheduler
            if config.pinned and config.pinned[k] is not None:
                sched = replace(sched, pool="hot", pinned_model=config.pinned[k])
            self.instances[iid] = SimExecutor(iid, config.server, sched, self, config.max_decode_steps, view)
            if config.log_actions:
                self.instances[iid].log = []
        for inst in self.instances.values():
            inst.peers = self.instances
        # per instance, in instance order: [instance, last snapshot time, version, state key,
        # last snapshot]; one list so the per-decision heartbeat scan is a single pass
        self._snap_recs: list[list] = [[inst, -1e18, 0, None, None] for inst in self.instances.values()]
        self._snap_rec = {rec[0].id: rec for rec in self._snap_recs}
        self._snap_due = float("-inf")  # no snapshot refresh is due before this time
        self.counters = RouterCounters()
        self.jobs: list[Job] = []
        self.gaps_applied: dict[tuple[str, int], float] = {}
        self._last_instance: dict[str, str] = {}
        self._retries: dict[str, int] = {}
        self._prompts = PromptHashes()
        self._hashes: dict[str, list[int]] = {}  # call id -> its prompt's block hashes
        self._by_id = {s.id: s for s in sessions}
        self.anonymous = AnonymousSessions(config.session_ids) if config.session_ids != "named" else None

    # ---- run --------------------------------------------------------------------------

    def run(self) -> RunResult:
        started = time.perf_counter()
        for s in self.sessions:
            first = s.calls[0]
            self.loop.push(max(0.0, first.gap_before_s), self._release, (s.id, 0))
        progress = self._progress if self.config.progress else None
        stop = None
        if self.config.max_wall_s is not None:
            deadline = started + self.config.max_wall_s
            stop = lambda: time.perf_counter() > deadline  # noqa: E731
        if self.config.stop_above_p95_s is not None:
            stop = self._p95_missed(self.config.stop_above_p95_s, stop)
        self.loop.run(progress=progress, stop=stop)
        self.stopped_early = bool(self.loop._heap)
        now = self.loop.now
        for router in self.routers:
            self._count(router.tick(now + 3600.0))
        return RunResult(
            self.config,
            self.sessions,
            self.jobs,
            list(self.instances.values()),
            self.counters,
            self.gaps_applied,
            now,
            time.perf_counter() - started,
            self.loop.events,
        )

    def _p95_missed(self, slo_s: float, other):
        """A stop() that is True once more than n - ceil(0.95 n) sessions have an SCT over
        `slo_s` for sure (finished over it, or open past it), or when `other` is."""
        allowed = len(self.sessions) - math.ceil(0.95 * len(self.sessions))
        starts = sorted((max(0.0, s.calls[0].gap_before_s), s.id) for s in self.sessions)
        start = {sid: t for t, sid in starts}
        depth = {s.id: len(s.calls) for s in self.sessions}
        finished: dict[str, float] = {}  # session -> its SCT
        seen = 0

        def stop() -> bool:
            nonlocal seen
            for job in self.jobs[seen:]:
                if job.call_index + 1 == depth[job.session]:
                    finished[job.session] = job.done_t - start[job.session]
            seen = len(self.jobs)
            late = sum(1 for sct in finished.values() if sct > slo_s)
            for t, sid in starts:
                if t + slo_s >= self.loop.now:
                    break
                late += sid not in finished
            return late > allowed or (other is not None and other())
        return stop

    def _progress(self, now: float, events: int) -> None:
        done = len(self.jobs)
        total = sum(len(s.calls) for s in self.sessions)
        print(
            f"  [{self.config.label or self.config.policy}] t={now:9.1f}s "
            f"calls {done}/{total} events {events}",
            file=sys.stderr,
        )

    # ---- replayer ---------------------------------------------------------------------

    def _release(self, now: float, session_id: str, index: int):
        call = self._by_id[session_id].calls[index]
        job = Job(
            call_id=f"{session_id}#{index}",
            session=session_id,
            model=call.model,
            call_index=index,
            prompt=call.prompt_tokens,
            reusable=call.reusable_prefix_tokens,
            output=call.output_tokens,
            release_t=now,
            shared=min(self.config.shared_prefix.get(call.model, 0), call.prompt_tokens - 1),
            max_tokens=client_cap(call, self.config.server.model(call.model).max_context),
        )
        if self.anonymous is not None:  # the whole prompt's hashes: the session is read off them
            full = self.anonymous.hashes(session_id, index, call.prompt_tokens, call.reusable_prefix_tokens,
                                         job.shared, call.model)
            self.anonymous.submit(job.call_id, session_id, full, now)
            self._hashes[job.call_id] = full[:INDEXED_BLOCKS]  # no router reads past them (agents.py)
            return self._route(now, job)
        self._hashes[job.call_id] = self._prompts.for_call(
            session_id, index, call.prompt_tokens, call.reusable_prefix_tokens, job.shared, call.model)
        return self._route(now, job)

    def _owner(self, session_id: str) -> RouterCore:
        if len(self.routers) == 1:
            return self.router
        return next(r for r in self.routers if r.partitioning.owns(session_id))

    def _tell_peers(self, owner: RouterCore, events, now: float, completion: CallCompleted | None = None):
        """The others fold `owner`'s outputs (and the completion it heard) propagation_s later."""
        if len(self.routers) == 1:
            return []
        shared = [e for e in events if isinstance(e, PEER_OUTPUTS)]
        if completion is not None:
            shared.insert(0, completion)
        if not shared:
            return []
        peers = [peer for peer in self.routers if peer is not owner]
        if self.config.propagation_s <= 0:  # an instant view: exactly one router's
            for peer in peers:
                self._peer_fold(now, peer, shared)
            return []
        return [(now + self.config.propagation_s, self._peer_fold, (peer, shared)) for peer in peers]

    def _peer_fold(self, now: float, peer: RouterCore, events):
        for ev in events:
            if isinstance(ev, CallCompleted):
                produced = peer.handle(ev, now)  # not its session: folded, no reaction (pools: maybe)
                self._count(produced)
                self._repin(produced, now)
            else:
                self._count(peer.fold_peer(ev, now))
        return None

    def _tick_all(self, now: float):
        out = []
        for router in self.routers:
            produced = router.tick(now)
            self._count(produced)
            out += self._tell_peers(router, produced, now)
        return out

    def _route(self, now: float, job: Job):
        self._refresh_snapshots(now)
        later = self._tick_all(now)
        anon = self.anonymous
        seen = anon.visible[job.call_id] if anon is not None else job.session  # the router's session
        submitted = CallSubmitted(
            call_id=job.call_id,
            session_id=seen,
            model=job.model,
            prompt_ids=[],
            block_hashes=self._hashes[job.call_id],
            max_tokens=job.max_tokens,
            submitted_at=now,
            prompt_tokens_hint=job.prompt,
            session_origin=anon.origin[job.call_id] if anon is not None else "named",
        )
        started = time.perf_counter()  # the decision's wall time, measured here in the shell
        owner = self._owner(seen)
        events = owner.handle(submitted, now)
        self.counters.decision_us += (time.perf_counter() - started) * 1e6
        self._count(events)
        out = later + self._tell_peers(owner, events, now)
        for ev in events:
            if isinstance(ev, CallRouted):
                del self._hashes[job.call_id]
                if anon is not None:  # the agent knows the call by the router's session and index
                    job.routed_index = ev.call_index
                    anon.routed(job.call_id, job.session)
                self._measure_placement(job, ev.instance_id)
                job.kv_output_tokens = ev.kv_output_tokens
                job.kv_from = ev.kv_from
                out.extend(self.instances[ev.instance_id].submit(now, job) or ())
            elif isinstance(ev, CallFailed):
                self.counters.rejected += 1
                self._retries[job.call_id] = tries = self._retries.get(job.call_id, 0) + 1
                wait = self.config.retry.wait_s(tries, _retry_after(events))
                if wait is None:
                    self.counters.gave_up += 1  # the session stops here, incomplete
                    del self._hashes[job.call_id]
                    self._prompts.forget(job.session)
                    if anon is not None:
                        anon.gave_up(job.call_id, job.session)
                    continue
                self.counters.retries += 1
                out.append((now + wait, self._route, (job,)))
        self._repin(events, now)
        return out

    def _repin(self, events, now: float) -> None:
        """The router's hot-pool decisions (PoolPinned) reach their agents: live over NATS
        (agent_service.py), here at once."""
        for ev in events:
            if isinstance(ev, PoolPinned):
                self.instances[ev.instance_id].sched.repin(ev.model)
                self.counters.repins += 1
                rec = self._snap_rec[ev.instance_id]
                rec[3] = None  # its pool changed: a fresh snapshot, not a heartbeat re-send
                self._send_snapshot(rec, now)

    def _measure_placement(self, job: Job, chosen: str) -> None:
        c = self.counters
        c.routed += 1
        inst = self.instances[chosen]
        resident = inst.active == job.model or inst.switching_to == job.model
        if resident:
            c.model_residency_hits += 1
        else:
            c.model_opens_needed += 1
            if any(
                (i.active == job.model or i.switching_to == job.model)
                for iid, i in self.instances.items()
                if iid != chosen
            ):
                c.avoidable_cold_opens += 1
        if job.call_index > 0:
            c.returns += 1
            if self._last_instance.get(job.session) == chosen:
                c.same_instance_returns += 1
        self._last_instance[job.session] = chosen

    def _count(self, events) -> None:
        c = self.counters
        for ev in events:
            if isinstance(ev, LeaseIssued):
                c.leases_issued += 1
            elif isinstance(ev, LeaseConsumed):
                c.leases_consumed += 1
            elif isinstance(ev, LeaseDiscarded):
                c.leases_discarded += 1
            elif isinstance(ev, LeaseExpired):
                c.leases_expired += 1
            elif isinstance(ev, RoutingDecision):
                if ev.avoidable_cold_open:
                    c.policy_avoidable_cold_opens += 1

    # ---- instance sink ----------------------------------------------------------------

    def completed(self, job: Job, done: CallCompleted, now: float):
        """An instance finished `job`; `done` is its agent core's completion record."""
        self.jobs.append(job)
        if self.anonymous is not None:  # the router hears of it under the session it saw
            done = self.anonymous.answered(done, job.session, job.call_index, job.output, now)
        owner = self._owner(done.session_id)
        reactions = owner.handle(done, now)
        self._count(reactions)
        self._repin(reactions, now)
        later = self._tell_peers(owner, reactions, now, completion=done)
        rec = self._snap_rec[job.instance]
        if now - rec[1] >= self.config.snapshot_on_change_s:  # the agent's snapshot on change
            self._send_snapshot(rec, now)
        session = self._by_id[job.session]
        nxt = job.call_index + 1
        if nxt >= len(session.calls):
            self._prompts.forget(job.session)
            if self.anonymous is not None:
                self.anonymous.forget(job.session)
            return later or None
        gap = self.config.gaps.gap(session.calls[nxt])
        self.gaps_applied[(job.session, nxt)] = gap
        return [*later, (now + gap, self._release, (job.session, nxt))]

    # ---- telemetry --------------------------------------------------------------------

    def _refresh_snapshots(self, now: float) -> None:
        hb = self.config.heartbeat_s
        if now < self._snap_due:
            return  # no instance's snapshot is heartbeat_s old yet (the scan would send none)
        oldest = now
        for rec in self._snap_recs:
            if now - rec[1] < hb:
                if rec[1] < oldest:
                    oldest = rec[1]
            else:
                self._send_snapshot(rec, now)
        # earliest time a later scan can find a due instance (a lower bound: the exact test
        # `now - at >= hb` is still made per instance, so float rounding cannot skip one)
        self._snap_due = oldest + hb * (1.0 - 1e-9) if hb > 0 else float("-inf")

    def _send_snapshot(self, rec: list, now: float) -> None:
        inst = rec[0]
        ver = rec[2] = rec[2] + 1
        rec[1] = now
        # An instance whose state did not change re-sends its last snapshot with a new
        # version and time (a heartbeat); fields that drift with time alone
        # (round_remaining_s, staging progress) stay as of the last change.
        key = (inst.token, inst.kv.version, inst.sched.calls.seq, inst.staging.target, inst.busy)
        if rec[3] == key:
            snap = msgspec.structs.replace(rec[4], version=ver, at=now)
        else:
            snap = inst.snapshot(ver, now, self.config.heartbeat_s)
            if self.anonymous is not None:
                snap = self.anonymous.relabel(snap)
            rec[3] = key
        rec[4] = snap
        for router in self.routers:
            self._count(router.observe(snap, now))


def _retry_after(events) -> float | None:
    for ev in events:
        if isinstance(ev, RoutingDecision) and ev.retry_after_s:
            return ev.retry_after_s
    return None


def simulate(sessions: list[Session], config: RunConfig) -> RunResult:
    """Run one configuration to completion."""
    return Cluster(sessions, config).run()
