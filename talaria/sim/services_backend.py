"""The `services` instance backend: the instance agent's own RoundScheduler on sim costs.

`services.instance_agent.scheduler.RoundScheduler` decides (which model, which calls, P or
SP, when to switch); this executor prices each action with the profile, keeps the device
KV / HKVR / staging state (shared with the built-in backend via `SimInstance`), and
reports back through `on_*_done`. Decode is executed one iteration per event (the
scheduler's contract), so this backend is exact but slower than `fast`; the scale
experiment uses `fast`.
"""

from __future__ import annotations

from services.instance_agent.scheduler import RoundScheduler, SchedulerConfig
from services.instance_agent.scheduler.types import (
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


class ServicesInstance(SimInstance):
    def __init__(self, instance_id: str, server: ServerProfile, flags: InstanceFlags, sink) -> None:
        super().__init__(instance_id, server, flags, sink)
        config = SchedulerConfig(
            sp=flags.sp,
            hkvr=flags.hkvr,
            staging=flags.staging,
            gamma=flags.gamma,
            ttft_target_s=flags.ttft_target_s,
            max_batch=flags.max_batch,
        )
        self.sched = RoundScheduler(config, self.models, ProfileCosts(server))
        self.jobs: dict[str, Job] = {}
        self.action = None
        self._round_start = 0.0

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
        self.pending[job.model].append(job)
        self.queued_tokens += job.prompt
        if not self.busy:
            return self._drive(now)
        return None

    def _drive(self, now: float):
        action = self.sched.next_action(now)
        self.action = action
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
        calls = [self.jobs[c] for c in action.call_ids]
        step = self.server.model(action.model).decode_step_s(len(calls), sum(j.ctx for j in calls))
        return [(now + step, self._done, (self.token,))]

    def _wake(self, now: float, token: int):
        if token != self.token or self.busy:
            return None
        return self._drive(now)

    def _switch(self, now: float, action: SwitchModel):
        model = action.to_model
        staged = self._staged_bytes(now, model) if action.staged else 0
        path, seconds, phases = self.server.switch(model, staged)
        self.switches.append(SwitchRecord(self.id, self.active, model, path, seconds, now, phases))
        for session in list(self.kv.device):
            host = self.kv.host.get((self.active, session), 0) if self.flags.hkvr else 0
            self.sched.update_kv(session, self.active, "host" if host else "none", host)
        self.kv.clear_device()
        self.active, self.switching_to, self.stage_target = None, model, None
        self._hbm(self.server.model(model).weight_bytes)
        return [(now + seconds, self._done, (self.token,))]

    def _prefill(self, now: float, action: Prefill):
        seconds = 0.0
        for cid in action.call_ids:
            job = self.jobs[cid]
            cost, job.kv_source, _ = self._prefill_cost(job)
            seconds += cost
            if job in self.pending[job.model]:
                self.pending[job.model].remove(job)
                self.queued_tokens -= job.prompt
        return [(now + seconds, self._done, (self.token,))]

    def _done(self, now: float, token: int):
        if token != self.token:
            return None
        action = self.action
        out: list = []
        if isinstance(action, SwitchModel):
            self.active, self.switching_to = action.to_model, None
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
            events = self.sched.on_prefill_done(action, now, finished)
        else:
            finished = []
            for cid in action.call_ids:
                job = self.jobs[cid]
                job.remaining -= 1
                job.ctx += 1
                if job.remaining <= 0:
                    finished.append(cid)
            events = self.sched.on_decode_done(action, now, finished)
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
                if job is not None and ev.reason != "aborted":
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
        view = self.sched.snapshot(now)
        waiting = [m for m in self.models if m != self.active and (view.queued.get(m) or view.running.get(m))]
        n = len(self.models)
        start = self.models.index(self.active) + 1
        order = [self.models[(start + i) % n] for i in range(n - 1)]
        target = next((m for m in order if m in waiting), None)
        if target != self.stage_target:
            self.stage_target, self.stage_start = target, now

    def settle(self, now: float) -> None:
        return None
