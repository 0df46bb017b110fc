"""Which floating-point type a model's weights and KV are held and computed in.

A checkpoint says what it was saved in (config.json `torch_dtype`: ModelSpec.dtype; the
built-in random-weight models are float32). A bfloat16 checkpoint runs in bfloat16 where the
hardware computes it natively (CUDA: `torch.cuda.is_bf16_supported()`; CPU: oneDNN's bf16
path, i.e. AVX512-BF16 or AMX), and in float32 otherwise: there torch would emulate bf16
through float32 and run slower than float32 itself, so the wider type costs only memory. A
float16 checkpoint runs in float16 on CUDA and in float32 on a CPU (no fast fp16 path there).
`TALARIA_DTYPE` (float32 | bfloat16 | auto) overrides the choice for every model: float32 for
bit-reproducible runs, bfloat16 to force it (slower where it is emulated, said in the reason).

Both engines that compute (torch, vllm) take the same choice, so they serve the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from talaria.shared import logs
from talaria.shared.catalog import ModelSpec
from talaria.shared.settings import DTYPES as CHOICES


class BadDtype(ValueError):
    def __init__(self, value: str) -> None:
        super().__init__(f"TALARIA_DTYPE={value!r}: one of {', '.join(CHOICES)}")
        self.value = value


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # why this type, for the start-up log

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def native_bf16(device: str | torch.device) -> bool:
    """Whether `device` computes bfloat16 natively (not emulated through float32)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an older or unusual torch build: assume not
        return False


def choose(spec: ModelSpec, device: str | torch.device, override: str = "auto",
           bf16_native: bool | None = None) -> DtypeChoice:
    """The type `spec`'s weights and KV are held in on `device`. `bf16_native` (tests) stands
    in for the hardware check."""
    want = (override or "auto").lower()
    if want not in CHOICES:
        raise BadDtype(override)
    dev = torch.device(device)
    native = native_bf16(dev) if bf16_native is None else bf16_native
    if want == "float32":
        return DtypeChoice(torch.float32, "TALARIA_DTYPE=float32")
    if want == "bfloat16":
        note = "" if native else f"; {dev.type} has no native bf16, torch emulates it (slower than float32)"
        return DtypeChoice(torch.bfloat16, "TALARIA_DTYPE=bfloat16" + note)
    saved = spec.dtype
    if saved == "bfloat16":
        if native:
            return DtypeChoice(torch.bfloat16, f"checkpoint is bfloat16 and {dev.type} computes bf16 natively")
        return DtypeChoice(torch.float32, f"checkpoint is bfloat16 but {dev.type} has no native bf16 "
                                          "(AVX512-BF16/AMX or a bf16 GPU): float32 is faster there")
    if saved == "float16":
        if dev.type == "cuda":
            return DtypeChoice(torch.float16, "checkpoint is float16")
        return DtypeChoice(torch.float32, "checkpoint is float16; CPUs have no fast float16 path")
    return DtypeChoice(torch.float32, f"checkpoint is {saved}")


def choose_all(specs: dict[str, ModelSpec], device: str | torch.device, override: str = "auto",
               engine: str = "torch") -> dict[str, DtypeChoice]:
    """`choose` for every served model, each choice logged with its reason."""
    out = {m: choose(s, device, override) for m, s in specs.items()}
    log = logs.get("engine")
    for m, c in out.items():
        log.info("model dtype", engine=engine, model=m, dtype=c.name, reason=c.reason)
    return out
