import torch

from talaria.services.instance_agent.engine import Sequence
from talaria.services.instance_agent.engine.weights import (
    ensure_weights_file, init_weights, load_host_image, model_paths, weight_layout,
)
from talaria.shared.catalog import BUILTIN_MODELS
from talaria.shared.tokenizer import encode

PROMPT = encode("Determinism: same spec, same weights, same greedy output.")


def test_init_is_deterministic_per_seed():
    a, b = init_weights(BUILTIN_MODELS["qwen3-tiny"]), init_weights(BUILTIN_MODELS["qwen3-tiny"])
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = init_weights(BUILTIN_MODELS["qwen3-moe-tiny"])
    assert not torch.equal(a["embed"], other["embed"])


def test_weights_written_once_and_loaded_back(data_dir):
    spec = BUILTIN_MODELS["gpt2-tiny"]
    ensure_weights_file(data_dir, spec)
    st, cfg = model_paths(data_dir, spec.name)
    assert st.exists() and cfg.exists()
    mtime = st.stat().st_mtime_ns
    assert ensure_weights_file(data_dir, spec) is False
    assert st.stat().st_mtime_ns == mtime
    layout = weight_layout(spec)
    views = layout.views(load_host_image(data_dir, spec, layout, pin=False))
    ref = init_weights(spec)
    assert all(torch.equal(views[k], ref[k]) for k in ref)


def test_two_engines_same_greedy_output(make_engine):
    outs = []
    for _ in range(2):
        eng = make_engine(["qwen3-tiny", "gpt2-tiny"])
        outs.append([eng.generate(Sequence(f"c{m}", "s", m, PROMPT, 12)).token_ids
                     for m in ("qwen3-tiny", "gpt2-tiny")])
    assert outs[0] == outs[1]
    assert len(set(outs[0][0])) > 2, "greedy output should not be degenerate"
