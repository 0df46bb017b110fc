"""Admission control: past what the stack can serve, a new call is refused at once with
`Retry-After` instead of joining a queue whose wait makes every answer useless, and a disk about
to fill refuses new calls before the broker breaks on it.

Load: a standing queue of the answered calls' queueing delay (CoDel's signal) lowers an online
AIMD limit on calls in flight, shared fairly among tenants (429 over a tenant's share, 503 when
every tenant is over it); prefill work is weighed per tenant too (work_fairness.py). Disk: below
`TALARIA_MIN_FREE_DISK_MB` free, new calls are refused 503 `insufficient_storage`. The rules in
full: `Admission`; what an unbounded queue cost: docs/decisions/2026-12-01-admission-control.md.
"""

from __future__ import annotations

import math
import shutil
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from talaria.services.gateway.work_fairness import PrefillRates, WorkFairness
from talaria.shared.messages import CallResult, ErrorReply, Reply

DECREASE, INCREASE = 0.9, 1.1  # AIMD steps: a gentle cut per interval, as TCP Vegas-style limiters


@dataclass
class Admission:
    """The admission policy (pure: `(state, event, now)`); the Submitter calls it.

    Load: each answered call's *queueing delay* is its time at the gateway less the engine's work
    on it (prefill + decode): the time it waited for the router and for a slot. A standing queue
    is CoDel's signal: the smallest delay of the calls answered in the last interval above the
    target (`TALARIA_ADMISSION_TARGET_QUEUE_S`, the wait an operator accepts) means every call
    waited. The limit on calls in flight then adapts online (AIMD): it starts unlimited, drops to
    90% of what is in flight when a standing queue is seen (once per interval, the interval being
    the target), and grows 10% per interval without one, unlimited again once it is twice what
    is in flight. Past the limit a tenant still gets its fair share (limit / tenants with calls
    in flight): a tenant over its share is refused 429, so one tenant's flood cannot starve the
    others; when every tenant is over its share, 503. `Retry-After`: the target, at least 1 s.

    Work: calls are also weighed by their prefill work per tenant (work_fairness.py): while
    another tenant is active, a tenant's long prompts (each predicted to prefill longer than the
    target) may hold only its share of the instances; past it, the next is refused 429 at once.

    Disk: below `TALARIA_MIN_FREE_DISK_MB` free on the data directory's filesystem, new calls are
    refused 503 `insufficient_storage` and `/readyz` says so; calls already running finish.
    """

    target_queue_s: float = 2.0
    limit: float = math.inf  # calls in flight admitted before fair shares apply
    in_flight: Counter = field(default_factory=Counter)  # tenant -> calls in flight
    delays: deque = field(default_factory=deque)  # (answered at, queueing delay) in the last interval
    adjusted_at: float = 0.0
    fairness: WorkFairness | None = None  # work-fair shares (default: long = past the target)
    rates: PrefillRates = field(default_factory=PrefillRates)
    instances: Callable[[], int] = lambda: 1  # live instances (the gateway's view of snapshots)

    def __post_init__(self) -> None:
        if self.fairness is None:
            self.fairness = WorkFairness(slack_s=self.target_queue_s, active_window_s=self.target_queue_s)

    @property
    def total(self) -> int:
        return sum(self.in_flight.values())

    def work_s(self, model: str, prompt_tokens: int) -> float:
        """A call's prefill work as admission charges it: the whole prompt (the gateway cannot
        know which prefix an instance holds)."""
        return self.rates.work_s(model, prompt_tokens)

    def refusal(self, tenant: str, work_s: float, now: float) -> ErrorReply | None:
        """Would a call of `tenant` with `work_s` seconds of prefill be refused? (Nothing is
        counted: a keyed call asks before it claims its key.)"""
        return self.check(tenant) or self.fairness.check(tenant, work_s, self._instances_for(work_s), now)

    def admit(self, tenant: str, now: float, work_s: float = 0.0) -> ErrorReply | None:
        """Count a new call of `tenant` with `work_s` seconds of prefill, or the reply refusing it."""
        refused = self.check(tenant) or self.fairness.admit(tenant, work_s, self._instances_for(work_s), now)
        if refused is None:
            self.in_flight[tenant] += 1
        return refused

    def _instances_for(self, work_s: float) -> int:
        """The live instances, counted only for a long call: a short one is never refused by its
        share (work_fairness.py), and the count walks every service's health per call."""
        return self.instances() if self.fairness.is_long(work_s) else 0

    def check(self, tenant: str) -> ErrorReply | None:
        """Would a new call of `tenant` be refused? (Not counted: a keyed call asks before it
        claims its key, so a refused call leaves no claim for its retry to wait on.)"""
        total = self.total
        if total >= self.limit:
            active = len(set(self.in_flight) | {tenant})
            share = self.limit / active
            if self.in_flight[tenant] >= share:
                retry = max(1.0, self.target_queue_s)
                if active > 1:
                    return ErrorReply(429, "over_fair_share",
                                      f"the stack is at capacity and your calls in flight ({self.in_flight[tenant]}) "
                                      f"are over your share ({share:.0f}); retry later", retry_after_s=retry)
                return ErrorReply(503, "overloaded", f"the stack is at capacity ({total} calls in flight, each "
                                  f"queueing over {self.target_queue_s:g}s); retry later", retry_after_s=retry)
        return None

    def done(self, tenant: str, reply: Reply | None, elapsed_s: float, now: float, work_s: float = 0.0,
             model: str = "") -> None:
        """A call admitted for `tenant` (charged `work_s`) ended after `elapsed_s` at the gateway."""
        self.fairness.done(tenant, work_s, now)
        if isinstance(reply, CallResult):
            self.rates.observe(model or reply.model, reply)
        self.in_flight[tenant] -= 1
        if self.in_flight[tenant] <= 0:
            del self.in_flight[tenant]
        if isinstance(reply, CallResult):  # an error says nothing of the queue it did not wait in
            t = reply.timings
            self.delays.append((now, max(0.0, elapsed_s - t.prefill_s - t.decode_s)))
        self._adjust(now)

    def _adjust(self, now: float) -> None:
        interval = self.target_queue_s
        while self.delays and self.delays[0][0] < now - interval:
            self.delays.popleft()
        if now - self.adjusted_at < interval or not self.delays:
            return
        self.adjusted_at = now
        standing = min(d for _, d in self.delays)
        in_flight = self.total
        if standing > self.target_queue_s:
            self.limit = max(1.0, min(self.limit, in_flight + 1) * DECREASE)
        elif self.limit != math.inf:
            self.limit *= INCREASE
            if self.limit >= 2 * max(1, in_flight):
                self.limit = math.inf


def default_min_free_bytes(path: Path) -> int:
    """5% of the filesystem, at most 1 GiB: room for the calls in flight to finish and record
    (~6 KB each measured: JetStream, spans, logs) and for the broker's own compaction."""
    return min(1 << 30, shutil.disk_usage(path).total // 20)


@dataclass(frozen=True)
class DiskCheck:
    path: Path
    min_free_bytes: int

    def problem(self) -> str | None:
        """Why new calls are refused for lack of disk; None while there is room."""
        try:
            free = shutil.disk_usage(self.path).free
        except OSError as exc:
            return f"cannot read the free space of {self.path}: {exc}"
        if free < self.min_free_bytes:
            return (f"only {free // (1 << 20)} MiB free on the data directory's disk, under the "
                    f"{self.min_free_bytes // (1 << 20)} MiB kept for calls in flight")
        return None

    def refusal(self) -> ErrorReply | None:
        problem = self.problem()
        return None if problem is None else ErrorReply(503, "insufficient_storage", problem, retry_after_s=5.0)
