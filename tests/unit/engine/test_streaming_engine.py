"""What vLLM's and SGLang's adapters share (engine/streaming.py), without either engine: a
test double, `ScriptedEngine`, delivers scripted token ids the way an engine streams them and
records what it was asked to abort. Checked: a stop string that ends a call before its engine
does aborts it there without waiting (the batch's step goes on), a call finished unfinished
is aborted and waited for, a call that ended without a token is the engine's failure, and
the admission and decode checks name what is wrong."""

from __future__ import annotations

import pytest

from talaria.services.instance_agent.engine import SamplingParams, Sequence
from talaria.services.instance_agent.engine.contract import Capabilities
from talaria.services.instance_agent.engine.engine_errors import (
    EngineBusy, EngineFailed, ModelNotActive, UnknownCall, UnknownModel,
)
from talaria.services.instance_agent.engine.streaming import StreamingEngine
from talaria.shared.catalog import BUILTIN_MODELS
from talaria.shared.model_text import BYTE_TEXT
from talaria.shared.tokenizer import encode

PROMPT = encode("Stream me.")
A, B = "gpt2-tiny", "qwen3-tiny"


class ScriptedEngine(StreamingEngine):
    """Test double of a streaming engine (vLLM / SGLang cannot run in the unit tests): each
    call's deliveries are scripted; `_fetch` hands out one delivery at a time."""

    name = "scripted"

    def __init__(self, tmp_path, models=(A, B), switch_with_calls_running=False) -> None:
        self._serve(tmp_path, list(models), BUILTIN_MODELS, "json", UnknownModel)  # any importable package
        self.capabilities = Capabilities(switch_with_calls_running=switch_with_calls_running, host_kv=False,
                                         d2d_staging=False, chunked_prefill=False, resident_models=True)
        self.script: dict[str, list[tuple[list[int], bool]]] = {}  # call -> deliveries (ids, finished)
        self.aborted: list[tuple[str, bool]] = []  # (call, waited)
        self.moves: list[str] = []

    def prefill(self, seqs: list[Sequence]):
        self._admit(seqs, busy=lambda model: bool(self.running))
        for call in seqs:
            self.running.add(call.admit_streamed(8192, BYTE_TEXT, 0.0))
        return [self._next(c, prefill=True) for c in seqs]

    def decode(self, seqs):
        return [self._next(c) for c in self._decoding(seqs)]

    def finish(self, seq: Sequence):
        return self._end(seq)

    def _fetch(self, call: Sequence) -> None:
        ids, finished = self.script[call.call_id].pop(0)
        call.pending += [(t, None) for t in ids]
        call.engine_done = call.engine_done or finished

    def _abort(self, call: Sequence, wait: bool = True) -> None:
        self.aborted.append((call.call_id, wait))

    def _leave(self, model: str) -> None:
        self.moves.append(f"leave {model}")

    def _enter(self, model: str) -> None:
        self.moves.append(f"enter {model}")

    def _switch_path(self) -> str:
        return "resident"


def req(call_id: str, model: str = A, max_tokens: int = 20, stop=()) -> Sequence:
    return Sequence(call_id, "s", model, PROMPT, max_tokens, SamplingParams(stop=stop))


def test_a_stop_string_aborts_the_call_in_its_engine_without_waiting(tmp_path):
    eng = ScriptedEngine(tmp_path)
    eng.script["c"] = [(list(b"ok E"), False), (list(b"ND more"), False)]
    c = req("c", stop=("END",))
    [first] = eng.prefill([c])
    steps = [first]
    while not steps[-1].finished:
        [step] = eng.decode([c])
        steps.append(step)
    assert steps[-1].finish_reason == "stop" and "".join(s.text for s in steps) == "ok "
    assert eng.aborted == [("c", False)]  # mid-step: the others' tokens do not wait for it
    res = eng.finish(c)
    assert eng.aborted == [("c", False)] and res.finish_reason == "stop"  # not aborted twice


def test_finishing_a_call_the_engine_still_runs_aborts_it_and_waits(tmp_path):
    eng = ScriptedEngine(tmp_path)
    eng.script["c"] = [(list(b"abc"), False)]
    c = req("c")
    eng.prefill([c])
    assert eng.finish(c).token_ids == [ord("a")]
    assert eng.aborted == [("c", True)] and c.finish_reason == "abort"
    with pytest.raises(UnknownCall):
        eng.finish(c)


def test_a_call_the_engine_ended_without_a_token_is_the_engines_failure(tmp_path):
    eng = ScriptedEngine(tmp_path)
    eng.script["c"] = [([], True)]
    with pytest.raises(EngineFailed, match="ended without a token"):
        eng.prefill([req("c")])


def test_the_engines_own_cap_ends_a_call_as_length(tmp_path):
    eng = ScriptedEngine(tmp_path)
    eng.script["c"] = [(list(b"ab"), True)]
    c = req("c")
    first = eng.prefill([c])[0]
    [last] = eng.decode([c])
    assert not first.finished and last.finish_reason == "length" and eng.aborted == []
    with pytest.raises(UnknownCall, match="already finished"):
        eng.decode([c])


def test_admission_one_model_per_step_and_no_switch_under_running_calls(tmp_path):
    eng = ScriptedEngine(tmp_path)
    with pytest.raises(ModelNotActive):
        eng.prefill([req("a", A), req("b", B)])
    eng.script["a"] = [(list(b"xyz"), False)]
    a = req("a", A)
    eng.prefill([a])
    assert eng.active_model == A and eng.moves == [f"enter {A}"]
    with pytest.raises(ModelNotActive):  # B waits: a call of A still runs here
        eng.prefill([req("b", B)])
    with pytest.raises(EngineBusy):
        eng.switch_to(B)
    eng.finish(a)
    assert eng.switch_to(B).path == "resident" and eng.moves == [f"enter {A}", f"leave {A}", f"enter {B}"]
    assert eng.switch_to(B).path == "noop"
    with pytest.raises(UnknownModel):
        eng.switch_to("no-such-model")
