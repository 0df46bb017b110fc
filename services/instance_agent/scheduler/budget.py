"""Round and slot budgets (paper Eq. 3-5). Pure arithmetic, no state.

A round visits every active model once (Eq. 3); each model gets d protected decode
iterations so a sequence sees at most T_TPOT per token (Eq. 4); the round is capped at
gamma * T_TTFT (Eq. 5), prefill cut back first. A slot then fills to its share of the round
budget (`fill_slot`), and an overloaded round decodes at least as long as it switches
(`switch_amortisation`). The derivation, and where we read the typeset Eq. 4 differently,
is `plan_slot`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from talaria.services.instance_agent.scheduler.config import SchedulerConfig


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
    slot_budget_s: float = 0.0  # time this slot may run (P + protected decode + leftover share)
    prefill_cut_s: float = 0.0  # queued P (all models) the round cannot carry under Eq. 4 + 5

    @property
    def tpot_feasible(self) -> bool:
        return self.decode_slack_s > 0

    @property
    def over_budget(self) -> bool:
        return self.predicted_round_s > self.round_cap_s + 1e-12 or self.prefill_cut_s > 1e-12

    def sp_extension(self, cost_s: float) -> int:
        """Extra protected decode iterations that keep Eq. 4 after `cost_s` more prefill."""
        if cost_s <= 0 or not self.tpot_feasible:
            return 0
        return math.ceil(cost_s / self.decode_slack_s - 1e-9)

    def sp_charge_s(self, cost_s: float) -> float:
        """Budget an SP batch uses: its prefill/restore plus the decode it adds (Eq. 4)."""
        return cost_s + self.sp_extension(cost_s) * self.decode_step_s


def chunk_s(plan: SlotPlan) -> float:
    """Time one prefill chunk may take: Eq. 4's decode slack, T_TPOT - sum t_D, which is
    what a round can add between two decode steps and keep every running call's
    time-per-token within target. With Eq. 4 infeasible, one decode step's time."""
    return plan.decode_slack_s if plan.tpot_feasible else plan.decode_step_s


def chunk_tokens(cost_of, budget_s: float, limit: int) -> int:
    """Most tokens n <= limit whose predicted prefill `cost_of(n)` fits `budget_s` (at
    least 1: a chunk always makes progress). `cost_of` must be non-decreasing."""
    if limit <= 1 or cost_of(limit) <= budget_s:
        return max(1, limit)
    lo, hi = 1, limit  # cost_of(hi) > budget
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost_of(mid) <= budget_s:
            lo = mid
        else:
            hi = mid
    return lo


def plan_slot(model: str, loads: dict[str, ModelLoad], switch_s: float, config: SchedulerConfig) -> SlotPlan:
    """The plan of `model`'s slot given the round's active `loads` (which include `model`).

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

    Eq. 5 (round cap). R_i <= gamma * T_TTFT. When the plan exceeds it, P is cut back
    (cadence first: Eq. 4 keeps holding for the prefill the round actually admits) and the
    shortfall is reported as deadline risk. The cut is self-consistent: with Eq. 4 feasible
    a round that admits F seconds of switch + prefill lasts about F * T_TPOT / slack, so the
    most prefill the cap allows is F_max - S with F_max = cap * slack / T_TPOT, shared among
    the models in proportion to their queued P; d is then sized for the prefill admitted,
    not for the prefill left waiting. (Sizing d for all queued prefill and then cutting P,
    as an earlier version did, reserves decode for work that does not run: with a deep queue
    d hit the slot clamp, P's budget fell to 0 and every slot admitted a single call.)
    When Eq. 4 is infeasible, d is the longest decode the cap allows (that is the best
    cadence reachable).

    Slot fill. Protected decode d is the *least* decode a slot runs. The paper's slot
    "closes when the round budget is exhausted": with `fill_slot` the slot keeps decoding
    (SP opportunities included) until its share of the round budget, `slot_budget_s` =
    its P budget + d t_D,m + its share of the round's leftover (cap - R_i) / n, is spent.
    Without it a contended slot closes right after d, so with cheap staged switches the
    rounds shrink to a few decode steps per model and the instance thrashes between models.

    Overload. When the round cannot hold the cap even at the least decode (its switches and
    prefill alone, or Eq. 4 infeasible, push R_i past gamma T_TTFT), neither target is met
    and the round's length no longer buys anything; yet d stays at the least decode (often
    1 iteration per model), so a round of many models is mostly switches and a long output
    gets one token per round: sessions starve (issue 34: switch share 76 %, SCT p95 4x the
    peers'). Then every model gets d >= switch_amortisation x S / sum t_D, so the round
    decodes at least as long as it switches (rent-or-buy break-even at 1: a switch costs
    at most the work it enables, so throughput stays within 2x of switch-free). Below
    overload nothing changes (results/overload.md).
    """
    cap = config.round_cap_s
    step_sum = sum(load.decode_step_s for load in loads.values())
    prefill = sum(load.prefill_s for load in loads.values())
    slack = config.tpot_target_s - step_sum
    t_m = loads[model].decode_step_s
    p_m = loads[model].prefill_s
    demand = prefill
    if slack > 0 and prefill > 0:
        # Eq. 4 + 5 together: the most switch + prefill a capped round can carry.
        f_max = cap * slack / config.tpot_target_s
        room = max(0.0, f_max - switch_s)
        if prefill > room:
            p_m *= room / prefill
            prefill = room
    fixed = switch_s + prefill
    d = _decode_iterations(fixed, step_sum, slack, cap)
    d = _clamp_iterations(d, t_m, cap, config)
    if step_sum > 0 and fixed + d * step_sum > cap + 1e-12 and config.switch_amortisation > 0:
        # Overload (module doc): Eq. 5 is lost anyway, so decode at least the switch time.
        d = max(d, math.ceil(config.switch_amortisation * switch_s / step_sum - 1e-9))
    predicted = fixed + d * step_sum
    over = max(0.0, predicted - cap)
    p_budget = max(0.0, p_m - over)
    leftover = max(0.0, cap - predicted) / len(loads)
    fill = min(leftover, switch_s / len(loads)) if config.fill_by_switch else leftover
    return SlotPlan(
        model=model,
        protected_decode=d,
        decode_step_s=t_m,
        prefill_budget_s=p_budget,
        sp_budget_s=leftover,
        predicted_round_s=predicted,
        round_cap_s=cap,
        decode_slack_s=slack,
        switch_s=switch_s,
        slot_budget_s=p_budget + d * t_m + fill,
        prefill_cut_s=demand - prefill,
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
