"""A local Hugging Face model directory as a catalogue entry (torch-free: the gateway uses it too).

`TALARIA_MODELS=name=/path/to/dir` serves the checkpoint in `dir` (config.json, safetensors
shards, tokenizer.json / tokenizer_config.json, generation_config.json) under `name`.
Supported `architectures`: Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM (also
MistralForCausalLM), GPT2LMHeadModel. Anything else fails at start with an error naming the
config field, rather than serving a model we would compute wrongly.
"""

from __future__ import annotations

import json
from pathlib import Path

from talaria.shared.catalog import ModelSpec

ARCHITECTURES = {
    "Qwen3ForCausalLM": "dense",
    "Qwen3MoeForCausalLM": "moe",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt2",
}


class CheckpointError(ValueError):
    """The directory is not a checkpoint we can serve; the message names the file and field."""

    def __init__(self, path: Path, field: str, reason: str) -> None:
        super().__init__(f"{path}: `{field}` {reason}")
        self.path, self.field = path, field


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(path, path.name, "is missing") from None
    except ValueError as exc:
        raise CheckpointError(path, path.name, f"is not valid JSON: {exc}") from None


def _rope(cfg: dict, file: Path) -> tuple[float, tuple[float, ...]]:
    """rope_theta and Llama 3 scaling, from transformers 5's `rope_parameters` or 4's fields."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return theta, ()
    if kind == "llama3":
        return theta, (float(params["factor"]), float(params["low_freq_factor"]),
                       float(params["high_freq_factor"]), float(params["original_max_position_embeddings"]))
    raise CheckpointError(file, "rope_parameters.rope_type", f"{kind!r} is not supported (default or llama3)")


def _eos(path: Path, cfg: dict) -> tuple[int, ...]:
    gen = path / "generation_config.json"
    value = (_read_json(gen) if gen.exists() else {}).get("eos_token_id", cfg.get("eos_token_id"))
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _dtype(cfg: dict) -> str:
    """What the weights were saved in: transformers 5 writes `dtype`, 4 wrote `torch_dtype`."""
    value = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return str(value).removeprefix("torch.")


def load_spec(name: str, path: str | Path) -> ModelSpec:
    path = Path(path).expanduser().resolve()
    file = path / "config.json"
    cfg = _read_json(file)
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(file, "architectures", f"{archs!r} is not supported; supported: {', '.join(ARCHITECTURES)}")

    def need(field: str, *alts: str):
        for f in (field, *alts):
            if cfg.get(f) is not None:
                return cfg[f]
        raise CheckpointError(file, field, "is missing")

    if arch == "gpt2":
        hidden, heads = need("n_embd"), need("n_head")
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(file, "activation_function", f"{act!r} is not supported (gelu_new)")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if cfg.get(flag):
                raise CheckpointError(file, flag, "true is not supported")
        return ModelSpec(name, "gpt2", hidden, need("n_layer"), heads, heads, hidden // heads,
                         cfg.get("n_inner") or 4 * hidden, need("n_positions", "max_position_embeddings"), seed=0,
                         vocab_size=need("vocab_size"), path=str(path),
                         norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), eos_ids=_eos(path, cfg),
                         dtype=_dtype(cfg))
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(file, "hidden_act", f"{act!r} is not supported (silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise CheckpointError(file, flag, "true is not supported")
    if cfg.get("use_sliding_window") or (arch == "llama" and cfg.get("sliding_window")):
        raise CheckpointError(file, "sliding_window", "is not supported")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    theta, scaling = _rope(cfg, file)
    common = dict(vocab_size=need("vocab_size"), rope_theta=theta, rope_scaling=scaling, path=str(path),
                  norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), eos_ids=_eos(path, cfg), dtype=_dtype(cfg))
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    layers, context = need("num_hidden_layers"), need("max_position_embeddings")
    if arch == "moe":
        if cfg.get("mlp_only_layers"):
            raise CheckpointError(file, "mlp_only_layers", "must be empty (every layer an MoE layer)")
        if cfg.get("decoder_sparse_step", 1) != 1:
            raise CheckpointError(file, "decoder_sparse_step", "must be 1 (every layer an MoE layer)")
        return ModelSpec(name, "moe", hidden, layers, heads, kv_heads, head_dim, need("moe_intermediate_size"),
                         context, seed=0, experts=need("num_experts", "num_local_experts"),
                         experts_per_token=need("num_experts_per_tok"),
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), **common)
    return ModelSpec(name, arch, hidden, layers, heads, kv_heads, head_dim, need("intermediate_size"), context,
                     seed=0, **common)


def parse_models(entries: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    """`name` or `name=/path` entries -> (names, {name: path})."""
    names, dirs = [], {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        name = name.strip()
        if sep:
            dirs[name] = path.strip()
        names.append(name)
    return tuple(names), dirs
