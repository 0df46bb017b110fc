"""The `services` instance backend (the default): the instance agent's own RoundScheduler.

`talaria.services.instance_agent.scheduler.RoundScheduler` decides everything an instance decides
(which model, which calls, P or SP, how long a slot decodes, when to switch); this
executor only prices each action with the profile, keeps the device KV / HKVR / staging
state (the `SimInstance` executor helpers), and reports back through `on_*_done`.

Speed: decode runs as multi-step actions (`next_action(now, max_decode_steps=K)`); the
scheduler cuts each at the next boundary it would act on (a call reaching max_tokens,
protected-decode end, the slot's time budget, a pending SP retry). When a call is
submitted while a multi-step decode runs, the executor stops that decode at the first
step boundary at or after the submission and reports the steps it ran, so the schedule
equals one-token-at-a-time stepping (tests/unit/scheduler/test_sched_multistep.py).
A k-step decode costs the sum of its k step times (exact for the profile's decode cost,
which is linear in context: k steps at the mean context).

Paper-mode switches (`drain_on_switch=False`, paper §3.4: D_fin spends the remaining
protected budget, then the device switches with calls still running): running calls of
the outgoing model keep their KV off-device (§4.2: the outgoing model's KV pool and radix
tree are parked); when their model's slot comes back, that KV is restored at the KV
restore bandwidth and the time is added to the switch that reopens the model [asm].
"""

from __future__ import annotations

import math

from talaria.services.instance_agent.scheduler import RoundScheduler, SchedulerConfig
from talaria.services.instance_agent.scheduler.types import (
    CallAdmitted,
    CallFinished,
    Decode,
    Idle,
    Prefill,
    RoundEnded,
    SwitchModel,
    Work,
)
from talaria.sim.instance import InstanceFlags, Job, RoundRecord, SimInstance, SwitchRecord
from talaria.sim.profiles import ProfileCosts, ServerProfile


def scheduler_config(flags: InstanceFlags) -> SchedulerConfig:
    """The RoundScheduler settings of a simulated instance (values documented on InstanceFlags)."""
    return SchedulerConfig(
        sp=flags.sp,
        hkvr=flags.hkvr,
        staging=flags.staging,
        gamma=flags.gamma,
        ttft_target_s=flags.ttft_target_s,
        tpot_target_s=flags.tpot_target_s,
        max_batch=flags.max_batch,
        sp_max_batch=flags.sp_max_batch,
        min_slot_s=flags.min_slot_s,
        drain_on_switch=flags.drain_on_switch,
        fill_slot=flags.fill_slot,
        max_decode_iters=flags.max_decode_iters,
    )


