"""Paged, batched prefill + decode equals an unpaged, unbatched reference forward."""

import pytest
import torch

from talaria.services.instance_agent.engine import Sequence
from talaria.services.instance_agent.engine.model import reference_logits
from talaria.shared.tokenizer import encode

TEXTS = ["a", "The session is the unit of scheduling.", "Tool calls return quickly; " * 3]


@pytest.mark.parametrize("model", ["qwen3-tiny", "qwen3-moe-tiny", "gpt2-tiny"])
def test_paged_batched_matches_reference(make_engine, model):
    eng = make_engine([model], prefill_chunk=24)  # chunking splits the longest prompt
    eng.switch_to(model)
    seen: dict[str, list[torch.Tensor]] = {}
    eng.on_logits = lambda ids, logits: [seen.setdefault(c, []).append(logits[i].clone()) for i, c in enumerate(ids)]
    reqs = [Sequence(f"c{i}", f"s{i}", model, encode(t), 6) for i, t in enumerate(TEXTS)]
    tokens = {r.call_id: list(r.prompt_ids) for r in reqs}
    for st in eng.prefill(reqs):
        tokens[st.call_id].append(st.token_id)
    for _ in range(5):
        for st in eng.decode(reqs):
            tokens[st.call_id].append(st.token_id)
    spec = eng.specs[model]
    for r in reqs:
        full = reference_logits(spec, eng.params, tokens[r.call_id])
        n = len(r.prompt_ids)
        for step, got in enumerate(seen[r.call_id]):
            torch.testing.assert_close(got, full[n - 1 + step], rtol=1e-4, atol=1e-4)
        res = eng.finish(r)
        assert res.token_ids == tokens[r.call_id][n:]
        assert res.finish_reason == "length"
