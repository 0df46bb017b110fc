"""The active model on the device, as a switch publishes it (P5): its weight views, the KV
pool view and RoPE tables, and the page tables over that pool. Replaced whole by the next
switch; None while no model is active. And the engine's measured step rates."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from talaria.services.instance_agent.engine.kv_cache import DevicePrefixIndex, PagePool, SessionCache
from talaria.shared.catalog import ModelSpec
from talaria.shared.stats import ewma

EMA = 0.3  # weight of the newest sample in the measured rates


@dataclass
class DeviceModel:
    name: str
    spec: ModelSpec
    params: dict[str, torch.Tensor]
    kv: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None
    pool: PagePool
    index: DevicePrefixIndex  # full pages by prefix hash
    sessions: SessionCache  # each idle session's KV on device


class Rates:
    """Tokens per second of prefill, decode and host restore, as an EWMA of measured steps."""

    def __init__(self) -> None:
        self.tok_s = {"prefill": 0.0, "decode": 0.0, "restore": 0.0}

    def measured(self, kind: str, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        old = self.tok_s[kind]
        self.tok_s[kind] = ewma(old or None, tokens / seconds, EMA)
