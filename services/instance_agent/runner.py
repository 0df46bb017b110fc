"""CallRunner: the live executor of the agent core (agent_core.py) on the torch engine; the path of
one call through it: `CallRunner`. The simulator's `SimExecutor` (talaria/sim/executor.py) runs
the same core on a cost profile.

The scheduler is pure and the engine blocking: engine calls run on the single engine
thread (engine_thread.py), everything touching NATS stays on the event loop. A call's
JetStream message is acked only once its outcome is published, so a crashed agent's calls
are redelivered.

Read top to bottom: the parts the runner owns (`__init__`: the engine thread, engine_thread.py;
the steps, engine_steps.py; the closer, call_closing.py; the drops, call_drops.py), the loop
that drives them and acts on what they return (a `StepReport`, a watchdog verdict), then the
ways in (intake, cancels) and the snapshot. Only the closer calls back (`on_change`, calls
finished), as every path that publishes a report goes through it.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
from opentelemetry import trace

from talaria.services.instance_agent.call_closing import CallCloser
from talaria.services.instance_agent.call_drops import CallDrops
from talaria.services.instance_agent.call_transport import CallTransport
from talaria.services.instance_agent.agent_core import AgentCore, Phase, StepReport
from talaria.services.instance_agent.engine import EngineError
from talaria.services.instance_agent.engine_steps import EngineSteps
from talaria.services.instance_agent.engine_thread import EngineThread
from talaria.services.instance_agent.scheduler import (
    Decode,
    Idle,
    LinearCosts,
    Prefill,
    SchedulerError,
    SwitchModel,
)
from talaria.services import configs
from talaria.services.configs import Configuration
from talaria.services.instance_agent.telemetry import build_snapshot
from talaria.services.instance_agent.watchdog import Watchdog
from talaria.shared.bus import BUS_ERRORS
from talaria.shared.events import CallRouted
from talaria.shared.settings import AgentSettings, CommonSettings
from talaria.shared.attention_prior import attention_ratio
from talaria.shared.messages import CANCELLED_STATUS
from talaria.shared.tracing import execute_attributes, extract_context
from talaria.shared.wire import encode

ENDED_MEMORY = 10_000  # ended calls remembered, so a late copy of one is acked, never run again
SNAPSHOT_ON_CHANGE_MIN_S = 0.05  # besides the heartbeat, on change, at most this often

# Starting guesses for the tiny CPU models; CalibratedCosts corrects them from measurements.
INITIAL_COSTS = LinearCosts(prefill_tok_s=5_000.0, restore_tok_s=200_000.0, decode_base_s=0.005,
                            switch_staged_s=0.02, switch_host_s=0.05, kv_bytes_per_token=4096)


class CallRunner:
    """The live executor of the agent core; one call's path through it:

        routed call ──accept──▶ AgentCore.accept (→ RoundScheduler.submit; the call's AgentCall)
        loop: action = core.next_action(now)
              SwitchModel → engine.switch_to      → core.switch_done  → SwitchDone event
              Prefill     → engine.prefill(batch) → first tokens (stream), CallStarted
              Decode      → engine.decode(batch)  → next tokens (stream)
              Idle        → core.drain; wait for the next call
        outcome: finished call → engine.finish → core.completed → CallCompleted + reply + ack;
                 RoundSummary → event
    """

    def __init__(self, common: CommonSettings, settings: AgentSettings, engine, executor, nc, js,
                 tracer: trace.Tracer, log, configuration: Configuration | None = None) -> None:
        self.settings, self.engine = settings, engine
        self.models, self.deployment = common.models, common.deployment
        self.nc, self.js, self.tracer, self.log = nc, js, tracer, log
        self.instance_id = settings.instance_id
        # This process's identity in every snapshot: the router replaces a predecessor's view
        # at once, and calls placed on the predecessor are refused here (the router failed them).
        self.incarnation = uuid.uuid4().hex[:12]
        # the named configuration's scheduler on this engine (services/configs.py)
        self.configuration = configuration or configs.selected(common, ablation=settings.ablation)
        config = self.configuration.live_scheduler(engine.capabilities, settings.pool,
                                                   self.models[0] if settings.pool == "hot" else None)
        self.core = AgentCore(self.instance_id, config, list(self.models), INITIAL_COSTS,
                              keep_ended=ENDED_MEMORY,
                              attention_ratios={m: attention_ratio(s) for m, s in engine.specs.items()})
        self.wakeup = asyncio.Event()
        self.version = 0
        self.last_snapshot = 0.0
        watchdog = Watchdog(min_stuck_s=settings.watchdog_min_s)
        self.thread = EngineThread(engine, executor, watchdog)
        self.closer = CallCloser(self.core, self.thread, watchdog, nc, js, self.instance_id, log,
                                 on_change=self.snapshot_on_change, deployment=self.deployment)
        self.steps = EngineSteps(self.core, self.thread, self.closer, nc, js, self.instance_id, log,
                                 deployment=self.deployment)
        self.drops = CallDrops(self.core, self.closer, self.thread, watchdog, self.instance_id, self.incarnation, log)
        # KV migration (kv_migration.py): set by the service once the page server runs
        self.migration = None

    # ---- the scheduling loop -----------------------------------------------------------

    async def work_loop(self, stop: asyncio.Event) -> None:
        """One action at a time: drop what nobody waits for, ask the core for the next action,
        run it on its part, publish the report it returns."""
        while not stop.is_set():
            try:
                await self.drops.drop_expired(time.time())
            except Exception:
                self.log.exception("dropping expired calls failed")
            try:
                action = self.core.next_action(time.time())
            except Exception:  # a scheduler bug: keep the loop (the agent) alive, retry next beat
                self.log.exception("scheduler failed to choose an action")
                await self._wait(stop, time.time() + self.settings.heartbeat_s)
                continue
            self.thread.expect(self.core.live_calls(getattr(action, "call_ids", ())), self.core.sched.estimate_s(action))
            try:
                match action:
                    case Idle():
                        # Clear first: a call accepted while the events below are published
                        # must still wake us.
                        self.wakeup.clear()
                        await self.closer.events(self.core.drain(time.time()))
                        await self._wait(stop, _earliest(action.until, self.drops.next_deadline()))
                        continue
                    case SwitchModel():
                        report = await self.steps.switch(action)
                        await self.publish_snapshot()  # the router learns the new active model now
                    case Prefill():
                        report = await self.steps.prefill(action)
                    case Decode():
                        report = await self.steps.decode(action)
            except EngineError as exc:
                report = await self.steps.failed(action, exc)
            except Exception as exc:  # a bug or a NATS failure: fail this action's calls, keep serving
                self.log.exception("step failed", action=type(action).__name__)
                report = await self.steps.failed(action, exc)
            try:
                await self.closer.events(report)
            except Exception:
                self.log.exception("publishing scheduler events failed")

    async def _wait(self, stop: asyncio.Event, until: float | None) -> None:
        timeout = None if until is None else max(0.0, until - time.time())
        waiters = [asyncio.ensure_future(self.wakeup.wait()), asyncio.ensure_future(stop.wait())]
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()

    async def watchdog_loop(self, stop: asyncio.Event) -> None:
        """Fail calls that stopped making progress; flag the agent unhealthy while an engine
        step is stuck, so the router stops choosing it (see watchdog.py)."""
        while not stop.is_set():
            try:
                now = time.time()
                verdict, health_changed = self.drops.judge(now)
                if health_changed:
                    await self.publish_snapshot()
                await self.drops.fail_stuck(verdict, now)
            except Exception:
                self.log.exception("watchdog check failed")
            try:
                await asyncio.wait_for(stop.wait(), self.settings.heartbeat_s)
            except TimeoutError:
                pass

    # ---- intake ------------------------------------------------------------------------

    def holds(self, call_id: str) -> bool:
        """Whether a copy of this call needs nothing more: it is queued, running, finishing or
        finished here."""
        known = self.core.calls.get(call_id)
        return known is not None and known.phase is not Phase.CANCELLED

    def accept(self, routed: CallRouted, msg, headers=None, migrated=None, span=None) -> str | None:
        """Queue a routed call; returns why it was refused, or None when accepted. `msg` is
        its JetStream message, or None for the router's core-NATS fast copy (`headers` its
        trace context); the call starts from whichever comes first."""
        call = routed.call
        if call.model not in self.models:
            return f"this instance does not serve {call.model}"
        known = self.core.calls.get(call.call_id)
        if known is not None and known.phase in (Phase.QUEUED, Phase.RUNNING, Phase.CLOSING):
            if msg is not None:  # the durable copy of a call started from its fast copy, or a copy
                known.transport.msg = msg  # redelivered (a rebuilt consumer): the latest is acked at the end
            return None  # redelivered while still here: keep running the first
        if known is not None and known.phase is Phase.FINISHED:
            if msg is not None:
                asyncio.ensure_future(msg.ack())
            return None
        if known is not None and known.phase is Phase.CANCELLED and known.tenant == call.tenant:
            # cancelled before it arrived: recorded, never scheduled
            self.core.record(call.call_id, call.session_id, call.model, call_index=routed.call_index,
                             submitted_at=call.submitted_at, tenant=call.tenant,
                             transport=CallTransport(routed, msg, self.tracer.start_span("execute")))
            asyncio.ensure_future(self._cancelled(call.call_id, known.cancel_reason))
            return None
        if routed.incarnation and routed.incarnation != self.incarnation:
            return (f"placed on a previous process of {self.instance_id}, which stopped before running it; "
                    "retry the call")
        kv_state, reusable = self.thread.view.reusable(call.session_id, call.model, call.prompt_tokens, call.prompt_ids)
        if (routed.kv_from_address and self.migration is not None and self.configuration.scheduler.migrate
                and kv_state == "none"):
            # The router priced pulling the pages below recompute: pull, then accept. Until
            # then the call is recorded (a copy arriving meanwhile is kept out, a cancel ends the pull).
            transport = CallTransport(routed, msg, self.tracer.start_span(
                "execute", context=extract_context(headers or getattr(msg, "headers", None)),
                attributes=execute_attributes(call, self.instance_id)))
            self.core.record(call.call_id, call.session_id, call.model, call_index=routed.call_index,
                             submitted_at=call.submitted_at, tenant=call.tenant, transport=transport)
            transport.pull = asyncio.ensure_future(self._pull_then_accept(routed, transport))
            return None
        if migrated is None and kv_state == "host" and self.migration is not None:
            # a drain pushed its pages here ahead of this call: it restores them as migrated
            migrated = self.migration.pushed.pop((call.session_id, call.model), None)
        try:
            self.core.accept(call.call_id, call.session_id, call.model, call_index=routed.call_index,
                             prompt_tokens=call.prompt_tokens, max_tokens=call.max_tokens,
                             submitted_at=call.submitted_at, kv_state=kv_state, reusable_tokens=reusable,
                             now=time.time(), tenant=call.tenant, kv_output_tokens=routed.kv_output_tokens)
        except SchedulerError as exc:
            self.log.warning("scheduler refused call", call_id=call.call_id, error=str(exc))
            return f"the instance cannot schedule this call: {exc}"
        span = span or self.tracer.start_span("execute", context=extract_context(headers or getattr(msg, "headers", None)),
                                              attributes=execute_attributes(call, self.instance_id))
        self.core.calls[call.call_id].transport = CallTransport(routed, msg, span, migrated=migrated)
        if migrated is not None:
            span.set_attribute("talaria.kv_pulled_tokens", migrated.tokens)
        self.thread.arrived.set()
        self.wakeup.set()
        return None

    async def _pull_then_accept(self, routed: CallRouted, transport: CallTransport) -> None:
        call_id = routed.call.call_id
        try:
            migrated = await self.migration.pull_into(routed)
        except asyncio.CancelledError:
            return  # cancelled with its call (cancel() closed it)
        except Exception as exc:  # the pull is an optimisation: the call recomputes
            self.log.warning("kv pull failed", call_id=call_id, error=str(exc))
            migrated = None
        known = self.core.calls.get(call_id)
        if known is None or known.transport is not transport or known.phase is not Phase.QUEUED:
            return  # it ended meanwhile (cancelled, or dropped)
        self.core.forget(call_id)  # the record stood in for it during the pull; now it is scheduled
        refused = self.accept(msgspec.structs.replace(routed, kv_from_address=""), transport.msg,
                              migrated=migrated if migrated is not None and migrated.tokens else None,
                              span=transport.span)
        if refused is not None:  # answered as a refusal on arrival would have been
            call = routed.call
            self.core.record(call_id, call.session_id, call.model, call_index=routed.call_index,
                             submitted_at=call.submitted_at, tenant=call.tenant, transport=transport)
            await self.closer.fail(call_id, refused, status=503, code="not_served")

    async def cancel(self, call_id: str, reason: str, tenant: str = "") -> None:
        """Abort a call of `tenant`: out of the scheduler, its engine state released (its KV
        stays as the session's cache), recorded as cancelled. A call not here yet is refused
        on arrival if it is that tenant's. Another tenant's call is left alone."""
        known = self.core.calls.get(call_id)
        if known is not None and known.phase in (Phase.CLOSING, Phase.FINISHED):
            return  # its outcome is out (or going out)
        if known is None or known.phase is Phase.CANCELLED:
            self.core.cancel_early(call_id, reason, tenant)
            return
        if known.tenant != tenant:
            self.log.warning("cancel from another tenant ignored", call_id=call_id)
            return
        report = StepReport()
        try:
            report = self.core.abort(call_id, time.time())
        except SchedulerError:
            pass  # not in the scheduler (refused or already finishing)
        await self._cancelled(call_id, reason)
        await self.closer.events(report)  # abort drains the scheduler's outbox: publish what was in it

    async def _cancelled(self, call_id: str, reason: str) -> None:
        call = self.core.live_call(call_id)
        if call is None:
            return
        if call.transport.in_engine:  # after any step in flight: the engine thread runs one thing at a time
            await self.thread.release(call.transport.seq)
            call.transport.in_engine = False
        await self.closer.fail(call_id, f"cancelled: {reason}", status=CANCELLED_STATUS, code="cancelled")
        self.wakeup.set()

    # ---- telemetry ---------------------------------------------------------------------

    async def publish_snapshot(self) -> None:
        self.version += 1
        self.last_snapshot = time.monotonic()
        snap = msgspec.structs.replace(
            build_snapshot(self.settings, self.models, self.thread.view, self.engine.specs, self.core, self.version,
                           time.time(), unhealthy=self.drops.unhealthy, staging=self.configuration.scheduler.staging,
                           migration=self.migration),
            incarnation=self.incarnation)
        try:
            await self.nc.publish(self.deployment.telemetry(self.instance_id), encode(snap))
        except BUS_ERRORS as exc:  # NATS down or slow: the next beat retries
            self.log.warning("snapshot failed", error=str(exc))

    async def snapshot_on_change(self) -> None:
        """Calls finished: the router learns of freed capacity and new session KV now (besides
        the heartbeat, at most every SNAPSHOT_ON_CHANGE_MIN_S)."""
        if time.monotonic() - self.last_snapshot >= SNAPSHOT_ON_CHANGE_MIN_S:
            await self.publish_snapshot()

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.publish_snapshot()
            try:
                await asyncio.wait_for(stop.wait(), self.settings.heartbeat_s)
            except TimeoutError:
                pass


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
