"""The model catalogue: tiny random-weight models the torch engine serves (`BUILTIN_MODELS`),
and a deployment's `Catalogue`: those plus the Hugging Face checkpoints among its models
(hf_config.py; built once per service by `CommonSettings.catalogue()` and handed to what
looks models up, so two deployments in one process never see each other's checkpoints).

Each entry fixes the architecture, the seed its weights are drawn from, and its
context length. Weights are built from this config once and written as safetensors
into the data directory; nothing is ever downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from talaria.shared.tokenizer import VOCAB_SIZE

DEMO_VOCAB_SIZE = 4352  # the demo BPE's ids (about 4,100 used) rounded up; see demo_tokenizer.py
DEMO_CONTEXT = 131072  # a coding agent's first request (60-100 KB) is 20-30k BPE tokens


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
    tokenizer: str = "byte"  # built-ins: "byte" (tokenizer.py) or "bpe" (demo_tokenizer.py)
    # What the weights were saved in (config.json `torch_dtype`); the engines choose what they
    # compute in from it and the hardware (services/instance_agent/engine/dtypes.py).
    dtype: str = "float32"


class Catalogue(Mapping[str, ModelSpec]):
    """Models by name, immutable. Picklable, so a gateway's parser process gets its parent's
    with each body it parses."""

    __slots__ = ("_by_name",)

    def __init__(self, specs: Iterable[ModelSpec] = ()) -> None:
        object.__setattr__(self, "_by_name", MappingProxyType({s.name: s for s in specs}))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a Catalogue is immutable; `with_` makes one with more models")

    def __getitem__(self, name: str) -> ModelSpec:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __reduce__(self):  # the mapping proxy itself does not pickle
        return (Catalogue, (tuple(self._by_name.values()),))

    def __repr__(self) -> str:
        return f"Catalogue({', '.join(self._by_name)})"

    def with_(self, *specs: ModelSpec) -> Catalogue:
        """This catalogue and `specs` (a spec replaces one of the same name)."""
        return Catalogue((*self.values(), *specs))


BUILTIN_MODELS = Catalogue((
    ModelSpec("qwen3-tiny", "dense", 128, 4, 4, 2, 32, 384, DEMO_CONTEXT, seed=1,
              vocab_size=DEMO_VOCAB_SIZE, tokenizer="bpe"),
    ModelSpec("qwen3-moe-tiny", "moe", 128, 4, 4, 2, 32, 192, DEMO_CONTEXT, seed=2,
              experts=8, experts_per_token=2, vocab_size=DEMO_VOCAB_SIZE, tokenizer="bpe"),
    # GPT-2's learned positions make a long context costly: it keeps the byte tokenizer.
    ModelSpec("gpt2-tiny", "gpt2", 128, 4, 4, 4, 32, 512, 8192, seed=3),
))
