"""Work-fair admission across tenants: each tenant's share of the instances, counted in
prefill work (a call's prompt tokens x its model's measured seconds per fresh prompt token,
`PrefillRates`), not in calls.

A *long* call is one whose predicted prefill exceeds the admission target's wait
(`slack_s`): it holds an instance's steps longer than any other call should wait, so it
takes that instance. While another tenant is active (a call in flight, or one that ended
within `active_window_s`), a tenant may hold at most its share of the instances in long
calls (instances / active tenants, at least one); past that, its next long call is refused
429 with Retry-After at once, with the reason. Short calls are never refused here
(count-based shares still apply, admission.py). Alone, a tenant may use every instance. This
is flow control by work in the manner of llm-d's per-flow fairness, as a refusal instead of
a queue: a virtual token counter (VTC, Sheng et al., OSDI'24) orders a queue by each
client's service so far, and the gateway queues nothing. Pure: the clock is passed in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from talaria.shared.messages import CallResult, ErrorReply
from talaria.shared.prefill_cost import prefill_s
from talaria.shared.stats import ewma


@dataclass
class PrefillRates:
    """Seconds per fresh prompt token, per model (EWMA), as the router prices them: what the
    engines running the model report in their snapshots (step tokens / step time), else what
    the agents' answers measured (a short call's prefill_s is mostly a step's fixed cost, so
    per token it overstates the rate several times; the engines' measure comes first)."""

    alpha: float = 0.2
    s_per_token: dict[str, float] = field(default_factory=dict)  # from answers
    engine_s_per_token: dict[str, float] = field(default_factory=dict)  # from snapshots
    ctx_s_per_token2: dict[str, float] = field(default_factory=dict)  # attention's slope, from snapshots
    ctx_prior: dict[str, float] = field(default_factory=dict)  # the slope's prior, until one is measured

    def observe(self, model: str, reply: CallResult) -> None:
        fresh = reply.usage.prompt_tokens - reply.usage.cached_tokens
        if fresh > 0 and reply.timings.prefill_s > 0:
            self.s_per_token[model] = ewma(self.s_per_token.get(model), reply.timings.prefill_s / fresh, self.alpha)

    def observe_engine(self, model: str | None, prefill_tok_s: float, ctx_s_per_tok2: float = 0.0,
                       measured: bool = True) -> None:
        """A snapshot's prefill rate and its slope with context (`measured`: an established
        fit, else the architecture's prior, which a measure replaces): its active model's."""
        if model and prefill_tok_s > 0:
            self.engine_s_per_token[model] = ewma(self.engine_s_per_token.get(model), 1.0 / prefill_tok_s, self.alpha)
        if model and ctx_s_per_tok2 > 0:
            slopes = self.ctx_s_per_token2 if measured else self.ctx_prior
            slopes[model] = ewma(slopes.get(model), ctx_s_per_tok2, self.alpha)

    def work_s(self, model: str, fresh_tokens: int) -> float:
        """Predicted prefill seconds of `fresh_tokens` (0 before any measure of the model),
        attention's growth with context included once an engine measured it."""
        rate = self.engine_s_per_token.get(model) or self.s_per_token.get(model, 0.0)
        slope = self.ctx_s_per_token2.get(model) or self.ctx_prior.get(model, 0.0)
        return prefill_s(rate, slope, fresh_tokens, 0)



@dataclass
class WorkFairness:
    slack_s: float = 2.0  # a call predicted to prefill longer than this is long (the admission target)
    in_flight: Counter = field(default_factory=Counter)  # tenant -> calls in flight
    long_in_flight: Counter = field(default_factory=Counter)  # tenant -> long calls in flight
    long_work_s: Counter = field(default_factory=Counter)  # tenant -> their predicted prefill seconds
    # A client loop is idle for a moment between its calls: a tenant counts as active for this
    # long after its last call ended, so that moment does not hand its share to another.
    active_window_s: float = 2.0
    last_done: dict[str, float] = field(default_factory=dict)  # tenant -> when its last call ended

    def is_long(self, work_s: float) -> bool:
        return work_s > self.slack_s

    def active(self, now: float) -> set[str]:
        """Tenants with a call in flight or one that ended within `active_window_s`."""
        recent = {t for t, at in self.last_done.items() if now - at <= self.active_window_s}
        return {t for t, n in self.in_flight.items() if n > 0} | recent

    def check(self, tenant: str, work_s: float, instances: int, now: float) -> ErrorReply | None:
        """Would a call of `tenant` with `work_s` seconds of prefill be refused as past its share?"""
        active = self.active(now) | {tenant}
        if len(active) == 1 or not self.is_long(work_s):
            return None
        share = max(1, max(1, instances) // len(active))
        if self.long_in_flight[tenant] < share:
            return None
        retry = max(1.0, min(60.0, self.long_work_s[tenant] / max(1, self.long_in_flight[tenant])))
        return ErrorReply(429, "over_fair_share",
                          f"this call's prompt is ~{work_s:.1f} s of prefill work, and your long calls in flight "
                          f"({self.long_in_flight[tenant]}, ~{self.long_work_s[tenant]:.1f} s) already hold your share "
                          f"of the instances ({share} of {instances}, shared by {len(active)} tenants); retry when "
                          "one is done", retry_after_s=retry)

    def admit(self, tenant: str, work_s: float, instances: int, now: float) -> ErrorReply | None:
        """Count a call of `tenant` with `work_s` seconds of prefill, or the reply refusing it."""
        refused = self.check(tenant, work_s, instances, now)
        if refused is not None:
            return refused
        self.in_flight[tenant] += 1
        if self.is_long(work_s):
            self.long_in_flight[tenant] += 1
            self.long_work_s[tenant] += work_s
        return None

    def done(self, tenant: str, work_s: float, now: float) -> None:
        """A call admitted with `work_s` ended."""
        if self.in_flight[tenant] <= 0:
            return
        self.last_done[tenant] = now
        for gone in [t for t, at in self.last_done.items() if now - at > self.active_window_s]:
            del self.last_done[gone]  # bounded by the tenants active in the window
        _take(self.in_flight, tenant, 1)
        if self.is_long(work_s):
            _take(self.long_in_flight, tenant, 1)
            _take(self.long_work_s, tenant, work_s)


def _take(counter: Counter, key: str, amount: float) -> None:
    counter[key] -= amount
    if counter[key] <= 1e-9:
        del counter[key]
