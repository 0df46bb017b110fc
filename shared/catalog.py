"""The model catalogue: tiny random-weight models the torch engine serves.

Each entry fixes the architecture, the seed its weights are drawn from, and its
context length. Weights are built from this config once and written as safetensors
into the data directory; nothing is ever downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from talaria.shared.tokenizer import VOCAB_SIZE


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # dense (Qwen3) | moe (Qwen3-MoE) | llama (Llama 3, Mistral) | gpt2 (LayerNorm, learned positions)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    context_length: int
    seed: int
    experts: int = 0
    experts_per_token: int = 0
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10000.0
    # Hugging Face checkpoints (shared/hf_config.py); the built-in models keep these defaults.
    path: str | None = None  # a local Hugging Face model directory; None: weights from `seed`
    norm_eps: float = 0.0  # 0: the engine's defaults (RMSNorm 1e-6, LayerNorm 1e-5)
    rope_scaling: tuple[float, ...] = ()  # Llama 3: (factor, low_freq_factor, high_freq_factor, original_max)
    norm_topk_prob: bool = True  # MoE: renormalise the top-k router weights
    eos_ids: tuple[int, ...] = ()  # () : the byte tokenizer's EOS


CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("qwen3-tiny", "dense", 128, 4, 4, 2, 32, 384, 32768, seed=1),
        ModelSpec(
            "qwen3-moe-tiny", "moe", 128, 4, 4, 2, 32, 192, 32768, seed=2,
            experts=8, experts_per_token=2,
        ),
        ModelSpec("gpt2-tiny", "gpt2", 128, 4, 4, 4, 32, 512, 8192, seed=3),
    )
}


class UnknownModelError(KeyError):
    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model

    def __str__(self) -> str:
        return f"model {self.model!r} does not exist; known: {', '.join(sorted(CATALOG))}"


def register(spec: ModelSpec) -> None:
    """Add a model (a Hugging Face directory, see shared/hf_config.py) to this process's catalogue."""
    CATALOG[spec.name] = spec


def get_spec(name: str) -> ModelSpec:
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownModelError(name) from None
