"""The one worker thread every engine call runs on (the engine is blocking torch code and not
thread-safe), the view the engine publishes after each piece of work, and the watchdog's view
of the step in flight.

The engine is an actor: the loop hands it work (`run`, `call`, `release`) and reads only the
`EngineView` it published last (engine_view.py), never its tables (a lint fails on code that
does: tests/unit/agent/test_agent_engine_owner.py). Work runs in submission order, so a release
queued now runs after the step in flight and before any step the loop issues later."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Executor

from talaria.services.instance_agent.engine.contract import Engine, Sequence
from talaria.services.instance_agent.engine.engine_errors import EngineError
from talaria.services.instance_agent.engine_view import EngineView, view_of
from talaria.services.instance_agent.scheduler.calls import AgentCall
from talaria.services.instance_agent.watchdog import Watchdog


class EngineThread:
    def __init__(self, engine: Engine, executor: Executor | None, watchdog: Watchdog) -> None:
        self.engine, self.executor, self.watchdog = engine, executor, watchdog
        # Set when a call arrives: a chunked prefill in flight ends at its next forward pass.
        self.arrived = threading.Event()
        engine.should_yield = self.arrived.is_set
        self.step_calls: tuple[AgentCall, ...] = ()  # the calls of the loop's step in flight
        self.step_predicted_s = 0.0  # the scheduler's estimate of that step (for the watchdog)
        self._frozen: dict = {}  # view_of's copies of held token lists, kept between views
        # No work was handed to the engine yet: its first view is read here.
        self.view: EngineView = view_of(engine, self._frozen)

    def expect(self, calls: tuple[AgentCall, ...], predicted_s: float) -> None:
        """The loop's next step: its calls and the scheduler's estimate of it."""
        self.step_calls, self.step_predicted_s = calls, predicted_s

    async def run(self, fn, *args, kind: str | None = None):
        """An engine step of the work loop, timed by the watchdog."""
        self.watchdog.step_started(kind or fn.__name__, self.step_calls, time.time(), self.step_predicted_s)
        try:
            return await self.call(fn, *args)
        finally:
            self.watchdog.step_ended(time.time())

    async def call(self, fn, *args):
        """On the engine thread, after anything queued before (cancels and drops: not a step of
        the loop, so the watchdog's view of the step in flight stays whole)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._then_publish, fn, *args)

    def _then_publish(self, fn, *args):
        """On the engine thread: `fn`, then the view it leaves published (also when it raised)."""
        try:
            return fn(*args)
        finally:
            self.view = view_of(self.engine, self._frozen)

    async def release(self, seq: Sequence) -> None:
        """Release what the engine holds of a call, if anything (its KV stays as the session's cache)."""
        try:
            await self.call(self.engine.finish, seq)
        except EngineError:
            pass  # the engine never admitted it (UnknownCall), or released it already

    def release_soon(self, seq: Sequence) -> None:
        """`release`, queued now without waiting: it runs once the step in flight (even a stuck
        one) returns, before the next."""
        asyncio.get_running_loop().run_in_executor(self.executor, self._then_publish, self._finish_quietly, seq)

    def _finish_quietly(self, seq: Sequence) -> None:
        try:
            self.engine.finish(seq)
        except EngineError:
            pass  # as in `release`
