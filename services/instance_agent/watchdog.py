"""Watchdog: notices an engine step or a call that stopped making progress. Pure: fed
step starts/ends, call progress and round lengths with their times, asked at `now`.

A step running far longer than any of its kind so far marks the agent unhealthy and fails that
step's calls; a started call idle far longer than the longest round is failed alone (the rules
and the one constant, STUCK_FACTOR: `Watchdog`). The runner applies the verdicts.

The watchdog keeps no table of calls: a call's progress and whether it was failed are fields
of the executor's part of its record (`CallTransport.progress_at`, `.stuck`), and `check` is
handed the calls to judge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from talaria.services.instance_agent.scheduler.calls import AgentCall

STUCK_FACTOR = 10.0
MIN_STUCK_S = 10.0


@dataclass
class Verdict:
    unhealthy: str = ""  # why the agent should not take new calls; "" when healthy
    fail_calls: list[AgentCall] = field(default_factory=list)  # calls failed now (why: transport.stuck)


@dataclass
class Watchdog:
    """Two kinds of stuck, two answers (the runner applies them):
    - an engine step running far longer than any step of its kind so far: the agent says
      it is unhealthy in its heartbeat (the router stops choosing it) and that step's calls
      are failed, so their clients get an answer now; the flag clears when the step returns;
    - a started call, not in the step in flight, that made no progress for far longer than
      the longest round so far (e.g. its completion got lost in a bug): that call is failed
      and the agent keeps serving the others.

    "Far longer" is STUCK_FACTOR times the slowest measured step or round, or the scheduler's
    prediction for the step in flight (a first long prefill chunk may be planned up to the
    round cap), never below MIN_STUCK_S (the first cold weight load has no measurement to
    compare with). The factor is not tuned on an experiment: an order of magnitude is what
    separates "slow" from "not coming back". The floor is a setting (TALARIA_WATCHDOG_MIN_S).
    """

    min_stuck_s: float = MIN_STUCK_S
    slowest_step_s: dict[str, float] = field(default_factory=dict)  # per step kind
    slowest_round_s: float = 0.0
    step: tuple[str, float, tuple[AgentCall, ...]] | None = None  # (kind, started, calls) in flight
    step_predicted_s: float = 0.0  # the scheduler's estimate of the step in flight
    on_step: Callable[[str, float], None] | None = None  # (kind, seconds) of each step that ended (metrics)

    # ---- what happens -------------------------------------------------------------------

    def step_started(self, kind: str, calls: Iterable[AgentCall], now: float, predicted_s: float = 0.0) -> None:
        self.step = (kind, now, tuple(calls))
        self.step_predicted_s = predicted_s
        for call in self.step[2]:
            if call.transport is not None and call.transport.progress_at is None:  # started: watched from now on
                call.transport.progress_at = now

    def step_ended(self, now: float) -> None:
        if self.step is None:
            return
        kind, started, calls = self.step
        self.slowest_step_s[kind] = max(self.slowest_step_s.get(kind, 0.0), now - started)
        if self.on_step is not None:
            self.on_step(kind, now - started)
        for call in calls:
            if call.transport is not None:  # None: ended meanwhile (nothing to watch)
                call.transport.progress_at = now
        self.step = None

    def round_ended(self, wall_s: float) -> None:
        self.slowest_round_s = max(self.slowest_round_s, wall_s)

    # ---- bounds and the verdict ---------------------------------------------------------

    def step_limit_s(self, kind: str) -> float:
        expected = max(self.slowest_step_s.get(kind, 0.0), self.step_predicted_s if self.step else 0.0)
        return max(self.min_stuck_s, STUCK_FACTOR * expected)

    def call_limit_s(self) -> float:
        slowest = max([self.slowest_round_s, *self.slowest_step_s.values()], default=0.0)
        return max(self.min_stuck_s, STUCK_FACTOR * slowest)

    def check(self, now: float, calls: Iterable[AgentCall]) -> Verdict:
        """The verdict at `now` on the step in flight and on `calls` (the agent's table): a
        live call is failed once (its `stuck` says why); ended calls are not watched."""
        verdict = Verdict()
        in_step: tuple[AgentCall, ...] = ()
        if self.step is not None:
            kind, started, in_step = self.step
            limit = self.step_limit_s(kind)
            if now - started > limit:
                verdict.unhealthy = f"engine {kind} step running for {now - started:.1f}s (limit {limit:.1f}s)"
                for call in in_step:
                    if call.live and not call.transport.stuck:
                        call.transport.stuck = f"watchdog: engine {kind} step stuck for {now - started:.1f}s"
                        verdict.fail_calls.append(call)
        limit = self.call_limit_s()
        for call in calls:
            if not call.live or call.transport.stuck:
                continue
            last = call.transport.progress_at
            if last is not None and now - last > limit and call not in in_step:
                call.transport.stuck = f"watchdog: no progress for {now - last:.1f}s (limit {limit:.1f}s)"
                verdict.fail_calls.append(call)
        return verdict
