"""What the engines that stream token ids share (vllm_engine.py, sglang_engine.py): the served
models, a prefill's admission (checks, one model, the switch to it), decode's checks, handing
out the tokens an engine delivered (`Sequence.take_streamed` decides text, stop and length,
as the torch engine does), and a call's end.

Each call's stream carries its own `Sequence` (the engine's pump hands what arrives to
that sequence's `events`), so no call is looked up by id; `running` is the set of calls
admitted and not finished, for the switch they block and the stats.

A subclass starts a call in its engine, moves what its engine delivered into a call's
`pending` (`_fetch`: blocks until something came, sets `engine_done` with the last output),
aborts a call there (`_abort`), and takes a model switch's two halves: the outgoing model
leaves the device (`_leave`), the incoming one arrives (`_enter`).
"""

from __future__ import annotations

import importlib
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from talaria.services.instance_agent.engine.admission import KvAdmission
from talaria.services.instance_agent.engine.contract import SWITCHES_KEPT, SwitchRecord
from talaria.services.instance_agent.engine.engine_errors import (
    EngineBusy, EngineError, EngineFailed, ModelNotActive, UnknownCall, UnknownModel,
)
from talaria.services.instance_agent.engine.sequence import Sequence, StepToken
from talaria.shared.catalog import Catalogue, ModelSpec


class StreamingEngine:
    name = "streaming"  # the engine's name in errors

    def _serve(self, data_dir: Path, models: list[str], catalogue: Catalogue, package: str,
               missing: type[EngineError]) -> None:
        """The served models (all in `catalogue`), and the engine's package (else `missing`)."""
        unknown = [m for m in models if m not in catalogue]
        if unknown or not models:
            raise UnknownModel(unknown[0] if unknown else "", sorted(catalogue))
        try:
            importlib.import_module(package)
        except ImportError as err:
            raise missing() from err
        self.data_dir = Path(data_dir)
        self.specs: dict[str, ModelSpec] = {m: catalogue[m] for m in models}
        self.running: set[Sequence] = set()
        self.switches: deque[SwitchRecord] = deque(maxlen=SWITCHES_KEPT)  # the report reads the last
        self.should_yield = None  # the engine chunks long prefills itself
        self._active: str | None = None

    @property
    def active_model(self) -> str | None:
        return self._active

    def _spec(self, model: str) -> ModelSpec:
        try:
            return self.specs[model]
        except KeyError:
            raise UnknownModel(model, sorted(self.specs)) from None

    def switch_to(self, model: str) -> SwitchRecord:
        """Make `model` active: the outgoing model leaves (`_leave`), the incoming one arrives
        (`_enter`); with calls running only where the capabilities allow it."""
        self._spec(model)
        if model == self._active:
            return SwitchRecord(model, model, "noop")  # type: ignore[arg-type]
        if self.running and not self.capabilities.switch_with_calls_running:
            raise EngineBusy(list(self.running))
        t0 = time.perf_counter()
        previous = self._active
        if previous is not None:
            self._leave(previous)
        t1 = time.perf_counter()
        self._enter(model)
        t2 = time.perf_counter()
        self._active = model
        rec = SwitchRecord(previous, model, self._switch_path(), save_teardown_s=t1 - t0,  # type: ignore[arg-type]
                           open_weights_s=t2 - t1, total_s=t2 - t0)
        self.switches.append(rec)
        return rec

    def stage(self, model: str, *, wait: bool = False) -> int:
        """No D2D staging: the engine wakes or resumes a model's weights itself."""
        self._spec(model)
        return 0

    def probe_prefill(self) -> None:
        """No probe: the engine runs its forward passes itself, and a timed pass beside its
        own scheduling would not be one of its steps. The agent's slope starts from the
        architecture's prior on the engine's measured rate."""
        return None

    def _admit(self, seqs: list[Sequence], busy: Callable[[str], bool]) -> None:
        """Check each request; all must be for one model, switched to when `busy(model)` says
        no call stands in the way. (The engine computes a prompt in chunks of its own inside
        its steps: every call has its first token when prefill returns.)"""
        for r in seqs:
            KvAdmission.validate(self._spec(r.model), self.running, r)
        models = {r.model for r in seqs}
        if len(models) > 1:
            raise ModelNotActive(sorted(models)[1], sorted(models)[0])
        if models and (model := next(iter(models))) != self._active:
            if busy(model):
                raise ModelNotActive(model, self._active)
            self.switch_to(model)

    def _decoding(self, seqs: list[Sequence]) -> list[Sequence]:
        for call in seqs:
            if call not in self.running:
                raise UnknownCall(call.call_id)
            if call.finish_reason is not None:
                raise UnknownCall(call.call_id, f"already finished ({call.finish_reason}); call finish()")
            if call.model != self._active:
                raise ModelNotActive(call.model, self._active)
        return list(seqs)

    def _next(self, call: Sequence, prefill: bool = False) -> StepToken:
        """The call's next delivered token, waiting for the engine when none is there yet."""
        t0 = time.perf_counter()
        while not call.pending:
            if call.engine_done:
                raise self._failed(call, f"call {call.call_id} ended without a token")
            self._fetch(call)
        now = time.perf_counter()
        if prefill:
            call.prefill_s += now - t0
        else:
            call.decode_s += now - t0
        step = call.take_streamed(now)
        if step.finished and not call.engine_done:  # a stop string ended it before the engine did
            self._abort(call, wait=False)  # mid-step: the batch does not wait for the engine's answer
            call.engine_done = True
        return step

    def _end(self, call: Sequence) -> Sequence:
        """finish()'s common part: the call leaves, aborted in the engine if unfinished there."""
        if call not in self.running:
            raise UnknownCall(call.call_id)
        self.running.discard(call)
        if not call.engine_done:
            self._abort(call)
            call.engine_done = True
        return call.released()

    def _failed(self, call: Sequence, reason: str) -> EngineFailed:
        return EngineFailed(self.name, call.model, reason)

    def _leave(self, model: str) -> None:  # pragma: no cover - every engine has its own
        raise NotImplementedError

    def _enter(self, model: str) -> None:  # pragma: no cover
        raise NotImplementedError

    def _switch_path(self) -> str:  # pragma: no cover
        raise NotImplementedError

    def _fetch(self, call: Sequence) -> None:  # pragma: no cover
        raise NotImplementedError

    def _abort(self, call: Sequence, wait: bool = True) -> None:  # pragma: no cover
        raise NotImplementedError
