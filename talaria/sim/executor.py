"""The simulator's executor of the agent core: a cost profile on a virtual clock.

The live agent's `CallRunner` runs `AgentCore` actions on the torch engine; `SimExecutor`
runs the same core's actions by pricing them with the server profile. The core decides
everything an instance decides and writes the records; this module only prices each action,
keeps the device KV / HKVR / staging state (memory.py) and reports completions back. How
multi-step decode and paper-mode switches are priced is `SimExecutor`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from talaria.services import configs

from talaria.services.instance_agent.agent_core import AgentCore, StepReport
from talaria.services.instance_agent.memory.parked_kv import ParkedKv, Unparked, parking_room, staging_reserve
from talaria.services.instance_agent.scheduler import Decode, Idle, Prefill, SchedulerConfig, SwitchModel
from talaria.services.instance_agent.scheduler.costs import decode_steps_s, first_step_reaching
from talaria.shared.events import RoundSummary, SwitchDone
from talaria.shared.snapshots import InstanceSnapshot
from talaria.sim.device_view import DeviceView
from talaria.sim.memory import KvStore, StagingState
from talaria.sim.profiles import ProfileCosts, ServerProfile


# A full engine reload over a host-memory wake: vLLM sleep-mode wakes are 18-200x faster than
# a reload of 30-100+ s (blog.vllm.ai/2025/10/26/sleep-mode.html); the least ratio, which
# favours an engine that reloads (SchedulerConfig.weights_in_host off).
RELOAD_OVER_WAKE = 18.0


def instance_config(name: str = "talaria", **overrides) -> SchedulerConfig:
    """A simulated instance's scheduler under paper ablation `name` (shared/ablations.py): its
    configuration's scheduler as the simulator runs it (services/configs.py, SIM_DIFFERS:
    the paper's resumable switches), with `overrides`."""
    return replace(configs.get(configs.ablation_name(name)).sim_scheduler(), **overrides)


@dataclass(frozen=True, slots=True)
class LoggedAction:
    """One executed action: its calls, times, the weight/KV transfer seconds in it (switch:
    everything but the fixed phases P1, P3-P5; prefill: host KV restores) and the calls it
    finished."""

    call_ids: tuple[str, ...]
    start: float
    end: float
    transfer_s: float
    finished: tuple[str, ...]


@dataclass(slots=True, eq=False)
class Job:
    """One call on its way through an instance. Times are virtual seconds."""

    call_id: str
    session: str
    model: str
    call_index: int
    prompt: int
    reusable: int
    output: int  # true output length: only the executor knows it (the engine's EOS)
    release_t: float  # intended enqueue (schedule-aware TTFT starts here)
    max_tokens: int = 0  # the client's cap, what the router and the scheduler see (0: output)
    kv_output_tokens: int = 0  # the router's KV estimate of its output (CallRouted)
    routed_index: int = -1  # the router's call index when it saw another session (anonymous_sessions.py)
    first_token_t: float = -1.0
    done_t: float = -1.0
    remaining: int = 0  # decode steps left
    ctx: int = 0  # tokens in KV while decoding
    kv_source: str = "none"
    via: str = ""
    instance: str = ""
    shared: int = 0  # leading prompt tokens every session of the model shares (system prompt + tools)
    cached: int = 0  # prompt tokens its prefill found cached (own KV or the shared prefix)
    prefill_s: float = 0.0  # time of the prefill actions it was in (the live engine's measure)
    decode_s: float = 0.0  # time of the decode steps it was in
    kv_from: str = ""  # the instance the router priced pulling its pages from (CallRouted.kv_from)
    migrated_bytes: int = 0  # what the pull moved (kv_source "migrated")
    migrate_s: float = 0.0


