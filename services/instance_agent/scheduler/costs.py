"""Cost predictions the scheduler charges to its budgets, and their online calibration.

`StepCostModel` is what a driver supplies: the simulator passes its calibrated profile, the
live agent passes a profile seeded from engine stats. `CalibratedCosts` wraps either
and corrects it with an EWMA of what the executor actually measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from talaria.services.instance_agent.scheduler.calls import AgentCall
from talaria.services.instance_agent.scheduler.types import KvState
from talaria.shared.stats import ewma


@runtime_checkable
class StepCostModel(Protocol):
    """Predicted durations (seconds) and KV footprint (bytes). Pure; never reads a clock."""

    def prefill_s(self, model: str, new_tokens: int, context_tokens: int) -> float:
        """Compute `new_tokens` of one call on top of `context_tokens` already in KV."""

    def restore_s(self, model: str, tokens: int) -> float:
        """Bring `tokens` of one call's KV from the host registry to the device (H2D)."""

    def decode_step_s(self, model: str, batch: int, context_tokens: int) -> float:
        """One decode iteration of `batch` calls; `context_tokens` is summed over the batch."""

    def switch_s(self, from_model: str | None, to_model: str, staged: bool = True) -> float:
        """Logical switch; `staged=False` prices the host-only (H2D) path."""

    def kv_bytes(self, model: str, tokens: int) -> int:
        """Device KV bytes for `tokens` tokens of one call."""


def charged_kv(call: AgentCall, hkvr: bool) -> KvState:
    """The KV state the scheduler charges: without HKVR a host prefix is as good as none."""
    if call.kv_state == "host" and not hkvr:
        return "none"
    return call.kv_state


def call_prefill_s(costs: StepCostModel, call: AgentCall, hkvr: bool) -> float:
    """Predicted restore + prefill time of one call (the SP_m,k term of Eq. 3 per call)."""
    kv = charged_kv(call, hkvr)
    if kv == "none" or call.reusable_tokens == 0:
        return costs.prefill_s(call.model, call.prompt_tokens, 0)
    new = call.prompt_tokens - call.reusable_tokens
    restore = costs.restore_s(call.model, call.reusable_tokens) if kv == "host" else 0.0
    # A fully reused prompt still computes one token to produce the first logits.
    return restore + costs.prefill_s(call.model, max(1, new), call.reusable_tokens)


def call_kv_bytes(costs: StepCostModel, call: AgentCall) -> int:
    """Device KV a call is admitted for: its prompt plus the output the router expects (not
    max_tokens, a cap it seldom uses; the engine grows a call past it, engine/admission.py)."""
    out = min(call.max_tokens, call.kv_output_tokens) if call.kv_output_tokens > 0 else call.max_tokens
    return costs.kv_bytes(call.model, call.prompt_tokens + out)


@dataclass
class CalibratedCosts:
    """`base` corrected by measurements.

    Prefill and decode keep one multiplicative factor per model (EWMA of measured /
    predicted); a prefill batch measures restore + prefill together, so both share the
    prefill factor. Switches keep an EWMA of the measured seconds per (from, to, staged),
    because the paper's switch estimate follows staging coverage, not a static constant.
    """

    base: StepCostModel
    alpha: float = 0.2
    factors: dict[tuple[str, str], float] = field(default_factory=dict)
    switches: dict[tuple[str | None, str, bool], float] = field(default_factory=dict)

    def observe(self, kind: str, model: str, predicted_s: float, measured_s: float) -> None:
        """Fold one measured step (`kind` is 'prefill' or 'decode') into its factor."""
        if kind not in ("prefill", "decode"):
            raise ValueError(f"unknown cost kind {kind!r}")
        if predicted_s <= 0 or measured_s < 0:
            return  # nothing to learn from a zero prediction
        key = (kind, model)
        # The prediction already includes the old factor; the ratio corrects the base.
        old = self.factors.get(key, 1.0)  # the profile itself is the prior
        self.factors[key] = ewma(old, measured_s / (predicted_s / old), self.alpha)

    def observe_switch(self, from_model: str | None, to_model: str, staged: bool, measured_s: float) -> None:
        key = (from_model, to_model, staged)
        self.switches[key] = ewma(self.switches.get(key), measured_s, self.alpha)

    def prefill_s(self, model: str, new_tokens: int, context_tokens: int) -> float:
        return self.base.prefill_s(model, new_tokens, context_tokens) * self._f("prefill", model)

    def restore_s(self, model: str, tokens: int) -> float:
        return self.base.restore_s(model, tokens) * self._f("prefill", model)

    def decode_step_s(self, model: str, batch: int, context_tokens: int) -> float:
        return self.base.decode_step_s(model, batch, context_tokens) * self._f("decode", model)

    def switch_s(self, from_model: str | None, to_model: str, staged: bool = True) -> float:
        measured = self.switches.get((from_model, to_model, staged))
        if measured is not None:
            return measured
        return self.base.switch_s(from_model, to_model, staged)

    def kv_bytes(self, model: str, tokens: int) -> int:
        return self.base.kv_bytes(model, tokens)

    def _f(self, kind: str, model: str) -> float:
        return self.factors.get((kind, model), 1.0)


@dataclass(frozen=True)
class LinearCosts:
    """A minimal linear profile: tests, examples and a fallback before calibration.

    Not calibrated to any hardware; the simulator's profile engine owns real numbers.
    """

    prefill_tok_s: float = 20_000.0
    prefill_ctx_s_per_tok: float = 0.0  # attention over reused context
    restore_tok_s: float = 200_000.0
    decode_base_s: float = 0.02
    decode_ctx_s_per_tok: float = 0.0
    switch_staged_s: float = 1.0
    switch_host_s: float = 1.5
    kv_bytes_per_token: int = 1024

    def prefill_s(self, model: str, new_tokens: int, context_tokens: int) -> float:
        return new_tokens / self.prefill_tok_s + context_tokens * self.prefill_ctx_s_per_tok

    def restore_s(self, model: str, tokens: int) -> float:
        return tokens / self.restore_tok_s

    def decode_step_s(self, model: str, batch: int, context_tokens: int) -> float:
        return self.decode_base_s + context_tokens * self.decode_ctx_s_per_tok

    def switch_s(self, from_model: str | None, to_model: str, staged: bool = True) -> float:
        return self.switch_staged_s if staged else self.switch_host_s

    def kv_bytes(self, model: str, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token


# ---- multi-step decode arithmetic (the scheduler, the simulator and the tests share it) ----


def decode_steps_s(step_s: Callable[[int, float], float], batch: int, context: float, steps: int) -> float:
    """`steps` decode iterations of `batch` calls holding `context` tokens, with
    `step_s(batch, context)` one iteration. Context grows one token per call per step, so
    the sum is `steps` steps at the mean context (exact for costs linear in context)."""
    if steps == 1:
        return step_s(batch, context)
    return steps * step_s(batch, context + batch * (steps - 1) / 2)


def first_step_reaching(duration_s: Callable[[int], float], target_s: float, max_steps: int) -> int:
    """Fewest steps j in [1, max_steps] whose `duration_s(j)` reaches `target_s` (1e-9 s
    slack), else max_steps: where a multi-step decode is cut for a deadline or an arrival.
    `duration_s` grows with j; the guess from the first step's time is corrected both ways."""
    step = duration_s(1)
    if step <= 0:
        return 1
    j = max(1, min(max_steps, math.ceil(target_s / step - 1e-9)))
    while j > 1 and duration_s(j - 1) >= target_s - 1e-9:
        j -= 1
    while j < max_steps and duration_s(j) < target_s - 1e-9:
        j += 1
    return j
