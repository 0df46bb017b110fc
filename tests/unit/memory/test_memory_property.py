"""Property: under random interleavings of sessions, models, switches, host evictions,
dirty staged chunks and rank disagreements, every greedy output equals a from-scratch
reference, the weight region always holds the active model's exact bytes, and no call
ever reports more cached tokens than it could have."""

import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from talaria.services.instance_agent.engine.sampling import output_mask
from talaria.shared.model_text import text_for
from talaria.shared.tokenizer import EOS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from talaria.services.instance_agent.engine import Sequence, TorchEngine
from talaria.services.instance_agent.engine.model import reference_logits
from talaria.services.instance_agent.memory.host_pages import RankReport

MODELS = ["qwen3-tiny", "gpt2-tiny", "qwen3-moe-tiny"]
DATA = Path(tempfile.mkdtemp(prefix="talaria-prop-"))
_HOST: dict[str, dict[str, torch.Tensor]] = {}


@lru_cache(maxsize=None)
def reference(model: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    eng = _REF_ENGINE()
    params = eng.layouts[model].views(eng.host_images[model])
    ids, out = list(prompt), []
    for _ in range(n):
        logits = reference_logits(eng.specs[model], params, ids)[-1]
        allowed = text_for(eng.specs[model]).allowed_output
        nxt = int((logits + output_mask(allowed, logits.shape[-1], logits.device)).argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt == EOS:  # the engine stops at EOS too (and reports it)
            break
    return tuple(out)


@lru_cache(maxsize=1)
def _REF_ENGINE() -> TorchEngine:
    return TorchEngine(DATA, MODELS, kv_pages=4, hkvr=False, staging=False)


def disagree(rep: RankReport) -> RankReport:
    if rep.rank == 0 or len(rep.hashes) < 2:
        return rep
    return RankReport(rep.rank, rep.committed_tokens - 16, rep.hashes[:1] + tuple(h + 1 for h in rep.hashes[1:]))


op = st.one_of(
    st.tuples(st.just("call"), st.integers(0, 1), st.integers(0, 1), st.integers(12, 40), st.integers(1, 3)),
    st.tuples(st.just("stage"), st.integers(0, 2)),
    st.tuples(st.just("switch"), st.integers(0, 2)),
    st.tuples(st.just("fault"), st.booleans()),
    st.tuples(st.just("flood"), st.integers(10, 50), st.integers(0, 2)),
    st.tuples(st.just("bounce"), st.integers(0, 1), st.integers(0, 1), st.integers(12, 40), st.integers(1, 3)),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=4, max_size=12), chunk=st.sampled_from([128 * 1024, 1024 * 1024]))
def test_random_interleavings_match_scratch(ops, chunk):
    torch.set_num_threads(1)
    eng = TorchEngine(DATA, MODELS, kv_pages=24, host_kv_pages=64, stage_chunk_bytes=chunk)
    history: dict[tuple[int, str], list[int]] = {}
    n_calls = 0
    try:
        for o in ops:
            kind = o[0]
            if kind in ("call", "bounce"):
                _, s, m, extend, max_tokens = o
                if kind == "bounce":  # a return after a forced switch away: host restore path
                    eng.switch_to(MODELS[2])
                model = MODELS[m]
                prev = history.get((s, model), [256])
                prompt = prev + [(s * 37 + m * 11 + i + len(prev)) % 256 for i in range(extend)]
                res = eng.generate(Sequence(f"c{n_calls}", f"s{s}", model, prompt, max_tokens))
                n_calls += 1
                assert tuple(res.token_ids) == reference(model, tuple(prompt), max_tokens)
                assert 0 <= res.cached_tokens <= len(prompt) - 1
                assert (res.kv_source == "host") == (res.host_restored_tokens > 0)
                assert (res.kv_source == "recompute") == (res.cached_tokens == 0)
                history[(s, model)] = prompt + res.token_ids
            elif kind in ("stage", "switch"):
                model = MODELS[o[1]]
                if kind == "stage":
                    eng.stage(model, wait=True)
                else:
                    rec = eng.switch_to(model)
                    assert rec.pointer_check_ok
                    assert torch.equal(eng.bump.weight_region(), eng.host_images[model])
            elif kind == "fault":
                eng.rank_fault = disagree if o[1] else None
            elif kind == "flood" and eng.active_model is not None:
                # stage a model, then a throwaway call whose pages reach into the staged tail
                # (dirties chunks) and whose checkpoint pushes HKVR into eviction
                eng.stage(MODELS[o[2]], wait=True)
                prompt = [256] + [(7 * i) % 256 for i in range(o[1] * 8)]
                eng.generate(Sequence(f"f{n_calls}", f"flood{n_calls}", eng.active_model, prompt, 1))
                n_calls += 1
            if eng.active_model is not None:
                assert torch.equal(eng.bump.weight_region(), eng.host_images[eng.active_model])
        for sid, model, state, tokens in eng.session_states():
            assert state in ("device", "host") and tokens > 0
    finally:
        eng.close()
