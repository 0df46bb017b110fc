"""The runner's engine steps: each scheduler action run on the engine thread, and what it
gives back to the core (first and next tokens, streamed; a switch record; a failed step).

A part of `CallRunner` (runner.py) that owns no call state: it reads the calls from the core's
table, hands the engine each call's `Sequence` (built here at its first prefill, kept on its
transport) and finished and failed calls to the closer (call_closing.py).
"""

from __future__ import annotations

import asyncio
import time

from talaria.services.instance_agent.call_closing import CallCloser
from talaria.services.instance_agent.agent_core import AgentCore, Phase, StepReport
from talaria.services.instance_agent.engine import EngineBusy, EngineError, SamplingParams, Sequence
from talaria.services.instance_agent.engine_thread import EngineThread
from talaria.services.instance_agent.scheduler import Decode, Prefill, SchedulerError, SwitchModel
from talaria.shared.subjects import Deployment
from talaria.shared.bus import emit
from talaria.shared.events import CallRouted, CallStarted
from talaria.shared.messages import TokenChunk
from talaria.shared.nats_auth import sender_headers
from talaria.shared.wire import encode


class EngineSteps:
    def __init__(self, core: AgentCore, thread: EngineThread, closer: CallCloser, nc, js, instance_id: str, log,
                 deployment: Deployment) -> None:
        self.core, self.thread, self.closer = core, thread, closer
        self.engine = thread.engine
        self.nc, self.js, self.instance_id, self.log = nc, js, instance_id, log
        self.deployment = deployment

    async def switch(self, action: SwitchModel) -> StepReport:
        """The switch, its SwitchDone stored; the runner then tells the router (a snapshot)."""
        record = await self.thread.run(self.engine.switch_to, action.to_model)
        # An engine that can time its prefill does so the first time a model is active
        # (torch: engine/prefill_probe.py); the others' slope starts from the prior.
        probed = await self.thread.run(self.engine.probe_prefill)
        if probed is not None:
            self.core.prefill_probed(*probed)
        report = self.core.switch_done(action, time.time(), record.total_s, path=record.path,
                                       phases=record.phases(), bytes_staged=record.bytes_staged,
                                       bytes_uncovered=record.bytes_uncovered)
        await self.closer.sender.note(report.switch)
        report.switch = None
        return report

    async def prefill(self, action: Prefill) -> StepReport:
        new, more = [], []
        started = time.time()
        calls = self.core.live_calls(action.call_ids)  # the others were cancelled while queued for it
        for call in calls:
            transport = call.transport
            if transport.in_engine:
                more.append(transport.seq)  # chunked prefill: this call's next chunk
                continue
            routed = transport.routed.call
            transport.seq = _sequence(transport.routed, transport.migrated.tokens if transport.migrated else 0)
            new.append(transport.seq)
            transport.in_engine = True
            transport.span.add_event("prefill_start", {"session_prefill": action.session_prefill})
            # Published while the prefill runs: it is a progress marker (the projector keeps a
            # final outcome over it whatever the order), and awaited before the call's outcome.
            transport.started_pub = asyncio.ensure_future(
                emit(self.js, CallStarted(call.call_id, routed.session_id, self.instance_id, started)))
        self.thread.arrived.clear()
        steps = await self._step(self.engine.prefill, more + new, new, action.chunk_tokens, more, action.pass_tokens)
        firsts = [s.call_id for s in steps]
        # What each call the engine still holds has left of its prompt (a chunk may end early).
        left = {c.call_id: c.transport.seq.prompt_left for c in calls
                if c.transport.in_engine} if action.chunk_tokens else None
        return self.core.prefill_done(action, time.time(), await self._tokens(steps), first_tokens=firsts,
                                      prompt_left=left)

    async def decode(self, action: Decode) -> StepReport:
        seqs = [c.transport.seq for c in self.core.live_calls(action.call_ids)]
        steps = await self._step(self.engine.decode, seqs, seqs)
        stepped = {s.call_id for s in steps}
        stalled = [c for c in action.call_ids if c not in stepped]  # no KV page for them yet
        return self.core.decode_done(action, time.time(), await self._tokens(steps), stalled=stalled)

    async def _step(self, step, seqs: list[Sequence], *args):
        """An engine step (prefill or decode) over `seqs`; the calls it finished are released
        on the engine thread in the same trip, so completing them costs no second hand-off."""
        steps, released = await self.thread.run(self._step_and_release, step, seqs, *args, kind=step.__name__)
        for seq, outcome in released:
            call = self.core.live_call(seq.call_id)
            if call is not None:
                call.transport.released, call.transport.in_engine = outcome, False
        return steps

    def _step_and_release(self, step, seqs: list[Sequence], *args):
        """On the engine thread: the step, then each call it finished released ((its
        sequence, True), or the EngineError releasing it raised)."""
        steps = step(*args)
        released = []
        for seq in seqs:
            if seq.finished:  # it ended in this step (a finished call cannot step)
                try:
                    self.engine.finish(seq)
                    released.append((seq, True))
                except EngineError as exc:
                    released.append((seq, exc))
        return steps, released

    async def _tokens(self, steps) -> set[str]:
        finished = set()
        for step in steps:
            call = self.core.live_call(step.call_id)
            if call is None:
                continue
            transport, routed = call.transport, call.transport.routed.call
            if step.logprob is not None and routed.stream:
                transport.logprobs.append(step.logprob)
            if step.text and routed.stream:
                # A chunk carries the logprobs of the tokens since the last one (text held back
                # for a stop string releases several tokens' text at once).
                lps, transport.logprobs = transport.logprobs or None, []
                await self.nc.publish(self.deployment.tokens(routed.tenant, step.call_id),
                                      encode(TokenChunk(step.call_id, transport.streamed, step.text, logprobs=lps)),
                                      headers=sender_headers(self.nc))
                transport.streamed += 1
            if step.finished:
                finished.add(step.call_id)
        return finished

    async def failed(self, action, exc: Exception) -> StepReport:
        """Fail the calls `action` was for (their engine state is released by the closer) and
        end the action in the scheduler (else it waits for it forever and the agent stops
        working). A switch refused because the engine still holds calls none of which runs
        here any more releases them and is tried again; another failed switch fails the calls
        that were waiting for it."""
        self.log.error("engine step failed", action=type(action).__name__, error=str(exc))
        report = StepReport()
        failed = list(getattr(action, "call_ids", ()))
        if isinstance(action, SwitchModel) and isinstance(exc, EngineBusy):
            await self._release_strays(exc.running)
        elif isinstance(action, SwitchModel):
            failed = [c.call_id for c in self.core.calls.queued.get(action.to_model, ())]
        for call_id in failed:
            try:
                report.merge(self.core.abort(call_id, time.time()))
            except SchedulerError:
                pass  # already gone from the scheduler
            try:
                await self.closer.fail(call_id, f"engine error: {exc}")
            except Exception:  # e.g. NATS down: the loop must go on regardless
                self.log.exception("failing a call failed", call_id=call_id)
        if self.core.sched.inflight is action:  # not when it failed after the scheduler heard it done
            report.merge(self.core.action_failed(action, time.time()))
        return report

    async def _release_strays(self, held: list[Sequence]) -> None:
        """The engine handed back the calls it holds: those the call table says are not
        running here (ended, or never known) are released. One still closing keeps its entry:
        its completion releases it."""
        for seq in held:
            call = self.core.calls.get(seq.call_id)
            if call is None or call.phase in (Phase.FINISHED, Phase.CANCELLED):
                if call is None:
                    self.log.error("the engine held a call this agent does not know; releasing it",
                                   call_id=seq.call_id)
                await self.thread.release(seq)


def _sequence(routed: CallRouted, migrated_tokens: int = 0) -> Sequence:
    """The engine's record of a routed call: its request and sampling parameters."""
    call = routed.call
    params = SamplingParams(temperature=call.temperature, top_p=call.top_p, seed=call.seed, stop=tuple(call.stop),
                            logit_bias=call.logit_bias, logprobs=call.logprobs, top_logprobs=call.top_logprobs)
    return Sequence(call.call_id, call.session_id, call.model, list(call.prompt_ids), call.max_tokens, params,
                    kv_scope=call.kv_scope, kv_output_tokens=routed.kv_output_tokens,
                    migrated_tokens=migrated_tokens)
