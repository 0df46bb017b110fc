"""The scheduler's work priced under the calibrated step costs: a call's prefill, a decode
of several steps, a model's load for a slot plan, KV bytes held, a switch.

A part of `RoundScheduler` (scheduler.py) every decision asks for a price, handed the call
table, the calibrated costs and the config; it owns no state but each call's memo. `cost`
memoises the profile's terms per call (bit-identical to `call_prefill_s`: the same products
and sum).
"""

from __future__ import annotations

from functools import partial
from itertools import islice

from talaria.services.instance_agent.scheduler.budget import ModelLoad
from talaria.services.instance_agent.scheduler.calls import AgentCall, CallTable
from talaria.services.instance_agent.scheduler.config import ConfigReader, SharedConfig
from talaria.services.instance_agent.scheduler.costs import (
    CalibratedCosts, StepCostModel, call_kv_bytes, charged_kv, decode_steps_s,
)
from talaria.services.instance_agent.scheduler.types import Decode


class WorkPricing(ConfigReader):
    def __init__(self, calls: CallTable, costs: CalibratedCosts, shared: SharedConfig) -> None:
        self.calls, self.costs, self.shared = calls, costs, shared

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
                ctx += c.prompt_tokens + c.generated
        return decode_steps_s(partial(self.costs.decode_step_s, action.model), n, ctx, steps)

    def load(self, model: str) -> ModelLoad:
        """Predicted decode step and P cost of `model` once its P has admitted what fits."""
        running = self.calls.running[model]
        free = max(0, self.config.max_batch - len(running))
        queued = list(islice(self.calls.queued[model], free))
        batch = max(1, len(running) + len(queued))
        ctx = 0
        for c in running:
            ctx += c.prompt_tokens + c.generated
        ctx_q = 0
        for c in queued:
            ctx_q += c.prompt_tokens
        step = self.costs.decode_step_s(model, batch, ctx + ctx_q)
        prefill = sum([self.cost(c) for c in queued])
        if self.config.chunked_prefill:  # prompts still being computed in chunks
            prefill += sum(self.left_cost(c, c.prefill_left) for c in running if c.prefilling)
        return ModelLoad(decode_step_s=step, prefill_s=prefill)

    def cost(self, call: AgentCall) -> float:
        """`call_prefill_s`, with the profile's (uncalibrated) terms memoised on the call (until
        its KV changes): the same products and sum as `CalibratedCosts`, so the result is
        bit-identical."""
        memo = call.cost_memo
        if memo is None:
            memo = call.cost_memo = prefill_terms(self.costs.base, call, self.config.hkvr)
        restore, prefill = memo
        f = self.costs.factors.get(("prefill", call.model), 1.0)
        if restore is None:
            return prefill * f
        return restore * f + prefill * f

    def left_cost(self, call: AgentCall, tokens: int, left: int | None = None) -> float:
        """Predicted prefill of `tokens` more prompt tokens of `call` (`left` still to compute)."""
        left = call.prefill_left if left is None else left
        return self.costs.prefill_s(call.model, max(1, tokens), max(0, call.prompt_tokens - left))

    def kv(self, call: AgentCall) -> int:
        return call_kv_bytes(self.costs, call)

    def kv_free(self, model: str) -> int | None:
        budget = self.config.kv_budget_bytes
        return None if budget is None else max(0, budget - self.kv_used(model))

    def switch_s(self, from_model: str | None, to_model: str) -> float:
        return self.costs.switch_s(from_model, to_model, self.config.staging)


def prefill_terms(base: StepCostModel, call: AgentCall, hkvr: bool) -> tuple[float | None, float]:
    """(restore, prefill) of `call_prefill_s` before calibration; restore None: no restore term."""
    kv = charged_kv(call, hkvr)
    if kv == "none" or call.reusable_tokens == 0:
        return None, base.prefill_s(call.model, call.prompt_tokens, 0)
    new = call.prompt_tokens - call.reusable_tokens
    restore = base.restore_s(call.model, call.reusable_tokens) if kv == "host" else None
    return restore, base.prefill_s(call.model, max(1, new), call.reusable_tokens)


def compute_tokens(call: AgentCall, hkvr: bool) -> int:
    """Prompt tokens a call computes (the rest is reused KV); at least the last one."""
    if charged_kv(call, hkvr) == "none":
        return call.prompt_tokens
    return max(1, call.prompt_tokens - call.reusable_tokens)
