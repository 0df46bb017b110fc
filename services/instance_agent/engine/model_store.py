"""The served models' specs, weight layouts and host images (the host model entry a switch
copies from): what the engine knows of each model before any is on the device."""

from __future__ import annotations

from pathlib import Path

import torch

from talaria.services.instance_agent.engine.dtypes import DtypeChoice, choose_all
from talaria.services.instance_agent.engine.engine_errors import UnknownModel
from talaria.services.instance_agent.engine.weights import (
    WeightLayout, ensure_weights_file, load_host_image, weight_layout,
)
from talaria.shared.catalog import ModelSpec


class ModelStore:
    def __init__(self, data_dir: Path, specs: dict[str, ModelSpec], device: torch.device, page_size: int,
                 dtype: str = "auto") -> None:
        self.data_dir, self.specs, self.device, self.page_size = Path(data_dir), specs, device, page_size
        # each model's weights and KV are held in this type (dtypes.py: checkpoint, hardware, TALARIA_DTYPE)
        self.dtypes: dict[str, DtypeChoice] = choose_all(specs, device, dtype)
        self.layouts: dict[str, WeightLayout] = {
            m: weight_layout(s, self.dtypes[m].dtype) for m, s in specs.items()}
        self.host_images: dict[str, torch.Tensor] = {}

    def spec(self, model: str) -> ModelSpec:
        try:
            return self.specs[model]
        except KeyError:
            raise UnknownModel(model, sorted(self.specs)) from None

    def ensure_weights(self) -> None:
        """Write `<data_dir>/models/<name>.safetensors` (+ json) for every model if missing."""
        for spec in self.specs.values():
            ensure_weights_file(self.data_dir, spec)

    def page_bytes(self, model: str) -> int:
        s = self.specs[model]
        return s.layers * 2 * self.page_size * s.kv_heads * s.head_dim * self.dtypes[model].dtype.itemsize

    def host_image(self, model: str) -> torch.Tensor:
        img = self.host_images.get(model)
        if img is None:
            pin = self.device.type == "cuda"
            img = load_host_image(self.data_dir, self.specs[model], self.layouts[model], pin=pin)
            self.host_images[model] = img
        return img
