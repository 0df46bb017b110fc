"""The runner's drops: never spend a step on work nobody waits for. Calls past their
deadline, calls the router declared lost with this process, calls the watchdog finds stuck
are taken out of the core and failed; engine entries nothing here runs are released.

A mixin of `CallRunner` (runner.py), like the scheduler's `ColdPool`: it reads the runner's
state (`calls`, `closing`, `core`, `engine`, `watchdog`) and uses its `_events`, `_fail`,
`_on_engine` and `publish_snapshot`.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from talaria.services.instance_agent.scheduler import SchedulerError
from talaria.shared.events import InstanceLost
from talaria.shared.nats_auth import trusted


class CallDrops:
    # ---- deadlines and lost placements: never run work nobody waits for --------------------

    def _next_deadline(self) -> float | None:
        return min((r.routed.call.deadline_at for r in self.calls.values() if r.routed.call.deadline_at),
                   default=None)

    async def _drop_expired(self, now: float) -> None:
        """Calls whose client stopped waiting (the deadline the gateway set has passed; it
        answered 504) are dropped before another step is spent on them, and recorded."""
        for call_id, running in list(self.calls.items()):
            deadline = running.routed.call.deadline_at
            if deadline and now >= deadline:
                await self._drop(call_id, f"dropped: its deadline passed {now - deadline:.1f}s ago "
                                          "(the client stopped waiting)", status=504, code="deadline_passed")

    async def on_instance_lost(self, msg) -> None:
        """The router declared this very process lost (heartbeats late) and failed its calls
        with 503: stop them here too, so none completes after its client was told to retry."""
        try:
            lost = msgspec.json.decode(msg.data, type=InstanceLost)
        except msgspec.DecodeError:
            return
        if not trusted(msg, lost) or lost.instance_id != self.instance_id or lost.incarnation != self.incarnation:
            return
        self.log.warning("the router declared this agent lost; dropping its calls", calls=len(lost.calls))
        for call_id in lost.calls:
            await self._drop(call_id, lost.reason, status=503, code="instance_lost")

    async def _drop(self, call_id: str, reason: str, *, status: int, code: str) -> None:
        if call_id not in self.calls:
            return
        self.calls[call_id].ending = True
        try:
            await self._events(self.core.abort(call_id, time.time()))
        except SchedulerError:
            self.core.forget(call_id)  # not (or no longer) in the scheduler
        try:
            await self._on_engine(self.engine.finish, call_id)  # release its pages if the engine holds it
        except Exception:
            pass
        await self._fail(call_id, reason, status=status, code=code)

    # ---- watchdog ----------------------------------------------------------------------

    async def watchdog_loop(self, stop: asyncio.Event) -> None:
        """Fail calls that stopped making progress; flag the agent unhealthy while an engine
        step is stuck, so the router stops choosing it (see watchdog.py)."""
        while not stop.is_set():
            try:
                await self.watch(time.time())
            except Exception:
                self.log.exception("watchdog check failed")
            try:
                await asyncio.wait_for(stop.wait(), self.settings.heartbeat_s)
            except TimeoutError:
                pass

    async def watch(self, now: float) -> None:
        verdict = self.watchdog.check(now)
        if verdict.unhealthy != self.unhealthy:
            (self.log.error if verdict.unhealthy else self.log.info)(
                "agent health changed", unhealthy=verdict.unhealthy or None)
            self.unhealthy = verdict.unhealthy
            await self.publish_snapshot()
        self.sweep_due = True  # each beat: an engine entry nothing here runs is released
        for call_id, why in verdict.fail_calls.items():
            if call_id not in self.calls:
                self.watchdog.call_done(call_id)
                continue
            self.calls[call_id].ending = True
            try:
                await self._events(self.core.abort(call_id, now))
            except SchedulerError:
                self.core.forget(call_id)  # already gone from the scheduler
            await self._fail(call_id, why)  # its engine state goes in the sweep before the next step

    async def _sweep(self) -> None:
        """Release every engine entry the scheduler no longer runs and no completion or cancel
        is finishing: its pages come back, and a switch is possible again (the engine refuses
        one while it holds any call). A call of the runner stranded that way is failed."""
        self.sweep_due = False

        def release() -> list[str]:  # on the engine thread: no step runs meanwhile
            freed = []
            for call_id in list(self.engine.running):
                running = self.calls.get(call_id)
                if call_id in self.sched.calls or call_id in self.closing or (running is not None and running.ending):
                    continue
                try:
                    self.engine.finish(call_id)
                except Exception:
                    pass
                freed.append(call_id)
            return freed

        for call_id in await self._on_engine(release):
            if call_id in self.calls:
                self.log.error("engine held a call the scheduler no longer runs; failing it", call_id=call_id)
                await self._fail(call_id, "the agent lost track of this call; retry it", status=503,
                                 code="instance_error")
