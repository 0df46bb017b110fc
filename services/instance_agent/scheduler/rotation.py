"""The order a cold instance's rounds visit its models: all of them cyclically after the one
on the device, and of those the ones with work. A part of `RoundScheduler` (scheduler.py),
handed the models and the call table; it owns the memo of each rotation."""

from __future__ import annotations

from talaria.services.instance_agent.scheduler.calls import CallTable


class Rotation:
    def __init__(self, models: tuple[str, ...], calls: CallTable) -> None:
        self.models, self.calls = models, calls
        self._rotations: dict[str | None, tuple[str, ...]] = {}  # by `after`, memoised

    def rotation(self, after: str | None) -> list[str]:
        """All models in cyclic order, starting after `after` and ending with it."""
        return list(self._rotation(after))

    def _rotation(self, after: str | None) -> tuple[str, ...]:
        rot = self._rotations.get(after)
        if rot is None:
            if after is None:
                rot = self.models
            else:
                i = self.models.index(after)
                rot = self.models[i + 1 :] + self.models[: i + 1]
            self._rotations[after] = rot
        return rot

    def active_in_rotation(self, after: str | None) -> list[str]:
        """`rotation(after)` restricted to models with a queued or running call."""
        calls = self.calls
        if not calls.any_active():
            return []
        return [m for m in self._rotation(after) if calls.live(m)]
