"""Watchdog: notices an engine step or a call that stopped making progress. Pure: fed
step starts/ends, call progress and round lengths with their times, asked at `now`.

Two kinds of stuck, two answers (the runner applies them):
- an engine step running far longer than any step of its kind so far: the agent says
  it is unhealthy in its heartbeat (the router stops choosing it) and that step's calls
  are failed, so their clients get an answer now; the flag clears when the step returns;
- a started call, not in the step in flight, that made no progress for far longer than
  the longest round so far (e.g. its completion got lost in a bug): that call is failed
  and the agent keeps serving the others.

"Far longer" is STUCK_FACTOR times the slowest measured step or round, or the scheduler's
prediction for the step in flight (a first long prefill chunk may be planned up to the
round cap), never below MIN_STUCK_S (the first cold weight load has no measurement to
compare with). The factor
is not tuned on an experiment: an order of magnitude is what separates "slow" from "not
coming back". The floor is a setting (TALARIA_WATCHDOG_MIN_S).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

STUCK_FACTOR = 10.0
MIN_STUCK_S = 10.0


@dataclass
class Verdict:
    unhealthy: str = ""  # why the agent should not take new calls; "" when healthy
    fail_calls: dict[str, str] = field(default_factory=dict)  # call_id -> why it is failed


@dataclass
class Watchdog:
    min_stuck_s: float = MIN_STUCK_S
    slowest_step_s: dict[str, float] = field(default_factory=dict)  # per step kind
    slowest_round_s: float = 0.0
    step: tuple[str, float, tuple[str, ...]] | None = None  # (kind, started, call ids) in flight
    step_predicted_s: float = 0.0  # the scheduler's estimate of the step in flight
    progress: dict[str, float] = field(default_factory=dict)  # started call -> last progress
    reported: set[str] = field(default_factory=set)  # calls already failed by a verdict
    on_step: Callable[[str, float], None] | None = None  # (kind, seconds) of each step that ended (metrics)

    # ---- what happens -------------------------------------------------------------------

    def step_started(self, kind: str, call_ids, now: float, predicted_s: float = 0.0) -> None:
        self.step = (kind, now, tuple(call_ids))
        self.step_predicted_s = predicted_s
        for c in call_ids:
            self.progress.setdefault(c, now)

    def step_ended(self, now: float) -> None:
        if self.step is None:
            return
        kind, started, call_ids = self.step
        self.slowest_step_s[kind] = max(self.slowest_step_s.get(kind, 0.0), now - started)
        if self.on_step is not None:
            self.on_step(kind, now - started)
        for c in call_ids:
            if c in self.progress:
                self.progress[c] = now
        self.step = None

    def round_ended(self, wall_s: float) -> None:
        self.slowest_round_s = max(self.slowest_round_s, wall_s)

    def call_done(self, call_id: str) -> None:
        self.progress.pop(call_id, None)
        self.reported.discard(call_id)

    # ---- bounds and the verdict ---------------------------------------------------------

    def step_limit_s(self, kind: str) -> float:
        expected = max(self.slowest_step_s.get(kind, 0.0), self.step_predicted_s if self.step else 0.0)
        return max(self.min_stuck_s, STUCK_FACTOR * expected)

    def call_limit_s(self) -> float:
        slowest = max([self.slowest_round_s, *self.slowest_step_s.values()], default=0.0)
        return max(self.min_stuck_s, STUCK_FACTOR * slowest)

    def check(self, now: float) -> Verdict:
        verdict = Verdict()
        in_step: tuple[str, ...] = ()
        if self.step is not None:
            kind, started, in_step = self.step
            limit = self.step_limit_s(kind)
            if now - started > limit:
                verdict.unhealthy = f"engine {kind} step running for {now - started:.1f}s (limit {limit:.1f}s)"
                for c in in_step:
                    if c not in self.reported:
                        verdict.fail_calls[c] = f"watchdog: engine {kind} step stuck for {now - started:.1f}s"
        limit = self.call_limit_s()
        for c, last in self.progress.items():
            if c not in in_step and now - last > limit and c not in self.reported:
                verdict.fail_calls[c] = f"watchdog: no progress for {now - last:.1f}s (limit {limit:.1f}s)"
        self.reported.update(verdict.fail_calls)
        return verdict
