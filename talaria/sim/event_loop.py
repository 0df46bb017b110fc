"""The event loop: a heap of (time, seq, handler, args) on a virtual clock.

Handlers are called as `handler(now, *args)` and return the events they cause as an
iterable of `(time, handler, args)` tuples (vidur style: time is explicit, nothing sleeps).
Ties run in insertion order (`seq`), so a run is deterministic for a given input and seed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

Handler = Callable[..., Iterable["Scheduled"] | None]
Scheduled = tuple[float, Handler, tuple[Any, ...]]


PAST_TOLERANCE_S = 1e-6  # far below any action's duration, far above float rounding at 1e6 s


class EventLoop:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Handler, tuple[Any, ...]]] = []
        self._seq = 0
        self.now = 0.0
        self.events = 0

    def push(self, time: float, handler: Handler, args: tuple[Any, ...] = ()) -> None:
        if time < self.now:
            # A time computed along another sum of the same durations can round below now
            # (seen: 3.5e-10 s, 8-seed matrix); it means now. Anything more is a real bug.
            if self.now - time > PAST_TOLERANCE_S:
                raise ValueError(f"event at {time} is in the past (now {self.now})")
            time = self.now
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, handler, args))

    def run(self, until: float | None = None, progress: Callable[[float, int], None] | None = None,
            stop: Callable[[], bool] | None = None) -> None:
        """Run events in time order; `stop()` is polled every 4,096 events and ends the run
        early when it returns True (a wall-clock cap; the remaining events stay queued)."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            if stop is not None and not self.events & 0xFFF and stop():
                break
            if until is not None and heap[0][0] > until:
                break
            time, _, handler, args = pop(heap)
            self.now = time
            self.events += 1
            out = handler(time, *args)
            if out:
                for t2, h2, a2 in out:
                    self.push(t2, h2, a2)
            if progress is not None and not self.events & 0xFFFF:
                progress(time, self.events)
