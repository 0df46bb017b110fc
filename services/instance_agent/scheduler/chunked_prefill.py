"""Prefill actions: a batch admitted (P, SP, hot), the next chunk of prompts under way (how
many tokens it computes), and what prefill costs and a newcomer waits behind.

A part of `RoundScheduler` (scheduler.py), handed the call table, the calibrated costs, the
config and the pricing part: it splits long prompts into chunks sized from the slot's budget
(Eq. 4's slack while other work shares the instance, Eq. 5's round cap alone), and predicts
the cost of a chunk and the prefill a newcomer waits behind. The slot in progress (the cold
pool's, None on a hot instance) is passed to each question that depends on it.
"""

from __future__ import annotations

from collections.abc import Iterable

from talaria.services.instance_agent.scheduler.admission import Selection
from talaria.services.instance_agent.scheduler.budget import chunk_s, chunk_tokens
from talaria.services.instance_agent.scheduler.calls import AgentCall, CallTable
from talaria.services.instance_agent.scheduler.config import ConfigReader, SharedConfig
from talaria.services.instance_agent.scheduler.costs import CalibratedCosts
from talaria.services.instance_agent.scheduler.prefill_curve import PrefillCurve
from talaria.services.instance_agent.scheduler.rounds import Slot
from talaria.services.instance_agent.scheduler.types import Prefill
from talaria.services.instance_agent.scheduler.work_costs import WorkPricing, compute_tokens, prefill_terms
from talaria.shared.prefill_cost import prefill_s