class SimExecutor:
    """One simulated instance (GPU group). Handlers return the events they cause (event_loop.py);
    `sink.completed(job, CallCompleted, now)` hears of every finished call.

    Speed: decode runs as multi-step actions (`next_action(now, max_decode_steps=K)`); the
    scheduler cuts each at the next boundary it would act on. When a call is submitted while
    a multi-step decode runs, the executor stops that decode at the first step boundary at or
    after the submission and reports the steps it ran, so the schedule equals one-token-at-a-time
    stepping (tests/unit/scheduler/test_sched_multistep.py). A k-step decode costs the sum of
    its k step times (`decode_steps_s`: exact for the profile's decode cost, linear in context).

    Paper-mode switches (`drain_on_switch=False`, paper §3.4: D_fin spends the remaining
    protected budget, then the device switches with calls still running): running calls of
    the outgoing model keep their KV parked (§4.2). With `park_kv` (every configuration but
    round-only) it stays on device while HBM has room (the agent's own `ParkedKv` planner,
    memory/parked_kv.py), moved out of the incoming weights' way and back into the pool at the
    D2D rate; what the planner offloads under pressure (or all of it, without `park_kv`) is
    restored at the KV restore bandwidth when the model's slot comes back, and the time is
    added to the switch that reopens the model [asm].
    """

    def __init__(self, instance_id: str, server: ServerProfile, config: SchedulerConfig, sink,
                 max_decode_steps: int = 4096, view: DeviceView | None = None) -> None:
        self.id = instance_id
        self.server = server
        self.config = config
        self.sink = sink
        self.models = list(server.models)
        self.core = AgentCore(instance_id, config, self.models, ProfileCosts(server))
        self.sched = self.core.sched
        self.view = view or DeviceView(server)
        self.max_steps = max(1, max_decode_steps)
        # a hot-pool instance is deployed with its model loaded (it never switches)
        self.active: str | None = config.pinned_model if config.pool == "hot" else config.initial_model
        self.switching_to: str | None = None
        # Calls mid-decode, per model. A model switched away from parks its list (KV kept
        # with the model's parked pool, paper §4.2 P1/P3); they resume in its next slot.
        self.inflight: dict[str, list[Job]] = {m: [] for m in self.models}
        self.jobs: dict[str, Job] = {}
        self.kv = KvStore(server)
        self.staging = StagingState(server)
        self.parked = ParkedKv()  # running calls' KV of switched-out models kept on device
        self._weights = {n: m.weight_bytes for n, m in server.models.items()}
        self.log: list[LoggedAction] | None = None  # executed actions, when a caller asks
        self._transfer_s = 0.0  # weight/KV transfer seconds inside the running prefill
        self.busy = False
        self.steps = 0  # decode steps the running Decode will run (<= its steps: a call's EOS)
        self.token = 0  # stale-event guard for the running action
        self.action = None
        self.action_start = 0.0
        self._switch_cost: tuple[str, float, dict[str, float]] = ("", 0.0, {})
        self.switches: list[SwitchDone] = []
        self.rounds: list[RoundSummary] = []
        self.hbm_peak_bytes = 0
        self.last_peak_kv = 0  # KV high-water mark (bytes) since the last switch
        self.peers: dict[str, SimExecutor] = {}  # the cluster's instances: page holders to pull from

    def snapshot(self, version: int, now: float, heartbeat_s: float) -> InstanceSnapshot:
        return self.view.snapshot(self, version, now, heartbeat_s)

    # ---- inputs -----------------------------------------------------------------------

    def submit(self, now: float, job: Job):
        job.instance = self.id
        source, avail = self._kv_for(job)
        index = job.call_index if job.routed_index < 0 else job.routed_index
        self.core.accept(job.call_id, job.session, job.model, call_index=index, prompt_tokens=job.prompt,
                         max_tokens=max(job.max_tokens, job.output), submitted_at=job.release_t,
                         kv_state=source if source in ("device", "host") else "none", reusable_tokens=avail,
                         now=now, arrived_at=now, kv_output_tokens=job.kv_output_tokens)
        self.jobs[job.call_id] = job
        if not self.busy:
            return self._drive(now)
        if isinstance(self.action, Decode) and self.action.steps > 1:
            return self._cut(now)
        return None

    # ---- the driving loop -------------------------------------------------------------

    def _drive(self, now: float):
        action = self.core.next_action(now, self.max_steps)
        self.action = action
        self.action_start = now
        self.token += 1
        if isinstance(action, Idle):
            self.busy = False
            self._record(self.core.drain(now), now)
            if action.until is not None and action.until > now:
                return [(action.until, self._wake, (self.token,))]
            return None
        self.busy = True
        if isinstance(action, SwitchModel):
            return self._switch(now, action)
        if isinstance(action, Prefill):
            return self._prefill(now, action)
        assert isinstance(action, Decode)
        # The scheduler plans to max_tokens (a cap); a call that ends earlier (its EOS, known
        # only here) ends the multi-step decode at that step, as one-token stepping would.
        self.steps = min(action.steps, min(self.jobs[c].remaining for c in action.call_ids))
        if self.steps < action.steps:
            return [(now + self._decode_s(action, self.steps), self._done, (self.token, self.steps))]
        return [(now + self._decode_s(action, action.steps), self._done, (self.token, None))]

    def _decode_s(self, action: Decode, steps: int) -> float:
        calls = [self.jobs[c] for c in action.call_ids]
        mp = self.server.model(action.model)
        return decode_steps_s(mp.decode_step_s, len(calls), sum(j.ctx for j in calls), steps)

    def _cut(self, now: float):
        """Stop the running multi-step decode at the first step boundary at or after `now`."""
        action = self.action
        j = first_step_reaching(lambda k: self._decode_s(action, k), now - self.action_start, self.steps)
        if j >= self.steps:
            return None
        self.token += 1
        return [(self.action_start + self._decode_s(action, j), self._done, (self.token, j))]

    def _wake(self, now: float, token: int):
        if token != self.token or self.busy:
            return None
        return self._drive(now)

    def _switch(self, now: float, action: SwitchModel):
        model = action.to_model
        staged = self.staged_bytes(now, model) if action.staged else 0
        path, seconds, phases = self.server.switch(model, staged)
        if not self.config.weights_in_host:  # a full reload, not a wake (RELOAD_OVER_WAKE)
            path, seconds = "cold", seconds * RELOAD_OVER_WAKE
            phases = {k: v * RELOAD_OVER_WAKE for k, v in phases.items()}
        kv_phases = {k: v for k, v in self._switch_kv(model).items() if v > 0}
        phases = {**phases, **kv_phases}
        seconds += sum(kv_phases.values())
        self._switch_cost = (path, seconds, phases)
        if self.active is not None:
            for session in list(self.kv.device):
                host = self.kv.host.get((self.active, session), 0) if self.config.hkvr else 0
                self.sched.update_kv(session, self.active, "host" if host else "none", host)
        self.kv.clear_device()
        self.active, self.switching_to, self.staging.target = None, model, None
        self._hbm(self.server.model(model).weight_bytes + self.parked.bytes)
        return [(now + seconds, self._done, (self.token, None))]

    def _switch_kv(self, model: str) -> dict[str, float]:
        """KV phases of a switch to `model` (paper mode: calls run across switches). Its
        running calls get their KV back: D2D from the parked region, or restored from host
        (offloaded, or `park_kv` off). The outgoing model's running calls are parked
        (memory/parked_kv.py): kept on device within the room HBM accounting leaves, D2D."""
        d2d = self.server.d2d_bytes_s
        mp = self.server.model(model)
        back = self.parked.unpark(model) if self.config.park_kv else Unparked()
        on_dev = sum(back.device.get(j.session, 0) for j in self.inflight[model])
        restore = sum(j.ctx for j in self.inflight[model] if j.session not in back.device)
        park_s = 0.0
        out = self.active
        if self.config.park_kv and out is not None and self.inflight[out]:
            bpt = self.server.model(out).kv_bytes_per_token
            moving = {j.session: j.ctx * bpt for j in self.inflight[out]}
            own = sum(j.ctx for j in self.inflight[model]) * mp.kv_bytes_per_token
            self.parked.park(out, moving, parking_room(self.server.kv_pool_bytes(model), own, self._reserve(model)))
            park_s = sum(self.parked.on_device(out, s) for s in moving) / d2d
        return {"kv_park": park_s, "kv_unpark": on_dev / d2d,
                "kv_resume": self.server.restore_s(model, restore) if restore else 0.0}

    def _reserve(self, model: str) -> int:
        """Staging reserve while `model` is active: the largest weights the rotation may stage."""
        return staging_reserve(self._weights, model, self.config.staging)

    def _fit_parked(self) -> None:
        """The active model's KV grew: offload parked KV (oldest first) it would overrun."""
        if self.parked.bytes and self.active is not None:
            used = self.kv.device_tokens * self.server.model(self.active).kv_bytes_per_token
            self.parked.fit(parking_room(self.server.kv_pool_bytes(self.active), used, self._reserve(self.active)))

    def _prefill(self, now: float, action: Prefill):
        seconds, self._transfer_s = 0.0, 0.0
        for cid in action.call_ids:
            job = self.jobs[cid]
            cost, job.kv_source, avail = self._prefill_cost(job)
            job.cached = avail
            if job.kv_source == "host":
                self.kv.touch_host(job.model, job.session)
                self._transfer_s += self.server.restore_s(job.model, avail)
            elif job.kv_source == "migrated":
                job.migrate_s = self.server.migrate_s(job.model, avail)
                job.migrated_bytes = avail * self.server.model(job.model).kv_bytes_per_token
                self._transfer_s += job.migrate_s
            seconds += cost
        return [(now + seconds, self._done, (self.token, None))]

    def _done(self, now: float, token: int, steps: int | None):
        if token != self.token:
            return None
        action = self.action
        if isinstance(action, SwitchModel):
            self.active, self.switching_to = action.to_model, None
            self.last_peak_kv = 0
            for job in self.inflight[self.active]:
                self._put_device(now, job.session, job.ctx)
            path, seconds, phases = self._switch_cost
            # the virtual clock is the scheduler's measurement, as the wall clock is live
            outcome = self.core.switch_done(action, now, seconds, path=path, phases=phases, clock_measured=True)
        elif isinstance(action, Prefill):
            finished = []
            for cid in action.call_ids:
                job = self.jobs[cid]
                job.prefill_s += now - self.action_start
                job.first_token_t = now
                job.ctx = job.prompt + 1
                job.remaining = job.output - 1
                self._put_device(now, job.session, job.ctx)
                if job.remaining <= 0:
                    finished.append(cid)
                else:
                    self.inflight[job.model].append(job)
            outcome = self.core.prefill_done(action, now, finished)
        else:
            k = action.steps if steps is None else steps
            finished = []
            for cid in action.call_ids:
                job = self.jobs[cid]
                job.decode_s += now - self.action_start
                job.remaining -= k
                job.ctx += k
                self.kv.device[job.session] = job.ctx
                if job.remaining <= 0:
                    finished.append(cid)
            self.kv.device_tokens += k * len(action.call_ids)
            self.kv.version += 1
            self._fit_parked()
            outcome = self.core.decode_done(action, now, finished, k)
        if self.log is not None:  # for the schedule bound (schedule_bound.py)
            self.log.append(self._logged(action, now, outcome.finished))
        out = self._record(outcome, now)
        self._update_staging(now)
        out.extend(self._drive(now) or ())
        return out

    def _logged(self, action, now: float, finished) -> LoggedAction:
        if isinstance(action, SwitchModel):
            fixed = sum(v for k, v in self._switch_cost[2].items() if k in ("P1", "P3", "P4", "P5"))
            transfer = max(0.0, now - self.action_start - fixed)
        else:
            transfer = self._transfer_s if isinstance(action, Prefill) else 0.0
        calls = () if isinstance(action, SwitchModel) else tuple(action.call_ids)
        return LoggedAction(calls, self.action_start, now, transfer, tuple(finished))

    def _record(self, outcome: StepReport, now: float) -> list:
        """Keep the core's records; complete finished calls (their sink events return)."""
        if outcome.switch is not None:
            self.switches.append(outcome.switch)
        self.rounds.extend(outcome.rounds)
        out: list = []
        for cid in outcome.finished:
            job = self.jobs.pop(cid)
            running = self.inflight[job.model]
            if job in running:
                running.remove(job)
            out.extend(self._complete(now, job) or ())
        return out

    def _complete(self, now: float, job: Job):
        job.done_t = now
        tokens = job.prompt + job.output
        if not self.config.keep_kv:  # the call's KV is freed now (SchedulerConfig.keep_kv)
            self.kv.drop_device(job.session)
        else:
            self._put_device(now, job.session, tokens)
            if self.config.hkvr:
                self.kv.put_host(job.model, job.session, tokens)
        job.via = self.core.calls[job.call_id].via
        cached = job.cached if job.kv_source in ("device", "host", "migrated") else 0
        # Measured as the live engine measures them: every call of a batched prefill or decode
        # step is charged the step's time, so the router's per-model rates are learned.
        done = self.core.completed(job.call_id, now, prompt_tokens=job.prompt, output_tokens=job.output,
                                   finish_reason="length" if job.output >= job.max_tokens else "stop", cached_tokens=cached, kv_source=job.kv_source,
                                   prefill_s=job.prefill_s, decode_s=job.decode_s,
                                   migrated_bytes=job.migrated_bytes, migrate_s=job.migrate_s)
        self.core.end(job.call_id)
        return self.sink.completed(job, done, now)

    def _update_staging(self, now: float) -> None:
        """Stage the model the scheduler's rotation opens next (if staging is on)."""
        if not self.config.staging or self.active is None:
            return
        if not self.sched.calls.any_active_except(self.active):
            target = None  # O(1) common case: nothing of another model waits
        else:
            target = next((m for m in self.sched.active_in_rotation(self.active) if m != self.active), None)
        self.staging.retarget(target, now)

    # ---- prefill pricing ----------------------------------------------------------------

    def _kv_for(self, job: Job) -> tuple[str, int]:
        """(source, reusable tokens available) for `job` on this instance right now: its
        session's own KV, or the prefix every session of its model shares when any of them
        has KV on device here (the engine's prefix cache holds those blocks once; the
        simulator counts each session's KV in full [asm]), whichever covers more."""
        source, avail = self._own_kv(job)
        if job.shared > avail and self.active == job.model and self.kv.device_tokens > 0:
            return "device", job.shared
        return source, avail

    def _own_kv(self, job: Job) -> tuple[str, int]:
        if job.reusable <= 0:
            return "none", 0
        if self.active == job.model:
            dev = self.kv.device.get(job.session, 0)
            if dev:
                return "device", min(job.reusable, dev)
        if self.config.hkvr:
            host = self.kv.host.get((job.model, job.session), 0)
            if host:
                return "host", min(job.reusable, host)
        holder = self.peers.get(job.kv_from) if self.config.migrate and job.kv_from else None
        if holder is not None:  # the pages the router priced pulling: still there when the prefill starts?
            held = holder.pages_of(job.model, job.session)
            if held:
                return "migrated", min(job.reusable, held)
        return "recompute", 0

    def pages_of(self, model: str, session: str) -> int:
        """Tokens of `session`'s KV this instance can serve a peer: on device or in its host registry."""
        dev = self.kv.device.get(session, 0) if self.active == model else 0
        host = self.kv.host.get((model, session), 0) if self.config.hkvr else 0
        return max(dev, host)

    def _prefill_cost(self, job: Job) -> tuple[float, str, int]:
        source, avail = self._kv_for(job)
        mp = self.server.model(job.model)
        seconds = mp.prefill_s(max(1, job.prompt - avail), avail)
        if source == "host":
            seconds += self.server.restore_s(job.model, avail)
        elif source == "migrated":
            seconds += self.server.migrate_s(job.model, avail)
        return seconds, source, avail

    # ---- memory -----------------------------------------------------------------------

    def staged_bytes(self, now: float, model: str) -> int:
        if not self.config.staging:
            return 0
        return self.staging.staged_bytes(now, model, self.active, self.last_peak_kv)

    def _put_device(self, now: float, session: str, tokens: int) -> None:
        model = self.active
        if model is None:
            return
        mp = self.server.model(model)
        capacity = self.server.kv_pool_bytes(model) // mp.kv_bytes_per_token
        self.kv.put_device(session, tokens, capacity, {j.session for j in self.inflight[model]})
        self._fit_parked()
        used = self.kv.device_tokens * mp.kv_bytes_per_token
        if used > self.last_peak_kv:
            self.last_peak_kv = used
        target = self.staging.target
        staged = self.staged_bytes(now, target) if target else 0
        self._hbm(mp.weight_bytes + used + staged + self.parked.bytes)

    def _hbm(self, used: int) -> None:
        if used > self.hbm_peak_bytes:
            self.hbm_peak_bytes = used
