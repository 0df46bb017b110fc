"""Hot pool: plain continuous batching of one pinned model (paper §3.1: hot instances never switch).

A part of `RoundScheduler` (scheduler.py) that decides a hot instance's next action: admit
queued calls at each decode boundary, continue chunked prefills, decode everything running.
It owns what ran last; the call table, pricing and prefill parts are handed to it.
"""

from __future__ import annotations

from talaria.services.instance_agent.scheduler.admission import Limits, select
from talaria.services.instance_agent.scheduler.calls import CallTable
from talaria.services.instance_agent.scheduler.chunked_prefill import PrefillPlanner
from talaria.services.instance_agent.scheduler.config import ConfigReader, SharedConfig
from talaria.services.instance_agent.scheduler.types import Action, Decode, Idle
from talaria.services.instance_agent.scheduler.work_costs import WorkPricing


class HotPool(ConfigReader):
    def __init__(self, shared: SharedConfig, calls: CallTable, pricing: WorkPricing,
                 prefill: PrefillPlanner) -> None:
        self.shared, self.calls, self.pricing, self.prefill = shared, calls, pricing, prefill
        self.last = ""  # P | C (a prefill chunk) | D: what ran last

    def next_action(self, now: float, max_steps: int) -> Action:
        """Prefill arrivals at each decode boundary, then decode everything running."""
        model = self.config.pinned_model
        assert model is not None
        running = self.calls.running_ids(model)
        decodable, filling = self.prefill.split_running(model)
        if self.calls.queued[model] and (self.last != "P" or not running):
            limits = Limits(
                free_slots=self.config.max_batch - len(running),
                batch=self.config.max_batch,
                kv_free_bytes=self.pricing.kv_free(model),
                time_s=None,
            )
            selection = select(self.calls.queued[model], limits, self.pricing.cost, self.pricing.kv)
            if selection.admitted:
                return self.prefill.start(selection, "hot", model, now, None)
        if filling and (not decodable or self.last != "C"):
            return self.prefill.continue_prefill(filling, model, None)
        if decodable:
            return self._decode(decodable, model, max_steps)
        return Idle(None)

    def _decode(self, ids: tuple[str, ...], model: str, max_steps: int) -> Decode:
        """A Decode of up to `max_steps` iterations; one while arrivals wait for a boundary."""
        if max_steps == 1:
            return Decode(ids, model)
        k = min(max_steps, min(c.max_tokens - c.generated for c in map(self.calls.held, ids)))
        if self.calls.queued[model]:
            k = 1  # arrivals prefill at the next decode boundary
        return Decode(ids, model, max(1, k))