class PrefillPlanner(ConfigReader):
    def __init__(self, calls: CallTable, costs: CalibratedCosts, shared: SharedConfig,
                 pricing: WorkPricing, curve: PrefillCurve | None = None) -> None:
        self.calls, self.costs, self.shared, self.pricing = calls, costs, shared, pricing
        self.curve = curve if curve is not None else PrefillCurve()

    def start(self, selection: Selection, via: str, model: str, now: float, slot: Slot | None) -> Prefill:
        """The Prefill of a batch `selection` admitted (P, SP or hot): its calls start running."""
        for call in selection.admitted:
            self.calls.start(call, via)
            call.prefill_left = compute_tokens(call, self.config.hkvr)
        chunk, per_pass = self.chunk_for(model, selection.admitted, slot)
        return Prefill(selection.ids, session_prefill=via == "SP", model=model, chunk_tokens=chunk,
                       pass_tokens=per_pass)

    def split_running(self, model: str) -> tuple[tuple[str, ...], tuple[AgentCall, ...]]:
        """(running calls that decode, running calls still prefilling), admission order."""
        running = self.calls.running[model]
        if not self.config.chunked_prefill:
            return tuple(c.call_id for c in running), ()
        filling = tuple(c for c in running if c.prefilling)
        if not filling:
            return tuple(c.call_id for c in running), ()
        return tuple(c.call_id for c in running if not c.prefilling), filling

    def continue_prefill(self, calls: tuple[AgentCall, ...], model: str, slot: Slot | None) -> Prefill:
        chunk, per_pass = self.chunk_for(model, calls, slot)
        return Prefill(tuple(c.call_id for c in calls), model=model, chunk_tokens=chunk, pass_tokens=per_pass)

    def chunk_for(self, model: str, calls: Iterable[AgentCall], slot: Slot | None) -> tuple[int, int]:
        """(tokens per call of the next prefill chunk, tokens per call per forward pass).
        A chunk that covers every prompt still counts as one: the driver ends it early when
        a call arrives, after the pass in flight, so a pass is sized like a shared chunk."""
        if not self.config.chunked_prefill:
            return 0, 0
        calls = list(calls)
        longest = max((c.prefill_left for c in calls), default=0)
        ctx = max(c.prompt_tokens - c.prefill_left for c in calls)

        # Once chunks measured it, a step's fixed cost is priced once per chunk, not per token:
        # a per-token rate calibrated on short steps (mostly fixed cost) would size chunks so
        # small that fixed cost dominates them too, and a long prompt would crawl.
        s0, a, b = self.curve.fit(model)

        def cost(k: int) -> float:
            if s0 > 0 and a > 0:
                return s0 + len(calls) * prefill_s(a, b, k, ctx)
            return len(calls) * self.costs.prefill_s(model, k, ctx)

        def fits(budget: float) -> int:
            return chunk_tokens(cost, budget, longest)

        budget, shared = self.chunk_budget_s(model, slot), self.shared_chunk_s(model, slot)
        chunk = fits(budget)
        return chunk, (chunk if budget == shared else min(chunk, fits(shared)))

    def prefill_ahead_tokens(self, slot: Slot | None) -> int:
        """Prompt tokens a call arriving now waits behind: every queued prompt, and of each
        prefill under way what runs before the newcomer gets in. Without chunking that is
        all it has left; with chunking, at most one shared-instance chunk."""
        calls = self.calls
        ahead = sum(c.prompt_tokens for q in calls.queued.values() for c in q)
        return ahead + sum(n for _, _, n in self._prefill_under_way(slot))

    def prefill_ahead_s(self, slot: Slot | None) -> float:
        """The same work in predicted seconds: what each queued call must compute (a prefix
        on device costs nothing, a host prefix its restore), with the calibrated costs."""
        calls = self.calls
        ahead = sum(self.pricing.cost(c) for q in calls.queued.values() for c in q)
        for model, c, n in self._prefill_under_way(slot):
            ahead += self.costs.prefill_s(model, n, c.prompt_tokens - c.prefill_left)
        return ahead

    def prefill_left_s(self, slot: Slot | None) -> float:
        """Predicted seconds of prefill admitted calls still owe beyond what `prefill_ahead_s`
        counts (its first chunk): a newcomer's first token waits one chunk, but its every
        later step alternates with the rest, so a long prompt under way keeps the instance
        busy for all of it (the router prices that, costs.py)."""
        left = 0.0
        for model, c, n in self._prefill_under_way(slot):
            if c.prefill_left > n:
                left += self.pricing.left_cost(c, c.prefill_left - n, c.prefill_left - n)
        return left

    def _prefill_under_way(self, slot: Slot | None):
        """(model, call, prompt tokens a newcomer waits for) of each admitted call still prefilling."""
        for model, running in self.calls.running.items():
            for c in running:
                if c.prefilling and c.prefill_left:
                    if self.config.chunked_prefill:
                        budget = self.shared_chunk_s(model, slot)
                        n = chunk_tokens(lambda k: self.costs.prefill_s(model, k, c.prompt_tokens - c.prefill_left),
                                         budget, c.prefill_left)
                        yield model, c, min(c.prefill_left, n)
                    else:
                        yield model, c, c.prefill_left

    def chunk_budget_s(self, model: str, slot: Slot | None) -> float:
        """Eq. 4's slack while other work shares the instance; alone, Eq. 5's round cap (a
        driver stops a chunk early when a call arrives, so nothing waits for all of it)."""
        decodable, _ = self.split_running(model)
        if not decodable and not self.calls.queued_any():
            return self.config.round_cap_s
        return self.shared_chunk_s(model, slot)

    def shared_chunk_s(self, model: str, slot: Slot | None) -> float:
        if slot is not None and slot.model == model:
            return chunk_s(slot.plan)
        step = self.pricing.load(model).decode_step_s  # hot pool: the same rule, without a plan
        slack = self.config.tpot_target_s - step
        return slack if slack > 0 else step

    def chunk_cost(self, call: AgentCall, chunk: int) -> float:
        """Predicted time of one chunk of `call` (with its restore, on its first chunk)."""
        if call.first_chunk_at is None:
            left = call.prefill_left or compute_tokens(call, self.config.hkvr)
            if chunk >= left:
                return self.pricing.cost(call)
            restore, _ = prefill_terms(self.costs.base, call, self.config.hkvr)
            f = self.costs.factors.get(("prefill", call.model), 1.0)
            return (restore or 0.0) * f + self.pricing.left_cost(call, chunk, left)
        return self.pricing.left_cost(call, min(chunk, call.prefill_left))
