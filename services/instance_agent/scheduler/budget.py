"""Round and slot budgets (paper Eq. 3-5). Pure arithmetic, no state.

A round visits every active model once:

    R_i = sum_m [ P_m + D1_m + sum_k (SP_m,k + D_m,k) + D_m,fin ] + sum S_m->m'     (Eq. 3)

Split R_i into decode time and everything else, F = switches + prefill (P and SP):
R_i = F + d * sum_m t_D,m when every model gets d protected decode iterations.

Eq. 4 (decode share). U_m = R_i - d_m t_D,m is all round time not spent on m's decode.
A sequence active for the whole round sees R_i / d_m per token; keeping that under
T_TPOT is d_m (T_TPOT - t_D,m) >= U_m, i.e. d_m T_TPOT >= R_i. (The typeset equation
reads `d_m T_TPOT - t_D,m >= U_m`; we use the form that matches the stated intent,
R_i / d_m <= T_TPOT, and the stated infeasibility when T_TPOT <= t_D,m.) Every model
needs d T >= R_i, so the smallest plan gives them all the same d:

    d = ceil(F / (T_TPOT - sum_m t_D,m))            feasible only if sum_m t_D,m < T_TPOT

Eq. 5 (round cap). R_i <= gamma * T_TTFT. When the plan exceeds it, protected decode
wins (cadence first, as the paper reserves d before P and SP); P is cut back and the
shortfall is reported as deadline risk. When Eq. 4 is infeasible, d is the longest
decode the cap allows (that is the best cadence reachable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.instance_agent.scheduler.config import SchedulerConfig


@dataclass(frozen=True)
class ModelLoad:
    """What one active model is predicted to cost in the coming round."""

    decode_step_s: float  # t_D,m at its predicted batch
    prefill_s: float  # P_m: restore + prefill of the work its P would admit


@dataclass(frozen=True)
class SlotPlan:
    model: str
    protected_decode: int  # d_m
    decode_step_s: float  # t_D,m
    prefill_budget_s: float  # P time this slot may spend before it is cut back
    sp_budget_s: float  # SP time (with the decode it forces) this slot may spend
    predicted_round_s: float  # R_i of Eq. 3 without SP
    round_cap_s: float  # gamma * T_TTFT
    decode_slack_s: float  # T_TPOT - sum t_D; <= 0 when Eq. 4 is infeasible
    switch_s: float  # switches predicted in the round

    @property
    def tpot_feasible(self) -> bool:
        return self.decode_slack_s > 0

    @property
    def over_budget(self) -> bool:
        return self.predicted_round_s > self.round_cap_s + 1e-12

    def sp_extension(self, cost_s: float) -> int:
        """Extra protected decode iterations that keep Eq. 4 after `cost_s` more prefill."""
        if cost_s <= 0 or not self.tpot_feasible:
            return 0
        return math.ceil(cost_s / self.decode_slack_s - 1e-9)

    def sp_charge_s(self, cost_s: float) -> float:
        """Budget an SP batch uses: its prefill/restore plus the decode it adds (Eq. 4)."""
        return cost_s + self.sp_extension(cost_s) * self.decode_step_s


def plan_slot(model: str, loads: dict[str, ModelLoad], switch_s: float, config: SchedulerConfig) -> SlotPlan:
    """The plan of `model`'s slot given the round's active `loads` (which include `model`)."""
    cap = config.round_cap_s
    step_sum = sum(load.decode_step_s for load in loads.values())
    fixed = switch_s + sum(load.prefill_s for load in loads.values())
    slack = config.tpot_target_s - step_sum
    t_m = loads[model].decode_step_s
    d = _decode_iterations(fixed, step_sum, slack, cap)
    d = _clamp_iterations(d, t_m, cap, config)
    predicted = fixed + d * step_sum
    over = max(0.0, predicted - cap)
    return SlotPlan(
        model=model,
        protected_decode=d,
        decode_step_s=t_m,
        prefill_budget_s=max(0.0, loads[model].prefill_s - over),
        sp_budget_s=max(0.0, cap - predicted) / len(loads),
        predicted_round_s=predicted,
        round_cap_s=cap,
        decode_slack_s=slack,
        switch_s=switch_s,
    )


def _decode_iterations(fixed_s: float, step_sum_s: float, slack_s: float, cap_s: float) -> int:
    if slack_s > 0:
        return max(1, math.ceil(fixed_s / slack_s - 1e-9))
    if step_sum_s <= 0:
        return 1
    return max(1, math.floor((cap_s - fixed_s) / step_sum_s))


def _clamp_iterations(d: int, step_s: float, cap_s: float, config: SchedulerConfig) -> int:
    if step_s > 0:
        d = max(d, math.ceil(config.min_slot_s / step_s - 1e-9))
        max_slot = config.max_slot_s if config.max_slot_s is not None else cap_s
        d = min(d, max(1, math.floor(max_slot / step_s + 1e-9)))
    return max(1, min(d, config.max_decode_iters))


def switch_cycle_s(order: list[str], current: str | None, price) -> float:
    """Predicted switch time of one steady-state rotation over `order` (the S term of Eq. 3).

    With two or more active models every slot is entered by a switch, so the round pays
    each edge of the cycle order[0] -> order[1] -> ... -> order[0] once. A lone active
    model pays nothing once it is on the device. `price(a, b)` prices one switch.
    """
    if not order:
        return 0.0
    if len(order) == 1:
        return 0.0 if current == order[0] else price(current, order[0])
    return sum(price(a, b) for a, b in zip(order, order[1:] + order[:1]))
