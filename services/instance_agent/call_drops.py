"""The runner's drops: never spend a step on work nobody waits for. Calls past their
deadline, calls the router declared lost with this process, calls the watchdog finds stuck
are taken out of the core and failed.

A part of `CallRunner` (runner.py): it owns the watchdog's verdicts and the health flag the
heartbeat carries (the runner publishes a change); the calls are the core's, their failure the
closer's.
"""

from __future__ import annotations

import time

import msgspec

from talaria.services.instance_agent.call_closing import CallCloser
from talaria.services.instance_agent.agent_core import AgentCore
from talaria.services.instance_agent.engine_thread import EngineThread
from talaria.services.instance_agent.scheduler import SchedulerError
from talaria.services.instance_agent.scheduler.calls import AgentCall
from talaria.services.instance_agent.scheduler.work_costs import compute_tokens
from talaria.services.instance_agent.watchdog import Verdict, Watchdog
from talaria.shared.events import DEADLINE_UNREACHABLE, InstanceLost
from talaria.shared.nats_auth import trusted


# A prefill is judged only after this much of it ran: its measured rate is then more than
# the first chunk, and a chunk still in flight skews it little.
JUDGE_AFTER_S = 2.0


def prefill_left_s(call: AgentCall, hkvr: bool, now: float) -> float | None:
    """The rest of a chunked prefill under way at the rate measured on it so far: a floor on
    what it needs (later chunks attend over more context), None before it can be judged.
    Measured from its first chunk, or from the last chunk it waited through behind another
    call's prefill (`AgentCall.paced_from`): that wait says nothing of its own pace."""
    if call.first_chunk_at is None or not call.prefill_left:
        return None
    since, left = call.paced_from or (call.first_chunk_at, compute_tokens(call, hkvr))
    done = left - call.prefill_left
    if now - since < JUDGE_AFTER_S or done <= 0:
        return None
    return call.prefill_left * (now - since) / done


class CallDrops:
    def __init__(self, core: AgentCore, closer: CallCloser, thread: EngineThread, watchdog: Watchdog,
                 instance_id: str, incarnation: str, log) -> None:
        self.core, self.closer, self.thread, self.watchdog = core, closer, thread, watchdog
        self.instance_id, self.incarnation, self.log = instance_id, incarnation, log
        self.unhealthy = ""  # why new calls should go elsewhere (heartbeat flag); "" when healthy

    # ---- deadlines and lost placements: never run work nobody waits for --------------------

    def next_deadline(self) -> float | None:
        return min((c.transport.routed.call.deadline_at for c in self.core.live()
                    if c.transport.routed.call.deadline_at), default=None)

    async def drop_expired(self, now: float) -> None:
        """Calls whose client stopped waiting (the deadline the gateway set has passed; it
        answered 504) are dropped before another step is spent on them, and recorded. So is a
        prefill that, at the rate measured on it, cannot end before its deadline: it would hold
        the instance for an answer nobody reads (the router's linear estimate let it in)."""
        hkvr = self.core.sched.config.hkvr
        for call in list(self.core.live()):
            deadline = call.transport.routed.call.deadline_at
            if deadline and now >= deadline:
                await self.drop(call.call_id, f"dropped: its deadline passed {now - deadline:.1f}s ago "
                                              "(the client stopped waiting)", status=504, code="deadline_passed")
            elif deadline and (left := prefill_left_s(call, hkvr, now)) is not None and now + left > deadline:
                await self.drop(call.call_id, f"deadline: its prefill needs at least {left:.0f}s more at the rate "
                                              f"measured on it ({call.prefill_left} prompt tokens left), past its "
                                              f"deadline in {deadline - now:.0f}s; shorten the prompt or raise the "
                                              "call timeout", status=DEADLINE_UNREACHABLE, code="deadline_unreachable")

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
            await self.drop(call_id, lost.reason, status=503, code="instance_lost")

    async def drop(self, call_id: str, reason: str, *, status: int, code: str) -> None:
        call = self.core.live_call(call_id)
        if call is None:
            return
        try:
            await self.closer.events(self.core.abort(call_id, time.time()))
        except SchedulerError:
            pass  # not (or no longer) in the scheduler
        if call.transport.in_engine:
            await self.thread.release(call.transport.seq)  # its pages back before its client hears
            call.transport.in_engine = False
        await self.closer.fail(call_id, reason, status=status, code=code)

    # ---- watchdog ----------------------------------------------------------------------

    def judge(self, now: float) -> tuple[Verdict, bool]:
        """The watchdog's verdict at `now`, and whether the agent's health changed with it
        (the flag the heartbeat carries is updated: the router should hear of it now)."""
        verdict = self.watchdog.check(now, self.core.live())
        changed = verdict.unhealthy != self.unhealthy
        if changed:
            (self.log.error if verdict.unhealthy else self.log.info)(
                "agent health changed", unhealthy=verdict.unhealthy or None)
            self.unhealthy = verdict.unhealthy
        return verdict, changed

    async def fail_stuck(self, verdict: Verdict, now: float) -> None:
        """Fail the calls the verdict found stuck (each once)."""
        for call in verdict.fail_calls:
            if not call.live:  # it ended while an earlier one was failed
                continue
            reason = call.transport.stuck
            try:
                await self.closer.events(self.core.abort(call.call_id, now))
            except SchedulerError:
                pass  # already gone from the scheduler
            await self.closer.fail(call.call_id, reason)  # its engine state goes once the stuck step returns
