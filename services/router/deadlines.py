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
and nothing is refused; the rates being rough, a miss counts only past MARGIN times the time left.
"""

from __future__ import annotations

from talaria.shared.events import DEADLINE_UNREACHABLE, CallSubmitted, CandidateCost


# The rates are measured on whatever steps ran (short calls' steps are mostly fixed cost, which
# overstates a long prompt's per-token cost several times; attention over a long context, on a CPU,
# understates it), so a call is refused only when its first token comes past MARGIN times the time
# it has left: a plain miss is left to the agent, which judges a prefill under way on the rate
# measured on it (instance_agent/call_drops.py).
MARGIN = 2.0  # the factor by which the measured rates were seen to be off, both ways, on a CPU


def alone_s(c: CandidateCost) -> float:
    """The call's own work to its first token on this instance, nothing queued ahead."""
    return c.prefill_s + c.kv_recovery_s + c.activation_s


def finish_s(c: CandidateCost) -> float:
    """Predicted seconds from now to the call's first token on this instance."""
    return c.queue_s + alone_s(c)


def in_time(call: CallSubmitted, costs: list[CandidateCost], now: float) -> list[CandidateCost]:
    """The candidates where `call` gets its first token by its deadline (all, when it has none)."""
    if call.deadline_at <= 0:
        return list(costs)
    return [c for c in costs if finish_s(c) <= MARGIN * (call.deadline_at - now)]


def refusal(call: CallSubmitted, costs: list[CandidateCost], now: float) -> tuple[int, str]:
    """(status, reason) refusing `call`, none of whose `costs` answers in time."""
    left = call.deadline_at - now
    best = min(costs, key=finish_s)
    quickest = min(costs, key=alone_s)
    status = DEADLINE_UNREACHABLE if alone_s(quickest) > MARGIN * left else 503
    return status, (
        f"deadline: the call's first token would come in {finish_s(best):.1f} s at best ({best.prefill_s:.1f} s to prefill "
        f"{call.prompt_tokens} prompt tokens at the measured rate, {best.queue_s:.1f} s of work queued ahead), "
        f"past its deadline in {max(0.0, left):.1f} s"
        + ("; shorten the prompt or raise the call timeout" if status == DEADLINE_UNREACHABLE else ""))
