"""Can a call get its answer by its deadline where it would be placed? Pure, on the priced
candidates.

A call carries its deadline (the gateway's submit time + call timeout). Placed where even
its first token (the work queued there, its own prefill, KV recovery and activation, at the
measured per-token rates of costs.py) comes past that deadline, it would hold an instance
for nothing: nobody reads the answer, the agent drops it at the deadline, and every call
behind it waited for that. Such a call is refused up front: 413 when even an idle instance
could not start answering in time (retrying cannot help), 503 with Retry-After when only the
work queued ahead is in the way. Decode is not counted: `max_tokens` is a cap and the output
estimate a guess, and a call may stop early. Without measured rates the prefill is priced 0
and nothing is refused. The rates being rough, a miss counts only past each instance's
measured overstatement of its prices (`margin`).
"""

from __future__ import annotations

from collections.abc import Mapping

from talaria.shared.events import DEADLINE_UNREACHABLE, CallSubmitted, CandidateCost


# An instance's prices run over (or under) what its long prefills take: its engine's rate is
# measured on whatever steps ran (a short call's step is mostly fixed cost), attention's slope
# is a fit or the architecture's prior. Each agent reports by how much, measured on its own
# chunked prefills (`InstanceSnapshot.prefill_overstatement`: 9 in 10 of them ran at least
# their price / that factor; scheduler/prefill_curve.py): a call is refused only when its
# first token comes past that factor times the time it has left, that is when even the most
# generous reading of the price misses. A plain miss is left to the agent, which judges a
# prefill under way on the rate measured on it (instance_agent/call_drops.py).
# Before an instance has run a chunked prefill, MARGIN: the factor its rates were seen off,
# both ways, on a CPU: on the prices and times measured here every decision is the same for
# any factor from 1.25 to 3.4 (tests/unit/router/test_deadline_margin.py).
MARGIN = 2.0


def margin(measured: float) -> float:
    """The factor a price must pass the time left by: an instance's measured overstatement,
    MARGIN before it measured one."""
    return measured if measured > 0 else MARGIN


def alone_s(c: CandidateCost) -> float:
    """The call's own work to its first token on this instance, nothing queued ahead."""
    return c.prefill_s + c.kv_recovery_s + c.activation_s


def finish_s(c: CandidateCost) -> float:
    """Predicted seconds from now to the call's first token on this instance."""
    return c.queue_s + alone_s(c)


def in_time(call: CallSubmitted, costs: list[CandidateCost], now: float,
            overstatements: Mapping[str, float] | None = None) -> list[CandidateCost]:
    """The candidates where `call` gets its first token by its deadline (all, when it has
    none). `overstatements`: by instance id, how far its prices run over (absent: MARGIN)."""
    if call.deadline_at <= 0:
        return list(costs)
    over = overstatements or {}
    return [c for c in costs if finish_s(c) <= margin(over.get(c.instance_id, 0.0)) * (call.deadline_at - now)]


def refusal(call: CallSubmitted, costs: list[CandidateCost], now: float,
            overstatements: Mapping[str, float] | None = None) -> tuple[int, str]:
    """(status, reason) refusing `call`, none of whose `costs` answers in time."""
    left = call.deadline_at - now
    over = overstatements or {}
    best = min(costs, key=finish_s)
    # 413 when even the instance quickest alone, its price read as generously as it measured,
    # could not start answering in time
    quickest = min(costs, key=lambda c: alone_s(c) / margin(over.get(c.instance_id, 0.0)))
    status = DEADLINE_UNREACHABLE if alone_s(quickest) > margin(over.get(quickest.instance_id, 0.0)) * left else 503
    return status, (
        f"deadline: the call's first token would come in {finish_s(best):.1f} s at best ({best.prefill_s:.1f} s to prefill "
        f"{call.prompt_tokens} prompt tokens at the measured rate, {best.queue_s:.1f} s of work queued ahead), "
        f"past its deadline in {max(0.0, left):.1f} s"
        + ("; shorten the prompt or raise the call timeout" if status == DEADLINE_UNREACHABLE else ""))
