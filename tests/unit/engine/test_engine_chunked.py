"""Chunked prefill in the engine: a prompt computed in chunks, with other calls decoding
in between, yields exactly the tokens of a whole prefill; idle KV is reported as evictable."""

import pytest

from talaria.services.instance_agent.engine import Sequence
from talaria.services.instance_agent.engine.engine_errors import UnknownCall
from talaria.shared.tokenizer import encode

PROMPT = encode("Summarise the failing test output and propose a patch for the parser. " * 6)


def test_chunks_with_decodes_between_give_the_whole_prefills_tokens(make_engine):
    ref = make_engine(["qwen3-tiny"], hkvr=False, staging=False)
    want = ref.generate(Sequence("ref", "ref", "qwen3-tiny", PROMPT, 6)).token_ids

    eng = make_engine(["qwen3-tiny"], hkvr=False, staging=False)
    other = Sequence("other", "o", "qwen3-tiny", encode("hello"), 20)
    long = Sequence("long", "s", "qwen3-tiny", PROMPT, 6)
    eng.prefill([other])
    assert eng.prefill([long], chunk_tokens=100) == []
    assert long.prompt_left == len(PROMPT) - 100
    with pytest.raises(UnknownCall):
        eng.decode([long])  # still prefilling: it has no first token to feed back
    steps = []
    while not steps:
        eng.decode([other])  # another call decodes between the chunks
        steps = eng.prefill([], chunk_tokens=100, more=[long])
    assert [s.call_id for s in steps] == ["long"] and long.prompt_left == 0
    while not steps[-1].finished:
        steps = eng.decode([long])
    assert eng.finish(long).token_ids == want


def test_idle_sessions_kv_is_used_but_not_pinned(make_engine):
    eng = make_engine(["qwen3-tiny"], hkvr=False)  # no D2H copy in flight (those pin pages briefly)
    eng.generate(Sequence("c1", "s1", "qwen3-tiny", PROMPT, 4))
    stats = eng.stats()
    assert stats.kv_used_tokens > 0  # the session's KV stays on device for its return ...
    assert stats.kv_pinned_tokens == 0  # ... but no running call holds it: evictable
    eng.prefill([Sequence("c2", "s2", "qwen3-tiny", PROMPT, 4)])
    assert eng.stats().kv_pinned_tokens >= len(PROMPT)


def test_a_chunk_ends_after_the_pass_size_the_scheduler_asked_for(make_engine):
    eng = make_engine(["qwen3-tiny"], hkvr=False, staging=False, prefill_chunk=64)
    eng.should_yield = lambda: True
    long = Sequence("long", "s", "qwen3-tiny", PROMPT, 2)
    assert eng.prefill([long], chunk_tokens=10_000, pass_tokens=16) == []
    assert long.kv_len == 16 and long in eng.running  # one pass of 16, not the engine's 64


def test_a_chunk_ends_early_when_the_driver_asks(make_engine):
    eng = make_engine(["qwen3-tiny"], hkvr=False, staging=False, prefill_chunk=64)
    eng.should_yield = lambda: True  # a call arrived: end the chunk at the next forward pass
    long = Sequence("long", "s", "qwen3-tiny", PROMPT, 2)
    assert eng.prefill([long], chunk_tokens=10_000) == []
    assert long.kv_len == 64 and long.prompt_left == len(PROMPT) - 64
    eng.should_yield = None
    [step] = eng.prefill([], chunk_tokens=10_000, more=[long])
    assert step.call_id == "long"
