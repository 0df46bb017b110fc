"""Model weights: drawn once from the catalogue seed, stored as safetensors, packed flat.

Every model has a *weight layout*: its tensors in a fixed order, each at an aligned byte
offset inside one flat image. The host keeps that image (pinned on CUDA); the bump
buffer's weight region holds the same bytes, so parameters are views at those offsets
and a switch is a byte copy (H2D or D2D), never a re-allocation.
"""

from __future__ import annotations

import json
import os
import uuid
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from talaria.services.instance_agent.engine.engine_errors import WeightsCorrupt
from talaria.shared.catalog import ModelSpec

ALIGN = 256  # bytes; every tensor and region starts on this boundary
INIT_VERSION = 1  # bump when the init scheme changes (the json records it)
DTYPE = torch.float32  # the built-in models' weights as drawn and saved


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the weight image
    itemsize: int = 4

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class WeightLayout:
    model: str
    slots: tuple[TensorSlot, ...]
    nbytes: int  # aligned total
    dtype: torch.dtype = DTYPE  # what the parameters are held and computed in (dtypes.py)

    def views(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameters as `dtype` views into a uint8 image (host image or bump region)."""
        out = {}
        for s in self.slots:
            out[s.name] = image[s.offset : s.offset + s.nbytes].view(self.dtype).view(s.shape)
        return out


def tensor_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) in canonical order; init is 'ones' | 'zeros' | 'normal:<std>'."""
    h, v, i = spec.hidden, spec.vocab_size, spec.intermediate
    q_out, kv_out = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    proj = "normal:0.05"
    out: list[tuple[str, tuple[int, ...], str]] = [("embed", (v, h), "normal:0.5")]
    if spec.arch == "gpt2":
        out.append(("wpe", (spec.context_length, h), "normal:0.05"))
    for layer in range(spec.layers):
        p = f"layers.{layer}."
        if spec.arch == "gpt2":
            out += [
                (p + "ln1.w", (h,), "ones"), (p + "ln1.b", (h,), "zeros"),
                (p + "qkv.w", (h, q_out + 2 * kv_out), proj), (p + "qkv.b", (q_out + 2 * kv_out,), "normal:0.02"),
                (p + "o.w", (q_out, h), proj), (p + "o.b", (h,), "zeros"),
                (p + "ln2.w", (h,), "ones"), (p + "ln2.b", (h,), "zeros"),
                (p + "fc.w", (h, i), proj), (p + "fc.b", (i,), "normal:0.02"),
                (p + "proj.w", (i, h), proj), (p + "proj.b", (h,), "zeros"),
            ]
            continue
        out += [
            (p + "attn_norm", (h,), "ones"),
            (p + "q", (h, q_out), proj), (p + "k", (h, kv_out), proj), (p + "v", (h, kv_out), proj),
        ]
        if spec.arch != "llama":
            out += [(p + "q_norm", (spec.head_dim,), "ones"), (p + "k_norm", (spec.head_dim,), "ones")]
        out += [
            (p + "o", (q_out, h), proj),
            (p + "mlp_norm", (h,), "ones"),
        ]
        if spec.arch == "moe":
            e = spec.experts
            out += [
                (p + "router", (h, e), "normal:0.2"),
                (p + "experts.gate", (e, h, i), proj), (p + "experts.up", (e, h, i), proj),
                (p + "experts.down", (e, i, h), proj),
            ]
        else:
            out += [(p + "gate", (h, i), proj), (p + "up", (h, i), proj), (p + "down", (i, h), proj)]
    out += [("final_norm", (h,), "ones")]
    if spec.arch == "gpt2":
        out += [("final_norm.b", (h,), "zeros")]
    out += [("lm_head", (h, v), "normal:0.15")]
    return out


def weight_layout(spec: ModelSpec, dtype: torch.dtype = DTYPE) -> WeightLayout:
    slots, off = [], 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, shape, _ in tensor_shapes(spec):
        slot = TensorSlot(name, shape, off, itemsize)
        slots.append(slot)
        off = align_up(off + slot.nbytes)
    return WeightLayout(spec.name, tuple(slots), off, dtype)


def init_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Deterministic: the same spec gives bit-identical tensors (CPU generator, fixed order)."""
    gen = torch.Generator(device="cpu").manual_seed(spec.seed)
    out = {}
    for name, shape, init in tensor_shapes(spec):
        if init == "ones":
            out[name] = torch.ones(shape, dtype=DTYPE)
        elif init == "zeros":
            out[name] = torch.zeros(shape, dtype=DTYPE)
        else:
            std = float(init.split(":")[1])
            out[name] = torch.randn(shape, generator=gen, dtype=DTYPE) * std
    return out


def model_paths(data_dir: Path, name: str) -> tuple[Path, Path]:
    base = Path(data_dir) / "models"
    return base / f"{name}.safetensors", base / f"{name}.json"


def ensure_weights_file(data_dir: Path, spec: ModelSpec) -> bool:
    """Write the safetensors + json config once; True when they were written now. A Hugging
    Face checkpoint is read where it is (hf_weights.py), never copied."""
    if spec.path is not None:
        return False
    st, cfg = model_paths(data_dir, spec.name)
    if st.exists() and cfg.exists() and _config_matches(cfg, spec):
        return False
    st.parent.mkdir(parents=True, exist_ok=True)
    # Several agents may share a data dir and start together: each writes its own temporary
    # files and renames them into place (atomic; identical content, so the last rename wins).
    tag = f".{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    tmp, tmp_cfg = st.with_name(st.name + tag), cfg.with_name(cfg.name + tag)
    save_file(init_weights(spec), str(tmp), metadata={"model": spec.name, "init_version": str(INIT_VERSION)})
    tmp_cfg.write_text(json.dumps({**asdict(spec), "dtype": "float32", "init_version": INIT_VERSION}, indent=2))
    tmp.replace(st)  # a reader never sees a half-written file
    tmp_cfg.replace(cfg)
    return True


def _config_matches(cfg: Path, spec: ModelSpec) -> bool:
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    want = json.loads(json.dumps(asdict(spec)))  # as written (tuples become lists)
    return data.get("init_version") == INIT_VERSION and all(data.get(k) == v for k, v in want.items())


def load_host_image(data_dir: Path, spec: ModelSpec, layout: WeightLayout, *, pin: bool) -> torch.Tensor:
    """Read the safetensors file into one flat uint8 host image in layout order, each tensor
    converted to the layout's dtype."""
    st, _ = model_paths(data_dir, spec.name)
    if spec.path is not None:
        from talaria.services.instance_agent.engine.hf_weights import load_hf_tensors

        st, tensors = Path(spec.path), load_hf_tensors(spec)
    else:
        try:
            tensors = load_file(str(st))
        except Exception as err:  # safetensors raises several types; translate at the boundary
            raise WeightsCorrupt(str(st), f"cannot read: {err}") from err
    image = torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=pin)
    views = layout.views(image)
    for slot in layout.slots:
        t = tensors.get(slot.name)
        if t is None or tuple(t.shape) != slot.shape:
            got = None if t is None else tuple(t.shape)
            raise WeightsCorrupt(str(st), f"tensor {slot.name}: expected {slot.shape}, got {got}")
        views[slot.name].copy_(t)
    return image
