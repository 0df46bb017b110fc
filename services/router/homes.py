"""Where each live session lives: the instance that ran (or runs) its latest call.

A session is live on its home while one of its calls runs there, and after its last call
until it has been idle longer than `horizon_s` (the caller derives it from the tool gaps
the router measured): a session in a tool gap still belongs to that instance's load and
still brings its model back into that instance's rounds. Past the horizon it is taken
to have ended (an agent that returns later is simply live again).

Folded from `CallRouted`, call ends and instance losses, like the rest of `RouterState`,
and stored with it in the projection. Each routing into an instance prunes that
instance's expired entries, so the index holds the live sessions plus a few not yet
pruned, never the whole history; queries only read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Home:
    model: str
    last_s: float  # routed or ended at (the router's clock)
    running: int  # calls of the session in flight here


@dataclass
class HomeBook:
    by_instance: dict[str, dict[str, _Home]] = field(default_factory=dict)
    home_of: dict[str, str] = field(default_factory=dict)  # session -> instance

    def routed(self, session_id: str, instance_id: str, model: str, at: float) -> None:
        old = self.home_of.get(session_id)
        if old is not None and old != instance_id:
            self.by_instance.get(old, {}).pop(session_id, None)
        self.home_of[session_id] = instance_id
        homes = self.by_instance.setdefault(instance_id, {})
        h = homes.get(session_id)
        if h is None:
            homes[session_id] = _Home(model, at, 1)
        else:
            h.model, h.last_s, h.running = model, max(h.last_s, at), h.running + 1

    def ended(self, session_id: str, instance_id: str, at: float) -> None:
        """A call of the session ended on `instance_id` (completed or failed there)."""
        h = self.by_instance.get(instance_id, {}).get(session_id)
        if h is not None:
            h.running = max(0, h.running - 1)
            h.last_s = max(h.last_s, at)

    def to_list(self) -> list[list]:
        return [[s, i, h.model, h.last_s, h.running] for i, homes in self.by_instance.items() for s, h in homes.items()]

    @classmethod
    def from_list(cls, rows) -> HomeBook:
        book = cls()
        for session_id, instance_id, model, last_s, running in rows:
            book.by_instance.setdefault(instance_id, {})[session_id] = _Home(model, last_s, running)
            book.home_of[session_id] = instance_id
        return book

    def forget_instance(self, instance_id: str) -> None:
        """The agent process is gone, and its sessions' KV with it: they live nowhere."""
        for session_id in self.by_instance.pop(instance_id, {}):
            self.home_of.pop(session_id, None)

    def prune(self, instance_id: str, now: float, horizon_s: Callable[[str], float]) -> None:
        homes = self.by_instance.get(instance_id)
        if not homes:
            return
        gone = [s for s, h in homes.items() if not h.running and now - h.last_s > horizon_s(h.model)]
        for session_id in gone:
            del homes[session_id]
            del self.home_of[session_id]

    def live_models(self, instance_id: str, now: float, horizon_s: Callable[[str], float]) -> dict[str, int]:
        """Live sessions per model on the instance."""
        out: dict[str, int] = {}
        for h in self.by_instance.get(instance_id, {}).values():
            if h.running or now - h.last_s <= horizon_s(h.model):
                out[h.model] = out.get(h.model, 0) + 1
        return out
