"""A simulated cold-pool instance: the executor state (device KV, HKVR, staging) shared by
both backends, and the built-in round scheduler of the `fast` CROSS-CHECK backend.

Reported numbers use the `services` backend (services_backend.py): the instance agent's
own RoundScheduler decides, this module's executor helpers only price and keep state.
The built-in scheduler below is an independent re-implementation of the paper's slot
structure kept only as a labelled cross-check (`--backend fast`); it is not the project's
policy and none of the report's tables come from it.

The `fast` cross-check scheduler: It follows the paper's
slot structure P -> D1 -> (SP -> D)* -> Dfin (§3.4) and the ablation flags of §5; the
`services` backend (talaria/sim/services_backend.py) drives the instance agent's own
RoundScheduler instead. Both share the KV/memory/staging executor defined here.

Semantics (what a reader needs to trust the numbers):

- One model's weights are on device at a time (the active model); switching releases the
  active model's device KV (its host copy survives only with HKVR) and opens the next
  model's weights along the path the staging state allows (profiles.ServerProfile.switch).
- A slot of model m: P prefills every call of m queued when the slot opens (FIFO, best
  effort: it may run past the budget, which is counted as deadline risk); then decode.
  At every decode boundary, if SP is on and the slot budget is not spent, queued
  *continuations* of m whose prefix is on device or in HKVR are admitted in arrival order
  while their predicted restore+prefill fits the remaining budget; the rest are parked
  (counted once per opportunity, like the paper's "handling events"). New sessions never
  enter through SP. When the budget is spent, decode drains in-flight calls (Dfin).
- Slot budget: (gamma * T_TTFT - predicted switches) / active models, floored at
  `min_slot_s` (Eq. 3, 5). The decode-share rule (Eq. 4) is not enforced separately:
  decodes are never preempted, so their cadence is the step time.
- Rotation: round-robin over models with queued work; a model with nothing queued and
  nothing in flight gives up its slot at once. Idle with nothing queued: the active model
  stays, and an arrival for it opens a slot without a switch.
- Staging (D2D): while a slot runs, the next model in rotation is pre-staged in the
  background at the H2D rate into the KV pool's free tail (pool less the slot's peak KV).
  At the switch, staged bytes move by D2D, the rest by H2D.
- Decode aggregation: one decode action covers k steps until the first completion in the
  batch, cut short at the next step boundary when an SP-eligible return arrives. The step
  time is fixed at the action's start (context growth within k steps is ignored).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from talaria.services.instance_agent.memory.hkvr_core import HkvrCore, LayoutDescriptor, RankReport
from talaria.services.instance_agent.memory.staging_plan import StagingPlanner

from talaria.shared.messages import SessionKv
from talaria.sim.profiles import ServerProfile


@dataclass(slots=True, eq=False)
class Job:
    """One call on its way through an instance. Times are virtual seconds."""

    call_id: str
    session: str
    model: str
    call_index: int
    prompt: int
    reusable: int
    output: int
    release_t: float  # intended enqueue (schedule-aware TTFT starts here)
    arrived_t: float = 0.0
    admitted_t: float = -1.0
    first_token_t: float = -1.0
    done_t: float = -1.0
    remaining: int = 0  # decode steps left
    ctx: int = 0  # tokens in KV while decoding
    kv_source: str = "none"
    via: str = ""
    instance: str = ""


@dataclass(frozen=True)
class InstanceFlags:
    """Per-instance settings. The `services` backend (the default, the one every reported
    number uses) turns them into the RoundScheduler's `SchedulerConfig`
    (services_backend.scheduler_config); the `fast` cross-check reads only the first six.
    """

    sp: bool = True
    hkvr: bool = True
    staging: bool = True
    gamma: float = 0.9  # [cal] App. E: admission margin gamma < 1 (0.9 [asm], the scheduler default)
    ttft_target_s: float = 10.0  # [cal] §2.4 sizes the round against "a 10 s TTFT budget"
    min_slot_s: float = 0.0  # [asm] no floor: Eq. 4 + slot fill size slots (scheduler default)
    max_batch: int = 64  # [asm] running calls per model (scheduler default)
    # [asm] Eq. 4 target: the paper publishes no T_TPOT; 0.2 s/token (5 tok/s while
    # time-shared with two other models) is the scheduler default, above the ~0.055 s sum of
    # the three models' decode steps, so Eq. 4 is feasible.
    tpot_target_s: float = 0.2
    sp_max_batch: int = 8  # [asm] bounded SP batch (§3.4 "bounded batch"; scheduler default)
    # [cal] §3.4: D_fin spends the remaining protected budget, then the device switches with
    # calls still in flight (their KV parked with the model); the torch engine cannot, so the
    # live agent keeps the scheduler default (True).
    drain_on_switch: bool = False
    fill_slot: bool = True  # [cal] §3.4: "the slot closes when the round budget is exhausted"
    max_decode_iters: int = 4096  # scheduler default
    max_decode_steps: int = 4096  # simulator speed: decode tokens per event (exact, see backend)

    @classmethod
    def ablation(cls, name: str, **kw) -> InstanceFlags:
        flags = {
            "talaria": (True, True, True),
            "no-sp": (False, True, True),
            "no-hkvr": (True, False, True),
            "h2d-only": (True, True, False),
            "round-only": (False, False, False),
        }
        try:
            sp, hkvr, staging = flags[name]
        except KeyError:
            raise KeyError(f"unknown configuration {name!r}; known: {', '.join(flags)}") from None
        return cls(sp=sp, hkvr=hkvr, staging=staging, **kw)


@dataclass
class SwitchRecord:
    instance: str
    from_model: str | None
    to_model: str
    path: str
    seconds: float
    start: float
    phases: dict[str, float]


@dataclass
class RoundRecord:
    instance: str
    index: int
    start: float
    wall_s: float = 0.0
    switch_s: float = 0.0
    slots: list[str] = field(default_factory=list)
    sp_admitted: int = 0
    sp_parked: int = 0


@dataclass
class Slot:
    model: str
    start: float
    deadline: float
    pqueue: list[Job]
    peak_kv_bytes: int = 0


# The simulated host KV registry is the instance agent's own bookkeeping (memory/hkvr_core.py),
# driven with synthetic page hashes: a session's prefix is unique to it, so page j of session s
# hashes to (s, j), cumulative by construction. Pages are coarser than the engine's (the
# simulator moves no bytes): a restore covers whole pages, the tail is recomputed. [asm]
SIM_PAGE_TOKENS = 512
STAGE_CHUNK_BYTES = 4 << 30  # staging chunk in the simulator: 4 GiB (the engine uses 256 KiB) [asm]


def _page_hash(session: str, index: int) -> int:
    return hash((session, index)) & ((1 << 63) - 1)


class _HostView:
    """`host.get((model, session))` / `host.items()` over the registry: published tokens only
    (both answered from the registry's own restorable-prefix index, no page walk)."""

    def __init__(self, core: HkvrCore) -> None:
        self.core = core
        core.changes = set()
        self._entries: dict[tuple[str, str], SessionKv] = {}
        self._list: list[SessionKv] | None = None

    def get(self, key: tuple[str, str], default: int = 0) -> int:
        model, session = key
        return self.core.session_tokens(session, model, SIM_PAGE_TOKENS) or default

    def items(self):
        return (((m, s), t) for s, m, t in self.core.session_prefixes(SIM_PAGE_TOKENS))

    def entries(self) -> list[SessionKv]:
        """Snapshot entries of every restorable session, kept current from the registry's
        change feed (only sessions whose restorable length changed are rebuilt)."""
        core, entries = self.core, self._entries
        if core.changes:
            for sid, model in core.changes:
                pre = core.sessions.get((sid, model))
                if pre is not None and pre.published:
                    entries[(model, sid)] = SessionKv(sid, model, "host", pre.published * SIM_PAGE_TOKENS)
                else:
                    entries.pop((model, sid), None)
            core.changes.clear()
            self._list = None
        if self._list is None:
            self._list = list(entries.values())
        return self._list


class KvStore:
    """Device KV of the active model (LRU by session, in tokens; calls in flight are never
    evicted) and the host KV registry: the real `HkvrCore`, one slot per page of the model
    with the largest pages, capacity = host bytes / slot bytes."""

    def __init__(self, server: ServerProfile) -> None:
        self.server = server
        self.device: OrderedDict[str, int] = OrderedDict()
        self.device_tokens = 0
        slot_bytes = max(m.kv_bytes_per_token for m in server.models.values()) * SIM_PAGE_TOKENS
        self.core = HkvrCore(max(1, server.host_bytes // slot_bytes), ranks=1)
        self.host = _HostView(self.core)
        self._page_hashes: dict[str, tuple[int, ...]] = {}
        self.device_evictions = 0
        self.version = 0  # bumped on every change; snapshots cache on it

    @property
    def host_evictions(self) -> int:
        return self.core.counters.evictions

    def clear_device(self) -> None:
        self.device.clear()
        self.device_tokens = 0
        self.version += 1

    def put_device(self, session: str, tokens: int, capacity: int, pinned: set[str]) -> None:
        old = self.device.pop(session, 0)
        self.device_tokens += tokens - old
        self.device[session] = tokens
        if self.device_tokens > capacity:
            for victim in list(self.device):
                if self.device_tokens <= capacity:
                    break
                if victim in pinned or victim == session:
                    continue
                self.device_tokens -= self.device.pop(victim)
                self.device_evictions += 1
        self.version += 1

    def put_host(self, model: str, session: str, tokens: int) -> None:
        """Checkpoint the session's committed pages (the D2H copy is charged no time here and
        completes at once; pages already held are shared, not copied again)."""
        pages = tokens // SIM_PAGE_TOKENS
        report = RankReport(0, pages * SIM_PAGE_TOKENS, self._hashes(session, pages))
        template = LayoutDescriptor(model, 0, 0, 0, SIM_PAGE_TOKENS, "bf16", "gqa", (SIM_PAGE_TOKENS,))
        plan = self.core.plan_save(model, session, [report], template)
        self.core.complete(plan.job_id)
        self.version += 1

    def _hashes(self, session: str, pages: int) -> tuple[int, ...]:
        """The session's first `pages` page hashes (a session only grows: cached, extended)."""
        have = self._page_hashes.get(session, ())
        if len(have) < pages:
            have = self._page_hashes[session] = have + tuple(_page_hash(session, j) for j in range(len(have), pages))
        return have[:pages]

    def touch_host(self, model: str, session: str) -> int:
        """A restore: pins, counts the hit and refreshes LRU order through the registry."""
        pages = self.core.session_tokens(session, model, SIM_PAGE_TOKENS) // SIM_PAGE_TOKENS
        plan = self.core.begin_restore(model, self._hashes(session, pages))
        self.core.end_restore(plan)
        return len(plan.hashes) * SIM_PAGE_TOKENS


class SimInstance:
    """One instance (GPU group). Handlers return the events they cause (see engine.py)."""

    def __init__(self, instance_id: str, server: ServerProfile, flags: InstanceFlags, sink) -> None:
        self.id = instance_id
        self.server = server
        self.flags = flags
        self.sink = sink  # .first_token(job, t), .completed(job, t) -> events
        self.models = list(server.models)
        self.pending: dict[str, list[Job]] = {m: [] for m in self.models}
        self.active: str | None = None
        self.slot: Slot | None = None
        # Calls mid-decode, per model. A slot that closes parks its model's list (KV kept
        # with the model's parked pool, paper §4.2 P1/P3); they resume in its next slot.
        self.inflight: dict[str, list[Job]] = {m: [] for m in self.models}
        self.kv = KvStore(server)
        self.busy = False
        self.token = 0  # stale-event guard for the running action
        self.seg: tuple[float, float, int] | None = None  # (start, step_s, k) of a decode action
        self.stage_target: str | None = None
        self.stage_start = 0.0
        self.planner = StagingPlanner(STAGE_CHUNK_BYTES)
        self._stage_key: tuple | None = None
        self._stage_written = 0
        self._stage_memo: tuple = (None, 0)
        self.switching_to: str | None = None
        self.switches: list[SwitchRecord] = []
        self.rounds: list[RoundRecord] = []
        self._round_models: set[str] = set()
        self.busy_since = 0.0
        self.sp_admitted = 0
        self.sp_parked = 0
        self.deadline_risk = 0
        self.hbm_peak_bytes = 0
        self.queued_tokens = 0
        self.opens = 0

    # ---- inputs -----------------------------------------------------------------------

    def submit(self, now: float, job: Job):
        job.arrived_t = now
        job.instance = self.id
        self.pending[job.model].append(job)
        self.queued_tokens += job.prompt
        if not self.busy:
            return self._next(now)
        if self.seg is not None and self._sp_eligible(job, now):
            return self._cut_segment(now)
        return None

    # ---- the decision loop ------------------------------------------------------------

    def _next(self, now: float):
        """Pick and start the next action; returns its completion event (or nothing: idle)."""
        while True:
            slot = self.slot
            if slot is None:
                model = self._pick_model()
                if model is None:
                    self.busy = False
                    self._idle_since = now
                    return None
                if model != self.active:
                    return self._start_switch(now, model)
                self._open_slot(now, model)
                continue
            self._update_staging_target(now)
            if slot.pqueue:
                return self._start_prefill(now, slot.pqueue.pop(0))
            open_ = now < slot.deadline or not self._other_work(slot.model)
            if open_ and self.flags.sp:
                self._sp_admit(now, slot)
                if slot.pqueue:
                    continue
            if open_ and self.inflight[slot.model]:
                return self._start_decode(now)
            self._close_slot(now)

    def _has_work(self, model: str) -> bool:
        return bool(self.pending[model] or self.inflight[model])

    def _other_work(self, model: str) -> bool:
        return any(self._has_work(m) for m in self.models if m != model)

    def _pick_model(self) -> str | None:
        """Round-robin: the first model after the active one (cyclically) with work."""
        n = len(self.models)
        start = self.models.index(self.active) + 1 if self.active in self.pending else 0
        for i in range(n):
            m = self.models[(start + i) % n]
            if self._has_work(m):
                return m
        return None

    def _active_models(self) -> int:
        return max(1, sum(1 for m in self.models if self._has_work(m)))

    def _open_slot(self, now: float, model: str) -> None:
        n = self._active_models()
        switch_guess = self.server.switch(model, 0)[1] if n > 1 else 0.0
        budget = max(self.flags.min_slot_s, (self.flags.gamma * self.flags.ttft_target_s - n * switch_guess) / n)
        queue = self.pending[model]
        self.pending[model] = []
        for job in queue:
            job.via = "P"
        self.slot = Slot(model, now, now + budget, queue)
        self._mark_busy(now)
        if model in self._round_models or not self.rounds:
            self._round_models = set()
            if self.rounds:
                self.rounds[-1].wall_s = now - self.rounds[-1].start - self._idle_in_round
            self.rounds.append(RoundRecord(self.id, len(self.rounds), now))
            self._idle_in_round = 0.0
        self._round_models.add(model)
        self.rounds[-1].slots.append(model)

    def _close_slot(self, now: float) -> None:
        slot = self.slot
        assert slot is not None and not slot.pqueue
        self._last_peak_kv = slot.peak_kv_bytes
        self.slot = None

    def _mark_busy(self, now: float) -> None:
        if not self.busy:
            self.busy = True
            if self.rounds:
                self._idle_in_round += max(0.0, now - self._idle_since)

    # ---- switch -----------------------------------------------------------------------

    def _update_staging_target(self, now: float) -> None:
        """Stage the model the rotation will open next; restart if that prediction changes."""
        if not self.flags.staging or self.slot is None:
            return
        n = len(self.models)
        start = self.models.index(self.slot.model) + 1
        target = None
        for i in range(n - 1):
            m = self.models[(start + i) % n]
            if self._has_work(m):
                target = m
                break
        if target != self.stage_target:
            self.stage_target, self.stage_start = target, now

    def _staged_bytes(self, now: float, model: str) -> int:
        """Clean staged bytes of `model` by `now`, from the agent's own `StagingPlanner`: chunks
        placed from the top of the KV pool downward, written at host-to-device bandwidth while
        their slot is above the KV high-water mark, dirtied when KV grows over them."""
        if not self.flags.staging or self.stage_target != model or self.active is None:
            return 0
        planner = self.planner
        w = self.server.model(model).weight_bytes
        peak = self.slot.peak_kv_bytes if self.slot is not None else self._last_peak_kv
        streamed = int(self.server.h2d_bytes_s * max(0.0, now - self.stage_start) // STAGE_CHUNK_BYTES)
        memo = (model, self.active, self.stage_start, peak, streamed)
        if memo == self._stage_memo[0]:
            return self._stage_memo[1]  # nothing the planner sees has changed since the last ask
        if planner.target != model or self._stage_key != (self.active, self.stage_start):
            planner.plan(model, w, 0, self.server.kv_pool_bytes(self.active))
            self._stage_key, self._stage_written = (self.active, self.stage_start), 0
        planner.on_kv_alloc(0, peak)  # KV pages handed out over staged slots
        # lazily: the writes the bandwidth allowed by `now`, all complete by now
        self._stage_written += planner.write_through(lambda lo, hi: lo >= peak, max(0, streamed - self._stage_written))
        staged = planner.staged_bytes()  # == gather_plan(model, w).staged_bytes: no write in flight
        self._stage_memo = (memo, staged)
        return staged

    def _start_switch(self, now: float, model: str):
        self._mark_busy(now)
        staged = self._staged_bytes(now, model)
        path, seconds, phases = self.server.switch(model, staged)
        self.switches.append(SwitchRecord(self.id, self.active, model, path, seconds, now, phases))
        if self.rounds:
            self.rounds[-1].switch_s += seconds
        self.opens += 1
        # The outgoing model's KV region is released; HKVR already holds checkpoints
        # (taken at each completion), so only the device copy goes.
        self.kv.clear_device()
        self.active = None
        self.switching_to = model
        self.stage_target = None
        self._hbm(self.server.model(model).weight_bytes)
        self.token += 1
        return [(now + seconds, self._switch_done, (self.token, model))]

    def _switch_done(self, now: float, token: int, model: str):
        if token != self.token:
            return None
        self.active = model
        self.switching_to = None
        self._last_peak_kv = 0
        self._open_slot(now, model)
        return self._next(now)

    # ---- prefill ----------------------------------------------------------------------

    def _kv_for(self, job: Job) -> tuple[str, int]:
        """(source, reusable tokens available) for `job` on this instance right now."""
        if job.reusable <= 0:
            return "none", 0
        if self.active == job.model:
            dev = self.kv.device.get(job.session, 0)
            if dev:
                return "device", min(job.reusable, dev)
        if self.flags.hkvr:
            host = self.kv.host.get((job.model, job.session), 0)
            if host:
                return "host", min(job.reusable, host)
        return "recompute", 0

    def _prefill_cost(self, job: Job) -> tuple[float, str, int]:
        source, avail = self._kv_for(job)
        mp = self.server.model(job.model)
        seconds = mp.prefill_s(max(1, job.prompt - avail), avail)
        if source == "host":
            seconds += self.server.restore_s(job.model, avail)
        return seconds, source, avail

    def _sp_eligible(self, job: Job, now: float) -> bool:
        slot = self.slot
        return (
            self.flags.sp
            and slot is not None
            and job.model == slot.model
            and (now < slot.deadline or not self._other_work(slot.model))
            and job.call_index > 0
            and self._kv_for(job)[0] in ("device", "host")
        )

    def _sp_admit(self, now: float, slot: Slot) -> None:
        eligible = [j for j in self.pending[slot.model] if self._sp_eligible(j, now)]
        if not eligible:
            return
        remaining = slot.deadline - now
        admitted: list[Job] = []
        for job in eligible:
            cost = self._prefill_cost(job)[0]
            if cost <= remaining:
                remaining -= cost
                admitted.append(job)
        parked = len(eligible) - len(admitted)
        self.sp_admitted += len(admitted)
        self.sp_parked += parked
        if self.rounds:
            self.rounds[-1].sp_admitted += len(admitted)
            self.rounds[-1].sp_parked += parked
        if admitted:
            ids = {id(j) for j in admitted}
            self.pending[slot.model] = [j for j in self.pending[slot.model] if id(j) not in ids]
            for job in admitted:
                job.via = "SP"
            slot.pqueue.extend(admitted)

    def _start_prefill(self, now: float, job: Job):
        seconds, source, avail = self._prefill_cost(job)
        job.admitted_t = now
        job.kv_source = source
        self.queued_tokens -= job.prompt
        if job.via == "P" and self.slot is not None and now + seconds > self.slot.deadline:
            self.deadline_risk += 1
        if source == "host":
            self.kv.touch_host(job.model, job.session)
        self.token += 1
        return [(now + seconds, self._prefill_done, (self.token, job))]

    def _prefill_done(self, now: float, token: int, job: Job):
        if token != self.token:
            return None
        job.first_token_t = now
        job.ctx = job.prompt + 1
        job.remaining = job.output - 1
        self._put_device(now, job.session, job.ctx)
        out = list(self.sink.first_token(job, now) or ())
        if job.remaining <= 0:
            out.extend(self._complete(now, job) or ())
        else:
            self.inflight[job.model].append(job)
        nxt = self._next(now)
        if nxt:
            out.extend(nxt)
        return out

    # ---- decode -----------------------------------------------------------------------

    def _start_decode(self, now: float):
        slot = self.slot
        batch = self.inflight[slot.model][: self.flags.max_batch]
        mp = self.server.model(slot.model)
        step = mp.decode_step_s(len(batch), sum(j.ctx for j in batch))
        k = min(j.remaining for j in batch)
        if now < slot.deadline and self._other_work(slot.model):
            # the slot closes at the first decode boundary at or after its deadline
            k = min(k, max(1, math.ceil((slot.deadline - now) / step - 1e-9)))
        if self.flags.sp and any(self._sp_eligible(j, now) for j in self.pending[slot.model]):
            k = 1  # an SP opportunity is waiting at the next decode boundary
        self.seg = (now, step, k)
        self.token += 1
        return [(now + k * step, self._decode_done, (self.token, k))]

    def _cut_segment(self, now: float):
        start, step, k = self.seg
        done = max(1, math.ceil((now - start) / step - 1e-9))
        if done >= k:
            return None
        self.seg = (start, step, done)
        self.token += 1
        return [(start + done * step, self._decode_done, (self.token, done))]

    def _decode_done(self, now: float, token: int, k: int):
        if token != self.token:
            return None
        self.seg = None
        model = self.slot.model
        batch = self.inflight[model][: self.flags.max_batch]
        out: list = []
        still: list[Job] = []
        for job in batch:
            job.remaining -= k
            job.ctx += k
            if job.remaining <= 0:
                out.extend(self._complete(now, job) or ())
            else:
                still.append(job)
        self.inflight[model] = still + self.inflight[model][self.flags.max_batch :]
        for job in still:
            self.kv.device[job.session] = job.ctx
        self.kv.device_tokens += k * len(still)
        nxt = self._next(now)
        if nxt:
            out.extend(nxt)
        return out

    def _complete(self, now: float, job: Job):
        job.done_t = now
        tokens = job.prompt + job.output
        self._put_device(now, job.session, tokens)
        if self.flags.hkvr:
            self.kv.put_host(job.model, job.session, tokens)
        return self.sink.completed(job, now)

    # ---- memory -----------------------------------------------------------------------

    def _put_device(self, now: float, session: str, tokens: int) -> None:
        model = self.active
        if model is None:
            return
        mp = self.server.model(model)
        capacity = self.server.kv_pool_bytes(model) // mp.kv_bytes_per_token
        self.kv.put_device(session, tokens, capacity, {j.session for j in self.inflight[model]})
        used = self.kv.device_tokens * mp.kv_bytes_per_token
        if self.slot is not None and used > self.slot.peak_kv_bytes:
            self.slot.peak_kv_bytes = used
        elif self.slot is None and used > self._last_peak_kv:
            self._last_peak_kv = used  # services backend: peak since the last switch
        staged = self._staged_bytes(now, self.stage_target) if self.stage_target else 0
        self._hbm(mp.weight_bytes + used + staged)

    def _hbm(self, used: int) -> None:
        if used > self.hbm_peak_bytes:
            self.hbm_peak_bytes = used

    # ---- lifecycle helpers --------------------------------------------------------------

    _idle_since = 0.0
    _idle_in_round = 0.0
    _last_peak_kv = 0

    def round_remaining_s(self, now: float) -> float:
        return max(0.0, self.slot.deadline - now) if self.slot else 0.0

    def settle(self, now: float) -> None:
        """Close the books at the end of a run (last round's wall time)."""
        if self.rounds and self.rounds[-1].wall_s == 0.0:
            self.rounds[-1].wall_s = max(0.0, now - self.rounds[-1].start - self._idle_in_round)
