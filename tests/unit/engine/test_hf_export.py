"""The built-ins exported as Hugging Face directories (engine/hf_export.py) compute what the
torch engine computes: transformers' logits on the export match `reference_logits` on the
built-in's own tensors. This is what lets vLLM and SGLang serve the demo models."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from talaria.services.instance_agent.engine.hf_export import hf_dir  # noqa: E402
from talaria.services.instance_agent.engine.model import reference_logits  # noqa: E402
from talaria.services.instance_agent.engine.weights import init_weights  # noqa: E402
from talaria.shared.catalog import BUILTIN_MODELS  # noqa: E402


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny", "gpt2-tiny"])
def test_the_export_computes_the_torch_engines_logits(name, data_dir):
    import transformers

    spec = BUILTIN_MODELS[name]
    path = hf_dir(data_dir, spec)
    assert hf_dir(data_dir, spec) == path  # written once
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = [5, 17, 200, 42, 9, 77, 120, 3, 64, 18]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    ours = reference_logits(spec, init_weights(spec), ids)
    assert torch.allclose(theirs, ours, atol=1e-4, rtol=1e-4), (theirs - ours).abs().max()
