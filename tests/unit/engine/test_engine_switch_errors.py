"""Switch records, context limits, and the error hierarchy."""

import pytest

from talaria.services.instance_agent.engine import (
    ContextTooLong, EngineBusy, InvalidRequest, OutOfKvPages, SamplingParams, Sequence, UnknownCall, UnknownModel,
)
from talaria.shared.catalog import BUILTIN_MODELS, ModelSpec
from talaria.shared.tokenizer import encode

PROMPT = encode("switch me")


def test_switch_record_phases(make_engine):
    eng = make_engine(["qwen3-tiny", "gpt2-tiny"], staging=False)
    first = eng.switch_to("qwen3-tiny")
    assert first.from_model is None and first.path == "host_only"
    eng.generate(Sequence("c", "s", "qwen3-tiny", PROMPT, 4))
    rec = eng.switch_to("gpt2-tiny")
    assert rec.from_model == "qwen3-tiny" and rec.to_model == "gpt2-tiny"
    assert set(rec.phases()) == {"save_teardown", "open_weights", "kv_shell", "runtime", "publish"}
    assert all(v >= 0 for v in rec.phases().values())
    assert rec.total_s >= sum(rec.phases().values()) * 0.99
    assert rec.bytes_h2d == eng.layouts["gpt2-tiny"].nbytes == rec.bytes_moved
    assert eng.active_model == "gpt2-tiny"
    back = eng.switch_to("qwen3-tiny")
    assert back.kv_shell_reused and back.pointer_check_ok
    assert eng.switch_to("qwen3-tiny").path == "noop"


def test_switch_refused_while_running(make_engine):
    eng = make_engine(["qwen3-tiny", "gpt2-tiny"])
    c = Sequence("c", "s", "qwen3-tiny", PROMPT, 4)
    eng.prefill([c])
    with pytest.raises(EngineBusy) as err:
        eng.switch_to("gpt2-tiny")
    assert err.value.running == [c]  # the caller gets them back, to release the ones it no longer runs
    eng.finish(c)
    eng.switch_to("gpt2-tiny")


def test_cold_open_reads_file(make_engine):
    eng = make_engine(["gpt2-tiny"], preload_host=False)
    rec = eng.switch_to("gpt2-tiny")
    assert rec.path == "cold" and rec.bytes_from_file == eng.layouts["gpt2-tiny"].nbytes


def test_context_limit(make_engine):
    spec = ModelSpec("ctx-tiny", "dense", 32, 1, 2, 2, 16, 64, 64, seed=9)
    eng = make_engine([spec.name], catalogue=BUILTIN_MODELS.with_(spec))
    with pytest.raises(ContextTooLong) as err:
        eng.generate(Sequence("c", "s", spec.name, [65] * 65, 4))
    assert (err.value.model, err.value.tokens, err.value.limit) == ("ctx-tiny", 65, 64)
    res = eng.generate(Sequence("c", "s", spec.name, [65] * 60, 50))
    assert res.finish_reason == "length"
    assert 60 + len(res.token_ids) == 64 or res.token_ids[-1] == 257


def test_invalid_requests(make_engine):
    eng = make_engine(["qwen3-tiny"])
    with pytest.raises(UnknownModel):
        eng.generate(Sequence("c", "s", "llama-70b", PROMPT, 4))
    bad = [
        Sequence("c", "s", "qwen3-tiny", [], 4),
        Sequence("c", "s", "qwen3-tiny", [10**6], 4),  # past the vocabulary
        Sequence("c", "s", "qwen3-tiny", PROMPT, 0),
        Sequence("c", "s", "qwen3-tiny", PROMPT, 4, SamplingParams(temperature=-1)),
        Sequence("c", "s", "qwen3-tiny", PROMPT, 4, SamplingParams(top_p=0)),
    ]
    for req in bad:
        with pytest.raises(InvalidRequest):
            eng.prefill([req])
    assert not eng.running
    with pytest.raises(UnknownCall):
        eng.decode([Sequence("nope", "s", "qwen3-tiny", PROMPT, 4)])
    with pytest.raises(UnknownCall):
        eng.finish(Sequence("nope", "s", "qwen3-tiny", PROMPT, 4))


def test_out_of_kv_pages(make_engine):
    eng = make_engine(["gpt2-tiny"], kv_pages=8)
    eng.switch_to("gpt2-tiny")
    capacity = eng.stats().kv_capacity_tokens
    with pytest.raises(OutOfKvPages) as err:
        eng.generate(Sequence("c", "s", "gpt2-tiny", [65] * 100, capacity))
    assert err.value.needed > err.value.available
    assert not eng.running and eng.pool.num_free == eng.pool.num_pages
