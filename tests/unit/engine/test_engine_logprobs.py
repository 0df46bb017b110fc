"""`logit_bias` steers sampling; `logprobs` report the model's own log-probabilities."""

import torch

from talaria.services.instance_agent.engine import SamplingParams, Sequence
from talaria.services.instance_agent.engine.sampling import output_mask
from talaria.shared.catalog import BUILTIN_MODELS
from talaria.shared.model_text import text_for
from talaria.shared.tokenizer import encode

PROMPT = encode("Bias and logprobs: the engine reports what the model computed.")


def test_a_large_logit_bias_forces_the_greedy_token(make_engine):
    eng = make_engine(["qwen3-tiny"])
    base = eng.generate(Sequence("b", "b", "qwen3-tiny", PROMPT, 6)).token_ids
    forced = next(t for t in b"Zq!" if t not in base)  # a printable byte greedy did not pick
    res = eng.generate(Sequence("f", "f", "qwen3-tiny", PROMPT, 6, SamplingParams(logit_bias={forced: 100.0})))
    assert res.token_ids == [forced] * 6
    # a -100 bias on greedy's first token makes it pick another
    banned = eng.generate(Sequence("n", "n", "qwen3-tiny", PROMPT, 1, SamplingParams(logit_bias={base[0]: -100.0})))
    assert banned.token_ids[0] != base[0]


def test_logprobs_are_the_log_softmax_of_the_models_logits(make_engine):
    eng = make_engine(["qwen3-tiny"])
    seen = []
    eng.on_logits = lambda ids, logits: seen.append(logits[0].clone())
    res = eng.generate(Sequence("l", "l", "qwen3-tiny", PROMPT, 3, SamplingParams(logprobs=True, top_logprobs=5)))
    assert len(res.logprobs) == len(res.token_ids) == 3 == len(seen)
    # The built-in models mask non-printable output ids (shared/model_text.py): the same mask here.
    allowed = text_for(BUILTIN_MODELS["qwen3-tiny"]).allowed_output
    for logits, lp, tok in zip(seen, res.logprobs, res.token_ids):
        masked = logits.float() + output_mask(allowed, logits.shape[-1], logits.device)
        want = torch.log_softmax(masked, dim=-1)
        assert lp.token_id == tok == int(torch.argmax(want))  # greedy: the top token
        assert abs(lp.logprob - float(want[tok])) < 1e-4
        top_vals, top_ids = torch.topk(want, 5)
        assert lp.top_ids == top_ids.tolist()
        assert all(abs(a - float(b)) < 1e-4 for a, b in zip(lp.top_logprobs, top_vals))
    # without the flag nothing is computed or carried
    assert eng.generate(Sequence("m", "m", "qwen3-tiny", PROMPT, 2)).logprobs is None


def test_logprobs_follow_the_bias(make_engine):
    eng = make_engine(["qwen3-tiny"])
    forced = ord("Z")
    res = eng.generate(Sequence("p", "p", "qwen3-tiny", PROMPT, 1,
                                SamplingParams(logit_bias={forced: 100.0}, logprobs=True)))
    assert res.logprobs[0].token_id == forced and res.logprobs[0].logprob > -1e-3  # ~probability 1
