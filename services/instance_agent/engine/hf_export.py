"""A built-in catalogue model written as a Hugging Face directory, for engines that load only
Hugging Face checkpoints (vLLM, SGLang).

The built-ins (`qwen3-tiny`, `qwen3-moe-tiny`, `gpt2-tiny`) are drawn from their seed into the
torch engine's own layout (weights.py: `x @ W`, W stored [in, out]); this is the inverse of
hf_weights.py: the same tensors under transformers' names and shapes, with a config.json of
the matching architecture. No tokenizer files: the engines that read this directory are
given token ids and return token ids (the model's text side stays shared/model_text.py).
A checkpoint that already is a Hugging Face directory (`spec.path`) is used where it is.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from talaria.services.instance_agent.engine.model import LN_EPS, RMS_EPS
from talaria.services.instance_agent.engine.weights import INIT_VERSION, ensure_weights_file, init_weights
from talaria.shared.catalog import ModelSpec
from talaria.shared.model_text import text_for

ARCHITECTURE = {"dense": "Qwen3ForCausalLM", "moe": "Qwen3MoeForCausalLM", "gpt2": "GPT2LMHeadModel"}


def hf_dir(data_dir: Path, spec: ModelSpec) -> Path:
    """The model's Hugging Face directory, written once under `<data_dir>/hf/<name>` for a
    built-in (rewritten when its spec or init scheme changed)."""
    if spec.path is not None:
        return Path(spec.path)
    if spec.arch not in ARCHITECTURE:
        raise ValueError(f"model {spec.name!r}: arch {spec.arch!r} has no Hugging Face export")
    out = Path(data_dir) / "hf" / spec.name
    cfg = config(spec)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        try:
            if json.loads((out / "config.json").read_text()) == cfg:
                return out
        except ValueError:
            pass
    ensure_weights_file(data_dir, spec)  # the torch engine's file stays the source of truth
    # Agents sharing a data dir may export together: each writes its own temporary directory
    # and renames it into place (a reader never sees a half-written one).
    tmp = out.with_name(f".{spec.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir(parents=True)
    save_file(hf_tensors(spec, init_weights(spec)), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": list(_eos(spec))}))
    if out.exists():
        old = out.with_name(out.name + f".old.{uuid.uuid4().hex[:8]}")
        out.rename(old)
        _rmtree(old)
    tmp.rename(out)
    return out


def _eos(spec: ModelSpec) -> tuple[int, ...]:
    return tuple(text_for(spec).eos_ids)


def config(spec: ModelSpec) -> dict:
    eos = list(_eos(spec))
    common = {"architectures": [ARCHITECTURE[spec.arch]], "vocab_size": spec.vocab_size, "torch_dtype": "float32",
              "eos_token_id": eos[0] if len(eos) == 1 else eos, "bos_token_id": eos[0], "talaria_init_version": INIT_VERSION,
              "talaria_seed": spec.seed}
    if spec.arch == "gpt2":
        return {**common, "model_type": "gpt2", "n_embd": spec.hidden, "n_layer": spec.layers, "n_head": spec.heads,
                "n_inner": spec.intermediate, "n_positions": spec.context_length,
                "activation_function": "gelu_new", "layer_norm_epsilon": spec.norm_eps or LN_EPS,
                "tie_word_embeddings": False}
    qwen = {**common, "hidden_size": spec.hidden, "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
            "max_position_embeddings": spec.context_length, "rope_theta": spec.rope_theta,
            "rms_norm_eps": spec.norm_eps or RMS_EPS, "hidden_act": "silu", "attention_bias": False,
            "tie_word_embeddings": False, "use_sliding_window": False}
    if spec.arch == "moe":
        return {**qwen, "model_type": "qwen3_moe", "intermediate_size": spec.intermediate,
                "moe_intermediate_size": spec.intermediate, "num_experts": spec.experts,
                "num_experts_per_tok": spec.experts_per_token, "norm_topk_prob": spec.norm_topk_prob,
                "decoder_sparse_step": 1, "mlp_only_layers": []}
    return {**qwen, "model_type": "qwen3", "intermediate_size": spec.intermediate}


def hf_tensors(spec: ModelSpec, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The torch engine's tensors under transformers' names (Linear weights back to [out, in])."""
    t = lambda x: x.t().contiguous()  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    if spec.arch == "gpt2":  # GPT-2's Conv1D weights are [in, out], as ours
        out["transformer.wte.weight"], out["transformer.wpe.weight"] = w["embed"], w["wpe"]
        for i in range(spec.layers):
            p, hf = f"layers.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                out[hf + theirs + ".weight"], out[hf + theirs + ".bias"] = w[p + ours + ".w"], w[p + ours + ".b"]
            for ours, theirs in (("qkv", "attn.c_attn"), ("o", "attn.c_proj"), ("fc", "mlp.c_fc"),
                                 ("proj", "mlp.c_proj")):
                out[hf + theirs + ".weight"] = w[p + ours + ".w"].contiguous()
                out[hf + theirs + ".bias"] = w[p + ours + ".b"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = w["final_norm"], w["final_norm.b"]
        out["lm_head.weight"] = t(w["lm_head"])
        return out
    out["model.embed_tokens.weight"] = w["embed"]
    for i in range(spec.layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = w[p + "attn_norm"]
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            out[f"{hf}self_attn.{theirs}.weight"] = t(w[p + ours])
        out[hf + "self_attn.q_norm.weight"] = w[p + "q_norm"]
        out[hf + "self_attn.k_norm.weight"] = w[p + "k_norm"]
        out[hf + "post_attention_layernorm.weight"] = w[p + "mlp_norm"]
        if spec.arch == "moe":
            out[hf + "mlp.gate.weight"] = t(w[p + "router"])
            for e in range(spec.experts):
                for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                    out[f"{hf}mlp.experts.{e}.{theirs}.weight"] = t(w[f"{p}experts.{ours}"][e])
        else:
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                out[f"{hf}mlp.{theirs}.weight"] = t(w[p + ours])
    out["model.norm.weight"] = w["final_norm"]
    out["lm_head.weight"] = t(w["lm_head"])
    return out


def _rmtree(path: Path) -> None:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
