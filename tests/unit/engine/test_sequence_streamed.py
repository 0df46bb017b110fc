"""A call whose tokens an engine streams to us (vLLM, SGLang) is the same `Sequence` the torch
engine computes, and decides text, stop strings, EOS and length by the same rules: the torch
engine's sampled tokens, fed as if streamed, give the torch engine's text and finish."""

from __future__ import annotations

from talaria.services.instance_agent.engine import SamplingParams, Sequence
from talaria.shared.model_text import BYTE_TEXT
from talaria.shared.tokenizer import EOS, encode

PROMPT = encode("Streamed tokens are decided here.")


def streamed(call: Sequence, delivered: list[int], engine_done: bool = False, context: int = 8192):
    call.admit_streamed(context, BYTE_TEXT, 0.0)
    call.pending = [(t, None) for t in delivered]
    call.engine_done = engine_done
    steps = []
    while call.pending and not call.finished:
        steps.append(call.take_streamed(1.0))
    return call, steps


def test_a_stop_string_ends_the_call_and_is_held_back():
    call, steps = streamed(Sequence("a", "s", "gpt2-tiny", PROMPT, 20, SamplingParams(stop=["END"])),
                           list(b"fine ENDx"))
    assert steps[-1].finished and steps[-1].finish_reason == "stop"
    assert "".join(s.text for s in steps) == "fine " == call.text
    assert call.stop_sequence == "END"


def test_eos_max_tokens_and_the_engines_own_cap():
    _, steps = streamed(Sequence("b", "s", "gpt2-tiny", PROMPT, 20), list(b"ab") + [EOS])
    assert steps[-1].finish_reason == "stop" and len(steps) == 3
    _, steps = streamed(Sequence("c", "s", "gpt2-tiny", PROMPT, 2), list(b"abcd"))
    assert [s.finished for s in steps] == [False, True] and steps[-1].finish_reason == "length"
    # the engine stopped delivering (its context cap) before max_tokens: length, not a hang
    call, steps = streamed(Sequence("d", "s", "gpt2-tiny", PROMPT, 20), list(b"ab"), engine_done=True)
    assert steps[-1].finish_reason == "length" and call.tokens == PROMPT + list(b"ab")


def test_the_same_tokens_give_the_torch_engines_text(make_engine):
    eng = make_engine(["gpt2-tiny"])
    req = Sequence("t", "s", "gpt2-tiny", PROMPT, 24, SamplingParams(stop=["e"]))
    computed = eng.generate(req)
    call, steps = streamed(Sequence("t2", "s", "gpt2-tiny", PROMPT, 24, SamplingParams(stop=["e"])), computed.token_ids)
    assert (call.text, call.finish_reason, call.token_ids) == (
        computed.text, computed.finish_reason, computed.token_ids)
