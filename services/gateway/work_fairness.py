"""Work-fair admission across tenants: a virtual token counter (VTC, Sheng et al., OSDI'24,
"Fairness in Serving Large Language Models") applied at admission.

Each tenant has a counter of the service it was given, in seconds of engine work: a call is
charged its prefill work when admitted (fresh prompt tokens x its model's measured seconds
per token, `PrefillRates`), and corrected to the prefill + decode time the agent measured
when it ends. A tenant that becomes active (a call in flight) is lifted to the least counter
among the active ones, as VTC lifts a newly backlogged client, so idle time banks no credit.

VTC serves the least-served backlogged client next; a gateway that does not queue refuses
instead. While the stack is contended (the work in flight exceeds what the live instances
do in the admission target's time), a tenant with a call in flight whose counter is more
than that same amount of work ahead of the least-served other active tenant is refused 429
with Retry-After. So one tenant's long prompts take at most one share of the instances
while another tenant is active; alone, a tenant may use them all. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from talaria.shared.messages import CallResult, ErrorReply, Reply


@dataclass
class PrefillRates:
    """Seconds per fresh prompt token, per model, as the agents' answers measured them (EWMA)."""

    alpha: float = 0.2
    s_per_token: dict[str, float] = field(default_factory=dict)

    def observe(self, model: str, reply: CallResult) -> None:
        fresh = reply.usage.prompt_tokens - reply.usage.cached_tokens
        if fresh <= 0 or reply.timings.prefill_s <= 0:
            return
        sample = reply.timings.prefill_s / fresh
        old = self.s_per_token.get(model)
        self.s_per_token[model] = sample if old is None else (1 - self.alpha) * old + self.alpha * sample

    def work_s(self, model: str, fresh_tokens: int) -> float:
        """Predicted prefill seconds of `fresh_tokens` (0 before any measure of the model)."""
        return fresh_tokens * self.s_per_token.get(model, 0.0)


@dataclass
class WorkFairness:
    slack_s: float = 2.0  # seconds of work per instance a tenant may run ahead (the admission target)
    counters: dict[str, float] = field(default_factory=dict)  # tenant -> seconds of work served
    in_flight: Counter = field(default_factory=Counter)  # tenant -> calls in flight
    work_in_flight: dict[str, float] = field(default_factory=dict)  # tenant -> their charged work

    def check(self, tenant: str, instances: int) -> ErrorReply | None:
        """Would a call of `tenant` be refused for being ahead of its fair share of work?"""
        slack = self.slack_s * max(1, instances)
        others = [self.counters[t] for t in self.in_flight if t != tenant]
        if not others or not self.in_flight[tenant] or sum(self.work_in_flight.values()) <= slack:
            return None
        ahead = self._counter(tenant) - min(others)
        if ahead <= slack:
            return None
        retry = max(1.0, min(60.0, self.work_in_flight.get(tenant, 0.0) / max(1, instances)))
        return ErrorReply(429, "over_fair_share",
                          f"your calls in flight hold {self.work_in_flight.get(tenant, 0.0):.1f} s of prefill work "
                          f"and you have been served {ahead:.1f} s of work more than another tenant waiting; "
                          "retry when your calls in flight are done", retry_after_s=retry)

    def admit(self, tenant: str, work_s: float, instances: int) -> ErrorReply | None:
        """Charge a call of `tenant` with `work_s` seconds of prefill, or the reply refusing it."""
        refused = self.check(tenant, instances)
        if refused is not None:
            return refused
        self.counters[tenant] = self._counter(tenant)  # the lift, when it becomes active
        self.counters[tenant] += work_s
        self.in_flight[tenant] += 1
        self.work_in_flight[tenant] = self.work_in_flight.get(tenant, 0.0) + work_s
        return None

    def done(self, tenant: str, work_s: float, reply: Reply | None) -> None:
        """A call charged `work_s` ended: its measured work replaces the estimate."""
        if self.in_flight[tenant] <= 0:
            return
        served = reply.timings.prefill_s + reply.timings.decode_s if isinstance(reply, CallResult) else 0.0
        self.counters[tenant] = self.counters.get(tenant, 0.0) - work_s + served
        self.in_flight[tenant] -= 1
        self.work_in_flight[tenant] = max(0.0, self.work_in_flight.get(tenant, 0.0) - work_s)
        if self.in_flight[tenant] <= 0:
            del self.in_flight[tenant]
            self.work_in_flight.pop(tenant, None)

    def _counter(self, tenant: str) -> float:
        """`tenant`'s counter, lifted to the least active one when it has nothing in flight."""
        own = self.counters.get(tenant, 0.0)
        if self.in_flight[tenant]:
            return own
        active = [self.counters[t] for t in self.in_flight if t != tenant and self.in_flight[t]]
        return max(own, min(active)) if active else own
