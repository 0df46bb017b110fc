"""The runner's engine steps: each scheduler action run on the engine thread, and what it
gives back to the core (first and next tokens, streamed; a switch record; a failed step).

A mixin of `CallRunner` (runner.py), like the scheduler's `ColdPool`: it reads the runner's
state (`calls`, `core`, `engine`, `nc`, `js`) and uses its `_run`, `_fail` and `_events`.
"""

from __future__ import annotations

import asyncio
import time

from talaria.services.instance_agent.call_outcomes import merge_outcomes
from talaria.services.instance_agent.core import Outcome
from talaria.services.instance_agent.engine import EngineBusy, EngineError, GenRequest
from talaria.services.instance_agent.scheduler import Decode, Prefill, SchedulerError, SwitchModel
from talaria.shared import subjects
from talaria.shared.bus import emit
from talaria.shared.events import CallStarted
from talaria.shared.messages import TokenChunk
from talaria.shared.wire import encode


class EngineSteps:
    async def _switch(self, action: SwitchModel):
        record = await self._run(self.engine.switch_to, action.to_model)
        outcome = self.core.switch_done(action, time.time(), record.total_s, path=record.path,
                                        phases=record.phases(), bytes_staged=record.bytes_staged,
                                        bytes_uncovered=record.bytes_uncovered)
        await self.outcomes.note(outcome.switch)
        outcome.switch = None
        await self.publish_snapshot()
        return outcome

    async def _prefill(self, action: Prefill):
        reqs, more = [], []
        started = time.time()
        for call_id in action.call_ids:
            running = self.calls.get(call_id)
            if running is None:
                continue  # cancelled while queued for this action
            if running.in_engine:
                more.append(call_id)  # chunked prefill: this call's next chunk
                continue
            call = running.routed.call
            reqs.append(GenRequest(call_id=call.call_id, session_id=call.session_id, model=call.model,
                                   prompt_ids=list(call.prompt_ids), max_tokens=call.max_tokens,
                                   temperature=call.temperature, top_p=call.top_p, seed=call.seed,
                                   stop=tuple(call.stop), kv_scope=call.kv_scope, logit_bias=call.logit_bias,
                                   logprobs=call.logprobs, top_logprobs=call.top_logprobs,
                                   kv_output_tokens=running.routed.kv_output_tokens))
            running.in_engine = True
            running.span.add_event("prefill_start", {"session_prefill": action.session_prefill})
            # Published while the prefill runs: it is a progress marker (the projector keeps a
            # final outcome over it whatever the order), and awaited before the call's outcome.
            running.started_pub = asyncio.ensure_future(
                emit(self.js, CallStarted(call_id, call.session_id, self.instance_id, started)))
        self.arrived.clear()
        steps = await self._step(self.engine.prefill, reqs, action.chunk_tokens, more, action.pass_tokens)
        firsts = [s.call_id for s in steps]
        left = self.engine.prompt_left(action.call_ids) if action.chunk_tokens else None
        return self.core.prefill_done(action, time.time(), await self._tokens(steps), first_tokens=firsts,
                                      prompt_left=left)

    async def _decode(self, action: Decode):
        steps = await self._step(self.engine.decode, list(action.call_ids))
        stepped = {s.call_id for s in steps}
        stalled = [c for c in action.call_ids if c not in stepped]  # no KV page for them yet
        return self.core.decode_done(action, time.time(), await self._tokens(steps), stalled=stalled)

    async def _step(self, step, *args):
        """An engine step (prefill or decode); the calls it finished are released on the
        engine thread in the same trip, so completing them costs no second hand-off."""
        steps, released = await self._run(self._step_and_release, step, *args, kind=step.__name__)
        self.released.update((c, r) for c, r in released.items() if c in self.calls)
        return steps

    def _step_and_release(self, step, *args):
        """On the engine thread: the step, then each call it finished released (its GenResult,
        or the EngineError releasing it raised)."""
        steps = step(*args)
        released = {}
        for s in steps:
            if s.finished:
                try:
                    released[s.call_id] = self.engine.finish(s.call_id)
                except EngineError as exc:
                    released[s.call_id] = exc
        return steps, released

    async def _tokens(self, steps) -> set[str]:
        finished = set()
        for step in steps:
            running = self.calls.get(step.call_id)
            if running is None:
                continue
            if step.logprob is not None and running.routed.call.stream:
                running.logprobs.append(step.logprob)
            if step.text and running.routed.call.stream:
                # A chunk carries the logprobs of the tokens since the last one (text held back
                # for a stop string releases several tokens' text at once).
                lps, running.logprobs = running.logprobs or None, []
                await self.nc.publish(subjects.tokens(running.routed.call.tenant, step.call_id),
                                      encode(TokenChunk(step.call_id, running.streamed, step.text, logprobs=lps)))
                running.streamed += 1
            if step.finished:
                finished.add(step.call_id)
        return finished

    async def _engine_failed(self, action, exc: Exception):
        """Fail the calls `action` was for, release what the engine holds of them, and end the
        action in the scheduler (else it waits for it forever and the agent stops working).
        A switch refused because the engine still holds calls is tried again once the sweep
        has freed them (nothing here runs them); another failed switch fails the calls that
        were waiting for it."""
        self.log.error("engine step failed", action=type(action).__name__, error=str(exc))
        outcome = Outcome()
        failed = list(getattr(action, "call_ids", ()))
        if isinstance(action, SwitchModel) and not isinstance(exc, EngineBusy):
            failed = list(self.sched.calls.queued.get(action.to_model, ()))
        for call_id in failed:
            try:
                merge_outcomes(outcome, self.core.abort(call_id, time.time()))
            except SchedulerError:
                self.core.forget(call_id)  # already gone from the scheduler
            try:
                await self._fail(call_id, f"engine error: {exc}")
            except Exception:  # e.g. NATS down: the loop must go on regardless
                self.log.exception("failing a call failed", call_id=call_id)
        if self.sched.inflight is action:  # not when it failed after the scheduler heard it done
            merge_outcomes(outcome, self.core.action_failed(action, time.time()))
        self.sweep_due = True  # the engine's state of the failed calls goes before the next step
        return outcome
