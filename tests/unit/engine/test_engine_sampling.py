"""Stop strings, max_tokens, EOS, seeded sampling, streaming."""

import pytest
import torch

from talaria.services.instance_agent.engine import SamplingParams, Sequence
from talaria.services.instance_agent.engine.sampling import StopMatcher, sample
from talaria.shared.tokenizer import EOS, encode

PROMPT = encode("Stop strings end the answer; the stop text is not returned.")


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["END"])
    assert m.push("abc") == ("abc", False)
    assert m.push("E") == ("", False)  # could be the start of END
    assert m.push("N") == ("", False)
    assert m.push("x") == ("ENx", False)
    assert m.push("yE") == ("y", False)
    assert m.push("ND tail") == ("", True)
    assert m.text == "abcENxy"


def test_stop_string_excluded_and_streamed(make_engine):
    eng = make_engine(["qwen3-tiny"])
    base = eng.generate(Sequence("c0", "s0", "qwen3-tiny", PROMPT, 24))
    text = base.text
    stop = text[5:8]
    cut = text.find(stop)
    streamed = []
    res = eng.generate(Sequence("c1", "s1", "qwen3-tiny", PROMPT, 24, SamplingParams(stop=[stop])),
                       on_token=lambda tok, piece: streamed.append(piece))
    assert res.finish_reason == "stop"
    assert res.text == text[:cut]
    assert "".join(streamed) == res.text
    assert len(res.token_ids) < 24


def test_max_tokens_gives_length(make_engine):
    eng = make_engine(["gpt2-tiny"])
    res = eng.generate(Sequence("c", "s", "gpt2-tiny", PROMPT, 7))
    assert res.finish_reason == "length" and len(res.token_ids) == 7
    assert res.prompt_tokens == len(PROMPT) and res.ttft_s > 0 and res.prefill_s > 0


def test_seeded_sampling_is_reproducible(make_engine):
    eng = make_engine(["qwen3-moe-tiny"])

    def run(call, seed):
        params = SamplingParams(temperature=1.0, top_p=0.9, seed=seed)
        return eng.generate(Sequence(call, call, "qwen3-moe-tiny", PROMPT, 16, params)).token_ids

    a, b, c = run("a", 7), run("b", 7), run("c", 8)
    assert a == b
    assert a != c
    greedy = eng.generate(Sequence("g", "g", "qwen3-moe-tiny", PROMPT, 16)).token_ids
    tiny = SamplingParams(temperature=1.0, top_p=1e-6, seed=1)
    tiny_p = eng.generate(Sequence("t", "t", "qwen3-moe-tiny", PROMPT, 16, tiny)).token_ids
    assert tiny_p == greedy  # top_p -> 0 keeps only the argmax


def test_sample_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    draws = {sample(logits, 1.0, 0.75, gen) for _ in range(200)}
    assert draws == {0, 1}


def test_eos_stops():
    from talaria.shared.model_text import BYTE_TEXT

    seq = Sequence("e", "e", "gpt2-tiny", PROMPT, 10).admit(8192, BYTE_TEXT, 0.0, total_pages=1)
    logits = torch.zeros(260)
    logits[65] = 1.0
    assert not seq.take(logits, 1.0).finished
    logits[EOS] = 5.0
    step = seq.take(logits, 2.0)
    assert step.finished and step.finish_reason == "stop" and step.token_id == EOS
    assert seq.text == "A"


# ---- poison sampling parameters (issue 15: each once hung an agent) --------------------------


def test_extreme_sampling_values_still_yield_a_token():
    logits = torch.tensor([0.0, 3.0, 1.0, float("-inf")])
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, 1e-300, 1.0, gen) == 1  # overflowing temperature: its limit, greedy
    assert sample(logits, 5e-324, 1.0, gen) == 1
    assert all(sample(logits, 1.0, 5e-324, gen) == 1 for _ in range(20))  # top_p below float32: top token


def test_any_integer_seed_is_accepted_and_deterministic():
    from talaria.services.instance_agent.engine.sampling import make_generator

    for seed in (2**64, 2**70 + 3, -5, -(2**63)):
        a, b = make_generator(seed, torch.device("cpu")), make_generator(seed, torch.device("cpu"))
        assert torch.rand(3, generator=a).tolist() == torch.rand(3, generator=b).tolist()


def test_poison_sampling_calls_complete_and_leave_the_engine_clean(make_engine):
    eng = make_engine(["qwen3-tiny"])
    for i, kw in enumerate([dict(temperature=1.0, seed=2**64), dict(temperature=1.0, top_p=5e-324),
                            dict(temperature=1e-300)]):
        assert eng.generate(Sequence(f"p{i}", f"ps{i}", "qwen3-tiny", PROMPT, 3, SamplingParams(**kw))).finish_reason
    assert not eng.running


def test_a_failed_prefill_releases_its_whole_batch(make_engine):
    eng = make_engine(["qwen3-tiny"], hkvr=False, staging=False)  # no background copies: exact page counts
    eng.generate(Sequence("warm", "w", "qwen3-tiny", PROMPT, 2))
    eng.sessions.drop("w")
    free = eng.pool.num_unused()

    def boom(call_ids, logits):
        raise RuntimeError("injected sampling failure")

    eng.on_logits = boom
    reqs = [Sequence(f"b{i}", f"bs{i}", "qwen3-tiny", PROMPT, 4) for i in range(2)]
    with pytest.raises(RuntimeError):
        eng.prefill(reqs)
    assert not eng.running and eng.pool.num_unused() == free  # nothing stays running or held
    eng.on_logits = None
    assert eng.generate(Sequence("after", "a", "qwen3-tiny", PROMPT, 2)).finish_reason
