"""Prefix reuse: device session entry, cross-session prefix index; same greedy output."""

from talaria.services.instance_agent.engine import Sequence
from talaria.shared.tokenizer import encode

SYSTEM = encode("You are a coding agent. Read the issue, run the tests, patch the bug. " * 2)


def _fresh(make_engine, model, prompt, n):
    eng = make_engine([model], hkvr=False, staging=False)
    return eng.generate(Sequence("ref", "ref", model, prompt, n))


def test_session_return_reuses_device_kv(make_engine):
    eng = make_engine(["qwen3-tiny"])
    first = eng.generate(Sequence("c1", "s1", "qwen3-tiny", SYSTEM, 10))
    assert first.kv_source == "recompute" and first.cached_tokens == 0
    assert eng.kv_state("s1", "qwen3-tiny") == "device"
    prompt2 = SYSTEM + first.token_ids + encode(" tool output: 3 passed", bos=False)
    second = eng.generate(Sequence("c2", "s1", "qwen3-tiny", prompt2, 10))
    assert second.kv_source == "device"
    # committed KV = prompt + all generated tokens but the last (never fed back)
    assert second.cached_tokens == len(SYSTEM) + len(first.token_ids) - 1
    assert second.token_ids == _fresh(make_engine, "qwen3-tiny", prompt2, 10).token_ids


def test_prefix_index_shares_full_pages_across_sessions(make_engine):
    eng = make_engine(["gpt2-tiny"])
    eng.generate(Sequence("c1", "s1", "gpt2-tiny", SYSTEM + encode("first", bos=False), 4))
    prompt = SYSTEM + encode("second question", bos=False)
    res = eng.generate(Sequence("c2", "s2", "gpt2-tiny", prompt, 8))
    assert res.kv_source == "device"
    assert res.cached_tokens == len(SYSTEM) // 16 * 16
    assert res.token_ids == _fresh(make_engine, "gpt2-tiny", prompt, 8).token_ids


def test_identical_prompt_recomputes_only_last_token(make_engine):
    eng = make_engine(["qwen3-moe-tiny"])
    a = eng.generate(Sequence("c1", "s1", "qwen3-moe-tiny", SYSTEM, 6))
    b = eng.generate(Sequence("c2", "s1", "qwen3-moe-tiny", SYSTEM, 6))
    assert b.cached_tokens == len(SYSTEM) - 1
    assert a.token_ids == b.token_ids


def test_reusable_estimate_is_what_admission_reuses(make_engine):
    """The runner tells the scheduler how much of a return's prompt its device KV covers; a
    prompt that does not extend the last one (a re-rendered turn) reuses only the common
    prefix, so pricing the whole held KV would make the scheduler chunk it as nearly free."""
    from talaria.services.instance_agent.engine_view import reusable_kv

    eng = make_engine(["qwen3-tiny"])
    first = eng.generate(Sequence("c1", "s1", "qwen3-tiny", SYSTEM + encode(" first turn", bos=False), 4))
    extended = SYSTEM + encode(" first turn", bos=False) + first.token_ids[:-1] + encode(" more", bos=False)
    rewritten = SYSTEM + encode(" another turn entirely", bos=False)
    for call_id, prompt in (("c2", extended), ("c3", rewritten)):
        state, reusable = reusable_kv(eng, "s1", "qwen3-tiny", len(prompt), prompt)
        got = eng.generate(Sequence(call_id, "s1", "qwen3-tiny", prompt, 1))
        assert state == "device" and got.kv_source == "device"
        assert reusable == got.cached_tokens, call_id


def test_the_engines_view_answers_as_the_engine_does(make_engine):
    """The agent reads the engine's KV only through the view it publishes (engine_view.py):
    device and host sessions, and what a prompt reuses, as the engine itself says."""
    from talaria.services.instance_agent.engine_view import view_of

    eng = make_engine(["qwen3-tiny", "gpt2-tiny"])
    prompts = {}
    for i, model in enumerate(("qwen3-tiny", "gpt2-tiny", "qwen3-tiny")):  # the last switch parks s0/s1 to host
        prompts[i] = SYSTEM + encode(f" turn {i}", bos=False)
        eng.generate(Sequence(f"c{i}", f"s{i}", model, prompts[i], 4))
    view = view_of(eng)
    assert {st for _, _, st, _ in view.sessions} == {"device", "host"}
    assert view.sessions == tuple(eng.session_states()) and view.stats == eng.stats()
    for s in ("s0", "s1", "s2", "s9"):
        for model in ("qwen3-tiny", "gpt2-tiny"):
            assert view.kv_state(s, model) == eng.kv_state(s, model), (s, model)
            for prompt in prompts.values():
                assert view.device_prefix(s, model, prompt) == eng.device_prefix(s, model, prompt), (s, model)
