"""Chunked prefill: how many prompt tokens the next chunk computes, and what it costs.

The part of `RoundScheduler` (scheduler.py) that splits long prompts into chunks sized from
the slot's budget (Eq. 4's slack while other work shares the instance, Eq. 5's round cap
alone), and predicts the cost of a chunk and the prefill a newcomer waits behind. A mixin,
like `ColdPool`: it reads the scheduler's state and uses its cost helpers (work_costs.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from talaria.services.instance_agent.scheduler.budget import chunk_s, chunk_tokens
from talaria.services.instance_agent.scheduler.calls import CallState
from talaria.services.instance_agent.scheduler.types import Prefill
from talaria.services.instance_agent.scheduler.work_costs import compute_tokens, prefill_terms


class ChunkedPrefill:
    def _split_running(self, model: str) -> tuple[tuple[str, ...], tuple[CallState, ...]]:
        """(running calls that decode, running calls still prefilling), admission order."""
        running = self.calls.running[model]
        if not self.config.chunked_prefill:
            return tuple(running), ()
        filling = tuple(c for c in running.values() if c.prefilling)
        if not filling:
            return tuple(running), ()
        return tuple(i for i, c in running.items() if not c.prefilling), filling

    def _continue_prefill(self, calls: tuple[CallState, ...], model: str) -> Prefill:
        chunk, per_pass = self._chunk_for(model, calls)
        return Prefill(tuple(c.call_id for c in calls), model=model, chunk_tokens=chunk, pass_tokens=per_pass)

    def _chunk_for(self, model: str, calls: Iterable[CallState]) -> tuple[int, int]:
        """(tokens per call of the next prefill chunk, tokens per call per forward pass).
        A chunk that covers every prompt still counts as one: the driver ends it early when
        a call arrives, after the pass in flight, so a pass is sized like a shared chunk."""
        if not self.config.chunked_prefill:
            return 0, 0
        calls = list(calls)
        longest = max((c.prefill_left for c in calls), default=0)
        ctx = max(c.work.prompt_tokens - c.prefill_left for c in calls)

        def fits(budget: float) -> int:
            return chunk_tokens(lambda k: len(calls) * self.costs.prefill_s(model, k, ctx), budget, longest)

        budget, shared = self._chunk_budget_s(model), self._shared_chunk_s(model)
        chunk = fits(budget)
        return chunk, (chunk if budget == shared else min(chunk, fits(shared)))

    def prefill_ahead_tokens(self) -> int:
        """Prompt tokens a call arriving now waits behind: every queued prompt, and of each
        prefill under way what runs before the newcomer gets in. Without chunking that is
        all it has left; with chunking, at most one shared-instance chunk."""
        calls = self.calls
        ahead = sum(c.work.prompt_tokens for q in calls.queued.values() for c in q.values())
        return ahead + sum(n for _, _, n in self._prefill_under_way())

    def prefill_ahead_s(self) -> float:
        """The same work in predicted seconds: what each queued call must compute (a prefix
        on device costs nothing, a host prefix its restore), with the calibrated costs."""
        calls = self.calls
        ahead = sum(self._cost(c) for q in calls.queued.values() for c in q.values())
        for model, c, n in self._prefill_under_way():
            ahead += self.costs.prefill_s(model, n, c.work.prompt_tokens - c.prefill_left)
        return ahead

    def _prefill_under_way(self):
        """(model, call, prompt tokens a newcomer waits for) of each admitted call still prefilling."""
        for model, running in self.calls.running.items():
            for c in running.values():
                if c.prefilling and c.prefill_left:
                    if self.config.chunked_prefill:
                        budget = self._shared_chunk_s(model)
                        n = chunk_tokens(lambda k: self.costs.prefill_s(model, k, c.work.prompt_tokens - c.prefill_left),
                                         budget, c.prefill_left)
                        yield model, c, min(c.prefill_left, n)
                    else:
                        yield model, c, c.prefill_left

    def _chunk_budget_s(self, model: str) -> float:
        """Eq. 4's slack while other work shares the instance; alone, Eq. 5's round cap (a
        driver stops a chunk early when a call arrives, so nothing waits for all of it)."""
        decodable, _ = self._split_running(model)
        if not decodable and not self.calls.queued_any():
            return self.config.round_cap_s
        return self._shared_chunk_s(model)

    def _shared_chunk_s(self, model: str) -> float:
        slot = self.slot
        if slot is not None and slot.model == model:
            return chunk_s(slot.plan)
        step = self._load(model).decode_step_s  # hot pool: the same rule, without a plan
        slack = self.config.tpot_target_s - step
        return slack if slack > 0 else step

    def _chunk_cost(self, call: CallState, chunk: int) -> float:
        """Predicted time of one chunk of `call` (with its restore, on its first chunk)."""
        if call.first_chunk_at is None:
            left = call.prefill_left or compute_tokens(call.work, self.config.hkvr)
            if chunk >= left:
                return self._cost(call)
            restore, _ = prefill_terms(self.costs.base, call.work, self.config.hkvr)
            f = self.costs.factors.get(("prefill", call.work.model), 1.0)
            return (restore or 0.0) * f + self._left_cost(call, chunk, left)
        return self._left_cost(call, min(chunk, call.prefill_left))

    def _left_cost(self, call: CallState, tokens: int, left: int | None = None) -> float:
        left = call.prefill_left if left is None else left
        return self.costs.prefill_s(call.work.model, max(1, tokens), max(0, call.work.prompt_tokens - left))
