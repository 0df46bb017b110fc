"""Test helpers: build a real RoundScheduler and drive it with a fake clock and made-up
engine results, the way vLLM's scheduler tests do (no engine, no GPU)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from talaria.services.instance_agent.scheduler.costs import call_prefill_s, first_step_reaching
from talaria.services.instance_agent.scheduler import (
    Action,
    Decode,
    Idle,
    LinearCosts,
    Prefill,
    RoundScheduler,
    SchedulerConfig,
    SwitchModel,
)
from talaria.services.instance_agent.scheduler.calls import AgentCall

# Round numbers: 1 ms per 100 prompt tokens, 10 ms decode steps, 1 s staged switch.
COSTS = LinearCosts(
    prefill_tok_s=100_000.0,
    restore_tok_s=1_000_000.0,
    decode_base_s=0.01,
    switch_staged_s=1.0,
    switch_host_s=2.0,
    kv_bytes_per_token=1,
)


def make(models=("a", "b", "c"), costs=COSTS, **config) -> RoundScheduler:
    return RoundScheduler(SchedulerConfig(**config), list(models), costs)


def work(call_id, model="a", *, session=None, prompt=100, reuse=0, kv="none", max_tokens=4, at=0.0, cont=False):
    """A call routed here, as the scheduler is submitted it (its record); `cont`: a
    continuation (a session's later call)."""
    return AgentCall(
        call_id=call_id,
        session_id=session or f"s-{call_id}",
        model=model,
        prompt_tokens=prompt,
        reusable_tokens=reuse,
        kv_state=kv,
        max_tokens=max_tokens,
        arrived_at=at,
        call_index=int(cont),
    )


def ret(call_id, model="a", *, kv="device", prompt=1000, reuse=900, **kw):
    """A returning call (continuation) with a reusable prefix."""
    return work(call_id, model, prompt=prompt, reuse=reuse, kv=kv, cont=True, **kw)


def label(action: Action) -> str:
    match action:
        case SwitchModel(to_model=m):
            return f"S:{m}"
        case Prefill(call_ids=ids, session_prefill=sp, model=m):
            return f"{'SP' if sp else 'P'}:{m}:{','.join(ids)}"
        case Decode(call_ids=ids, model=m):
            return f"D:{m}:{','.join(ids)}"
    return "I"


@dataclass
class Driver:
    """Executes actions on a virtual clock: each takes `estimate_s` seconds."""

    sched: RoundScheduler
    now: float = 0.0
    trace: list[str] = field(default_factory=list)
    actions: list = field(default_factory=list)
    events: list = field(default_factory=list)
    eos: dict[str, int] = field(default_factory=dict)  # call -> finish after this many tokens
    slowdown: float = 1.0  # the "engine" takes this multiple of the scheduler's estimate
    max_steps: int = 1  # next_action(now, max_decode_steps=...); >1 stops early on arrivals
    _arrivals: list = field(default_factory=list)
    _n: int = 0

    def submit(self, w: AgentCall) -> None:
        self.sched.submit(w, self.now)

    def at(self, t: float, w: AgentCall) -> None:
        """Submit `w` when the clock reaches `t` (possibly while an action runs)."""
        self._n += 1
        heapq.heappush(self._arrivals, (t, self._n, w))

    def step(self) -> Action:
        self._arrive(self.now)
        action = self.sched.next_action(self.now, self.max_steps)
        self.trace.append(label(action))
        self.actions.append(action)
        if isinstance(action, SwitchModel) and self.sched.config.drain_on_switch and action.from_model:
            # the torch engine's contract: switch_to is refused while calls run
            assert not self.sched.calls.running[action.from_model], f"switch with running calls: {action}"
        if isinstance(action, Idle):
            self.events += self.sched.drain_events()
            if self._arrivals:
                self.now = max(self.now, self._arrivals[0][0])
            return action
        took = self.duration(action)
        steps = None
        if isinstance(action, Decode) and action.steps > 1 and self._arrivals:
            # a submission mid-action: stop at the first step boundary at or after it
            arrival = self._arrivals[0][0]
            if arrival < self.now + took:
                steps = first_step_reaching(lambda j: self.duration(action, j), arrival - self.now, action.steps)
                took = self.duration(action, steps)
        self.now += took
        self._arrive(self.now)
        self.events += self._complete(action, took, steps)
        return action

    def duration(self, action, steps: int | None = None) -> float:
        """What the action "really" takes: the uncalibrated profile times `slowdown`,
        computed the way a simulator would (the scheduler's own estimate may drift)."""
        s, truth = self.sched, self.sched.costs.base
        match action:
            case SwitchModel(from_model=a, to_model=b, staged=staged):
                took = truth.switch_s(a, b, staged)
            case Prefill(call_ids=ids):
                held = [c for c in map(s.calls.holding, ids) if c is not None]  # aborted ones are skipped
                took = sum(call_prefill_s(truth, c, s.config.hkvr) for c in held)
            case Decode(call_ids=ids, model=m):
                live = [c for c in map(s.calls.holding, ids) if c is not None]
                ctx = sum(c.context_tokens for c in live)
                k = action.steps if steps is None else steps
                took = sum(truth.decode_step_s(m, len(live), ctx + len(live) * i) for i in range(k))
        return took * self.slowdown

    def run(self, max_steps=10_000) -> list[str]:
        """Step until idle with nothing left to arrive."""
        for _ in range(max_steps):
            if isinstance(self.step(), Idle) and not self._arrivals:
                return self.trace
        raise AssertionError(f"did not go idle in {max_steps} steps: {self.trace[-20:]}")

    def run_until(self, pred, max_steps=10_000) -> None:
        for _ in range(max_steps):
            if pred(self):
                return
            self.step()
        raise AssertionError("condition never held")

    def of(self, kind):
        return [e for e in self.events if isinstance(e, kind)]

    def _arrive(self, until: float) -> None:
        while self._arrivals and self._arrivals[0][0] <= until:
            t, _, w = heapq.heappop(self._arrivals)
            self.sched.submit(w, t)

    def _complete(self, action, took, steps=None):
        s = self.sched
        match action:
            case SwitchModel():
                return s.on_switch_done(action, self.now, took)
            case Prefill():
                return s.on_prefill_done(action, self.now, self._eos(action, True))
            case Decode():
                return s.on_decode_done(action, self.now, self._eos(action, False), steps)
        raise AssertionError(action)

    def _eos(self, action, prefill):
        """Calls whose made-up engine output hits EOS with the token this step produces."""
        done = set()
        for cid in action.call_ids:
            limit = self.eos.get(cid)
            if limit is None or self.sched.calls.holding(cid) is None:
                continue
            tokens_after = 1 if prefill else self.sched.generated(cid) + 1
            if tokens_after >= limit:
                done.add(cid)
        return done