class ServicesInstance(SimInstance):
    def __init__(self, instance_id: str, server: ServerProfile, flags: InstanceFlags, sink) -> None:
        super().__init__(instance_id, server, flags, sink)
        self.sched = RoundScheduler(scheduler_config(flags), self.models, ProfileCosts(server))
        self.jobs: dict[str, Job] = {}
        # queued jobs per model by call id (O(1) removal at admission; only sizes are read)
        self.pending = {m: {} for m in self.models}  # type: ignore[assignment]
        self.action = None
        self.action_start = 0.0
        self.max_steps = max(1, flags.max_decode_steps)

    # ---- inputs -----------------------------------------------------------------------

    def submit(self, now: float, job: Job):
        job.arrived_t = now
        job.instance = self.id
        source, avail = self._kv_for(job)
        kv = source if source in ("device", "host") else "none"
        self.sched.submit(
            Work(job.call_id, job.session, job.model, job.prompt, avail, kv, job.output, now, job.call_index > 0),
            now,
        )
        self.jobs[job.call_id] = job
        self.pending[job.model][job.call_id] = job
        self.queued_tokens += job.prompt
        if not self.busy:
            return self._drive(now)
        if isinstance(self.action, Decode) and self.action.steps > 1:
            return self._cut(now)
        return None

    # ---- the driving loop -------------------------------------------------------------

    def _drive(self, now: float):
        action = self.sched.next_action(now, self.max_steps)
        self.action = action
        self.action_start = now
        self.token += 1
        if isinstance(action, Idle):
            self.busy = False
            if action.until is not None and action.until > now:
                return [(action.until, self._wake, (self.token,))]
            return None
        self.busy = True
        if isinstance(action, SwitchModel):
            return self._switch(now, action)
        if isinstance(action, Prefill):
            return self._prefill(now, action)
        assert isinstance(action, Decode)
        return [(now + self._decode_s(action, action.steps), self._done, (self.token, None))]

    def _decode_s(self, action: Decode, steps: int) -> float:
        calls = [self.jobs[c] for c in action.call_ids]
        n = len(calls)
        ctx = sum(j.ctx for j in calls)
        mp = self.server.model(action.model)
        return steps * mp.decode_step_s(n, ctx + n * (steps - 1) / 2)

    def _cut(self, now: float):
        """Stop the running multi-step decode at the first step boundary at or after `now`."""
        action = self.action
        elapsed = now - self.action_start
        step = self._decode_s(action, action.steps) / action.steps
        j = max(1, min(action.steps, math.ceil(elapsed / step - 1e-9)))
        while j > 1 and self._decode_s(action, j - 1) >= elapsed - 1e-12:
            j -= 1
        while j < action.steps and self._decode_s(action, j) < elapsed - 1e-12:
            j += 1
        if j >= action.steps:
            return None
        self.token += 1
        return [(self.action_start + self._decode_s(action, j), self._done, (self.token, j))]

    def _wake(self, now: float, token: int):
        if token != self.token or self.busy:
            return None
        return self._drive(now)

    def _switch(self, now: float, action: SwitchModel):
        model = action.to_model
        staged = self._staged_bytes(now, model) if action.staged else 0
        path, seconds, phases = self.server.switch(model, staged)
        # running calls of the target model (paper mode) get their parked KV back
        resume = sum(j.ctx for j in self.inflight[model])
        if resume:
            restore = self.server.restore_s(model, resume)
            phases = {**phases, "kv_resume": restore}
            seconds += restore
        self.switches.append(SwitchRecord(self.id, self.active, model, path, seconds, now, phases))
        self.opens += 1
        if self.active is not None:
            for session in list(self.kv.device):
                host = self.kv.host.get((self.active, session), 0) if self.flags.hkvr else 0
                self.sched.update_kv(session, self.active, "host" if host else "none", host)
        self.kv.clear_device()
        self.active, self.switching_to, self.stage_target = None, model, None
        self._hbm(self.server.model(model).weight_bytes)
        return [(now + seconds, self._done, (self.token, None))]

    def _prefill(self, now: float, action: Prefill):
        seconds = 0.0
        for cid in action.call_ids:
            job = self.jobs[cid]
            cost, job.kv_source, _ = self._prefill_cost(job)
            if job.kv_source == "host":
                self.kv.touch_host(job.model, job.session)
            seconds += cost
            if self.pending[job.model].pop(cid, None) is not None:
                self.queued_tokens -= job.prompt
        return [(now + seconds, self._done, (self.token, None))]

    def _done(self, now: float, token: int, steps: int | None):
        if token != self.token:
            return None
        action = self.action
        out: list = []
        if isinstance(action, SwitchModel):
            self.active, self.switching_to = action.to_model, None
            self._last_peak_kv = 0
            for job in self.inflight[self.active]:
                self._put_device(now, job.session, job.ctx)
            events = self.sched.on_switch_done(action, now)
        elif isinstance(action, Prefill):
            finished = []
            for cid in action.call_ids:
                job = self.jobs[cid]
                job.first_token_t = now
                job.ctx = job.prompt + 1
                job.remaining = job.output - 1
                self._put_device(now, job.session, job.ctx)
                if job.remaining <= 0:
                    finished.append(cid)
                else:
                    self.inflight[job.model].append(job)
            events = self.sched.on_prefill_done(action, now, finished)
        else:
            k = action.steps if steps is None else steps
            finished = []
            for cid in action.call_ids:
                job = self.jobs[cid]
                job.remaining -= k
                job.ctx += k
                self.kv.device[job.session] = job.ctx
                if job.remaining <= 0:
                    finished.append(cid)
            self.kv.device_tokens += k * len(action.call_ids)
            self.kv.version += 1
            events = self.sched.on_decode_done(action, now, finished, k)
        out.extend(self._events(now, events))
        self._update_staging(now)
        out.extend(self._drive(now) or ())
        return out

    def _events(self, now: float, events) -> list:
        out: list = []
        for ev in events:
            if isinstance(ev, CallAdmitted):
                job = self.jobs[ev.call_id]
                job.admitted_t = now
                job.via = ev.via
            elif isinstance(ev, CallFinished):
                job = self.jobs.pop(ev.call_id, None)
                if job is not None:
                    running = self.inflight[job.model]
                    if job in running:
                        running.remove(job)
                    if ev.reason != "aborted":
                        out.extend(self._complete(now, job) or ())
            elif isinstance(ev, RoundEnded):
                rec = RoundRecord(self.id, ev.round_index, ev.at - ev.wall_s, ev.wall_s, ev.switch_s)
                rec.slots = list(ev.slots)
                rec.sp_admitted, rec.sp_parked = ev.sp_admitted, ev.sp_parked
                self.rounds.append(rec)
        self.sp_admitted = self.sched.sp_admitted
        self.sp_parked = self.sched.sp_parked
        self.deadline_risk = self.sched.deadline_risk
        return out

    def _update_staging(self, now: float) -> None:
        """Stage the model the scheduler's rotation opens next (if staging is on)."""
        if not self.flags.staging or self.active is None:
            return
        calls = self.sched.calls
        if not calls.any_active_except(self.active):
            target = None  # O(1) common case: nothing of another model waits
        else:
            target = next((m for m in self.sched.active_in_rotation(self.active) if m != self.active), None)
        if target != self.stage_target:
            self.stage_target, self.stage_start = target, now

    def round_remaining_s(self, now: float) -> float:
        rnd = self.sched.round
        return max(0.0, rnd.started_at + rnd.predicted_s - now) if rnd is not None else 0.0

    def settle(self, now: float) -> None:
        return None
