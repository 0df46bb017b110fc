"""A Hugging Face checkpoint's safetensors shards as the engine's canonical tensors.

The engine multiplies `x @ W` with W stored [in, out]; Hugging Face `nn.Linear` weights are
[out, in], so they are transposed here (GPT-2's Conv1D weights are already [in, out]). MoE
experts are read from the per-expert keys hub checkpoints use, or from transformers 5's
fused `gate_up_proj` / `down_proj`. Tied embeddings give the LM head.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from talaria.services.instance_agent.engine.engine_errors import WeightsCorrupt
from talaria.shared.catalog import ModelSpec


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsCorrupt(str(path), "no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    out[key] = st.get_tensor(key)
        except Exception as err:  # safetensors raises several types; translate at the boundary
            raise WeightsCorrupt(str(f), f"cannot read: {err}") from err
    return out


def load_hf_tensors(spec: ModelSpec) -> dict[str, torch.Tensor]:
    raw = _read_all(Path(spec.path))

    def get(*names: str) -> torch.Tensor:  # as saved: the host image converts (weights.py)
        for n in names:
            if n in raw:
                return raw[n]
        raise WeightsCorrupt(spec.path, f"tensor {names[0]} is missing")

    if spec.arch == "gpt2":
        return _gpt2(spec, raw, get)
    out = {"embed": get("model.embed_tokens.weight")}
    for i in range(spec.layers):
        hf, p = f"model.layers.{i}.", f"layers.{i}."
        out[p + "attn_norm"] = get(hf + "input_layernorm.weight")
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            out[p + ours] = get(f"{hf}self_attn.{theirs}.weight").t()
        if spec.arch != "llama":
            out[p + "q_norm"] = get(hf + "self_attn.q_norm.weight")
            out[p + "k_norm"] = get(hf + "self_attn.k_norm.weight")
        out[p + "mlp_norm"] = get(hf + "post_attention_layernorm.weight")
        if spec.arch == "moe":
            out.update(_experts(spec, raw, get, hf, p))
        else:
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                out[p + ours] = get(f"{hf}mlp.{theirs}.weight").t()
    out["final_norm"] = get("model.norm.weight")
    out["lm_head"] = (get("lm_head.weight") if "lm_head.weight" in raw else out["embed"]).t()
    return {k: v.contiguous() for k, v in out.items()}


def _experts(spec, raw, get, hf: str, p: str) -> dict[str, torch.Tensor]:
    out = {p + "router": get(hf + "mlp.gate.weight").t()}
    fused = hf + "mlp.experts.gate_up_proj"
    if fused in raw:  # transformers 5 in-memory layout: [E, 2I, H] and [E, H, I]
        gate_up = raw[fused]
        i = spec.intermediate
        out[p + "experts.gate"] = gate_up[:, :i, :].transpose(1, 2)
        out[p + "experts.up"] = gate_up[:, i:, :].transpose(1, 2)
        out[p + "experts.down"] = get(hf + "mlp.experts.down_proj").transpose(1, 2)
        return out
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        out[f"{p}experts.{ours}"] = torch.stack(
            [get(f"{hf}mlp.experts.{e}.{theirs}.weight").t() for e in range(spec.experts)])
    return out


def _gpt2(spec, raw, get) -> dict[str, torch.Tensor]:
    pre = "transformer." if "transformer.wte.weight" in raw else ""
    out = {"embed": get(pre + "wte.weight"), "wpe": get(pre + "wpe.weight")}
    for i in range(spec.layers):
        hf, p = f"{pre}h.{i}.", f"layers.{i}."
        pairs = (("ln1", "ln_1"), ("qkv", "attn.c_attn"), ("o", "attn.c_proj"), ("ln2", "ln_2"),
                 ("fc", "mlp.c_fc"), ("proj", "mlp.c_proj"))
        for ours, theirs in pairs:
            out[f"{p}{ours}.w"] = get(f"{hf}{theirs}.weight")
            out[f"{p}{ours}.b"] = get(f"{hf}{theirs}.bias")
    out["final_norm"] = get(pre + "ln_f.weight")
    out["final_norm.b"] = get(pre + "ln_f.bias")
    out["lm_head"] = (get("lm_head.weight") if "lm_head.weight" in raw else out["embed"]).t()
    return {k: v.contiguous() for k, v in out.items()}
