"""Choosing a prefill batch under budgets: one function used by P, SP and the hot pool."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from talaria.services.instance_agent.scheduler.calls import AgentCall


@dataclass(frozen=True)
class Limits:
    free_slots: int  # max_batch minus calls already running
    batch: int  # calls this one prefill may take
    kv_free_bytes: int | None  # None: no KV budget
    time_s: float | None  # None: no time budget
    at_least_one: bool = False  # admit the oldest even past the time budget (P's progress rule)


@dataclass(frozen=True)
class Selection:
    admitted: tuple[AgentCall, ...]
    cost_s: float  # predicted restore + prefill of `admitted`
    left: tuple[tuple[AgentCall, str], ...]  # (call, reason) for each candidate not taken

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(c.call_id for c in self.admitted)

    def left_for(self, reason: str) -> int:
        return sum(1 for _, r in self.left if r == reason)


def select(
    candidates: Iterable[AgentCall],
    limits: Limits,
    cost_of: Callable[[AgentCall], float],
    kv_of: Callable[[AgentCall], int],
    charge: Callable[[float], float] = lambda cost: cost,
) -> Selection:
    """Take candidates in order while every limit holds.

    A candidate that misses the time or KV budget is skipped, not a stopping point: by
    doing `continue` instead of `break` a smaller later call may still fit, so FCFS holds
    only among the calls that fit. Starvation is avoided elsewhere: P always admits its
    oldest call (`at_least_one`), and SP leftovers fall back to the next slot's P.
    `charge(total_cost)` is what the time budget pays for a batch of that cost.
    """
    admitted: list[AgentCall] = []
    left: list[tuple[AgentCall, str]] = []
    cost = 0.0
    kv = 0
    full = min(limits.free_slots, limits.batch)
    it = iter(candidates)
    for call in it:
        if len(admitted) >= full:
            # every later candidate misses the same count limit (what _misses would say)
            reason = "max_batch" if len(admitted) >= limits.free_slots else "batch"
            left.append((call, reason))
            left.extend([(c, reason) for c in it])
            break
        reason = _misses(call, admitted, cost, kv, limits, cost_of, kv_of, charge)
        if reason is None:
            admitted.append(call)
            cost += cost_of(call)
            kv += kv_of(call)
        else:
            left.append((call, reason))
    return Selection(tuple(admitted), cost, tuple(left))


def _misses(call, admitted, cost, kv, limits, cost_of, kv_of, charge) -> str | None:
    if len(admitted) >= limits.free_slots:
        return "max_batch"
    if len(admitted) >= limits.batch:
        return "batch"
    if limits.kv_free_bytes is not None and kv + kv_of(call) > limits.kv_free_bytes:
        return "kv_budget"
    if limits.time_s is None or (limits.at_least_one and not admitted):
        return None
    if charge(cost + cost_of(call)) > limits.time_s + 1e-12:
        return "time"
    return None
