"""Hot pool: plain continuous batching of one pinned model (paper §3.1: hot instances never switch).

The part of `RoundScheduler` (scheduler.py) that decides a hot instance's next action: admit
queued calls at each decode boundary, continue chunked prefills, decode everything running.
A mixin, like `ColdPool`: it reads the scheduler's state and uses its helpers.
"""

from __future__ import annotations

from talaria.services.instance_agent.scheduler.admission import Limits, select
from talaria.services.instance_agent.scheduler.types import Action, Idle


class HotPool:
    def _next_hot(self, now: float) -> Action:
        """Prefill arrivals at each decode boundary, then decode everything running."""
        model = self.config.pinned_model
        assert model is not None
        running = self.calls.running_ids(model)
        decodable, filling = self._split_running(model)
        if self.calls.queued[model] and (self._hot_last != "P" or not running):
            limits = Limits(
                free_slots=self.config.max_batch - len(running),
                batch=self.config.max_batch,
                kv_free_bytes=self._kv_free(model),
                time_s=None,
            )
            selection = select(self.calls.queued[model].values(), limits, self._cost, self._kv)
            if selection.admitted:
                return self._start_prefill(selection, "hot", model, now)
        if filling and (not decodable or self._hot_last != "C"):
            return self._continue_prefill(filling, model)
        if decodable:
            return self._decode(decodable, model, None, now)
        return Idle(None)
