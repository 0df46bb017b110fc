"""The scheduler's work priced under the calibrated step costs: a call's prefill, a decode
of several steps, a model's load for a slot plan, KV bytes held, a switch.

A part of `RoundScheduler` (scheduler.py) every decision asks for a price, handed the call
table, the calibrated costs and the config; it owns no state but each call's memo. `cost`
memoises the profile's terms per `Work` (bit-identical to `call_prefill_s`: the same products
and sum).
"""

from __future__ import annotations

from functools import partial
from itertools import islice

from talaria.services.instance_agent.scheduler.budget import ModelLoad
from talaria.services.instance_agent.scheduler.calls import AgentCall, CallTable
from talaria.services.instance_agent.scheduler.config import SchedulerConfig
from talaria.services.instance_agent.scheduler.costs import (
    CalibratedCosts, StepCostModel, call_kv_bytes, charged_kv, decode_steps_s,
)
from talaria.services.instance_agent.scheduler.types import Decode, Work


class WorkPricing:
    def __init__(self, calls: CallTable, costs: CalibratedCosts, config: SchedulerConfig) -> None:
        self.calls, self.costs, self.config = calls, costs, config

    def kv_used(self, model: str) -> int:
        return sum(self.kv(c) for c in self.calls.running[model])

    def decode_s(self, action: Decode, steps: int) -> float:
        """`steps` iterations of `action` from its calls' current context (`decode_steps_s`)."""
        calls = self.calls
        n = ctx = 0
        for i in action.call_ids:
            c = calls.holding(i)
            if c is not None:  # calls aborted while their step was in flight are skipped
                n += 1
                ctx += c.work.prompt_tokens + c.generated
        return decode_steps_s(partial(self.costs.decode_step_s, action.model), n, ctx, steps)

    def load(self, model: str) -> ModelLoad:
        """Predicted decode step and P cost of `model` once its P has admitted what fits."""
        running = self.calls.running[model]
        free = max(0, self.config.max_batch - len(running))
        queued = list(islice(self.calls.queued[model], free))
        batch = max(1, len(running) + len(queued))
        ctx = 0
        for c in running:
            ctx += c.work.prompt_tokens + c.generated
        ctx_q = 0
        for c in queued:
            ctx_q += c.work.prompt_tokens
        step = self.costs.decode_step_s(model, batch, ctx + ctx_q)
        prefill = sum([self.cost(c) for c in queued])
        if self.config.chunked_prefill:  # prompts still being computed in chunks
            prefill += sum(self.left_cost(c, c.prefill_left) for c in running if c.prefilling)
        return ModelLoad(decode_step_s=step, prefill_s=prefill)

    def cost(self, call: AgentCall) -> float:
        """`call_prefill_s`, with the profile's (uncalibrated) terms memoised per `Work`:
        the same products and sum as `CalibratedCosts`, so the result is bit-identical."""
        work = call.work
        memo = call.cost_memo
        if memo is None or memo[0] is not work:
            memo = call.cost_memo = (work, *prefill_terms(self.costs.base, work, self.config.hkvr))
        restore, prefill = memo[1], memo[2]
        f = self.costs.factors.get(("prefill", work.model), 1.0)
        if restore is None:
            return prefill * f
        return restore * f + prefill * f

    def left_cost(self, call: AgentCall, tokens: int, left: int | None = None) -> float:
        """Predicted prefill of `tokens` more prompt tokens of `call` (`left` still to compute)."""
        left = call.prefill_left if left is None else left
        return self.costs.prefill_s(call.work.model, max(1, tokens), max(0, call.work.prompt_tokens - left))

    def kv(self, call: AgentCall) -> int:
        return call_kv_bytes(self.costs, call.work)

    def kv_free(self, model: str) -> int | None:
        budget = self.config.kv_budget_bytes
        return None if budget is None else max(0, budget - self.kv_used(model))

    def switch_s(self, from_model: str | None, to_model: str) -> float:
        return self.costs.switch_s(from_model, to_model, self.config.staging)


def prefill_terms(base: StepCostModel, work: Work, hkvr: bool) -> tuple[float | None, float]:
    """(restore, prefill) of `call_prefill_s` before calibration; restore None: no restore term."""
    kv = charged_kv(work, hkvr)
    if kv == "none" or work.reusable_tokens == 0:
        return None, base.prefill_s(work.model, work.prompt_tokens, 0)
    new = work.prompt_tokens - work.reusable_tokens
    restore = base.restore_s(work.model, work.reusable_tokens) if kv == "host" else None
    return restore, base.prefill_s(work.model, max(1, new), work.reusable_tokens)


def compute_tokens(work: Work, hkvr: bool) -> int:
    """Prompt tokens a call computes (the rest is reused KV); at least the last one."""
    if charged_kv(work, hkvr) == "none":
        return work.prompt_tokens
    return max(1, work.prompt_tokens - work.reusable_tokens)
