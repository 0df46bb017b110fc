"""Bump-managed device memory: one buffer per instance, three regions, stable bases.

    offset 0                                                              size
    |<-- weights -->|<----------------- KV pool (the gap) ------------>|<- runtime ->|
    +---------------+---------------------------------------------------+------------+
    | active model  | page 0, page 1, ... (allocator prefers low pages) | RoPE tables|
    | params, views |            ... free tail ... | staged chunks <----| (per model)|
    +---------------+---------------------------------------------------+------------+
    ^ weight base   ^ kv base = align(weight bytes of the active model)  ^ runtime base
      (never moves)   (moves only with the weight size)                    (never moves)

Nothing on the switch path allocates: every region is a view of one buffer, and views stay
valid because bases are stable (how each region moves at a switch: `BumpBuffer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from talaria.services.instance_agent.engine.weights import ALIGN, align_up


@dataclass(frozen=True)
class RegionBases:
    weight: int
    kv: int
    runtime: int


class BumpBuffer:
    """The instance's device buffer. Single-threaded: owned by the engine's worker thread.

    * Weights grow from the low end; switching m -> m' releases the KV region, resizes the
      weight region to m''s image size and rebinds m''s parameters as views at fixed offsets.
    * Runtime buffers are anchored at the high end; their base never moves.
    * The KV pool is whatever lies between; the next model's weights are staged into the
      free high-address tail of that gap (staging.py), which low-first allocation keeps clean.
    * Nothing on the switch path allocates: every region is a view of `buf`. Views cached for
      a model stay valid because bases are stable; `check_bases` is the restore-time pointer
      check (the analogue of re-validating captured CUDA-graph pointers).
    """

    def __init__(self, total_bytes: int, runtime_bytes: int, device: str | torch.device) -> None:
        total_bytes = align_up(total_bytes)
        self.runtime_base = total_bytes - align_up(runtime_bytes)
        if self.runtime_base <= 0:
            raise ValueError(f"bump buffer of {total_bytes} B cannot hold {runtime_bytes} B of runtime")
        self.size = total_bytes
        self.device = torch.device(device)
        self.buf = torch.empty(total_bytes, dtype=torch.uint8, device=self.device)
        self.weight_bytes = 0

    # -- regions -------------------------------------------------------------------------

    @property
    def kv_base(self) -> int:
        return align_up(self.weight_bytes, ALIGN)

    @property
    def kv_bytes(self) -> int:
        return self.runtime_base - self.kv_base

    def resize_weights(self, nbytes: int) -> None:
        if align_up(nbytes) > self.runtime_base:
            raise ValueError(f"weights of {nbytes} B do not fit below runtime base {self.runtime_base}")
        self.weight_bytes = nbytes

    def weight_region(self) -> torch.Tensor:
        return self.buf[: self.weight_bytes]

    def runtime_region(self) -> torch.Tensor:
        return self.buf[self.runtime_base :]

    def raw(self, lo: int, hi: int) -> torch.Tensor:
        return self.buf[lo:hi]

    def kv_view(self, page_shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The gap as a page-first pool [num_pages, *page_shape]; pages start at kv_base."""
        elem = torch.empty((), dtype=dtype).element_size()
        page_bytes = elem
        for d in page_shape:
            page_bytes *= d
        n = self.kv_bytes // page_bytes
        region = self.buf[self.kv_base : self.kv_base + n * page_bytes]
        return region.view(dtype).view(n, *page_shape)

    def page_range(self, page: int, page_bytes: int) -> tuple[int, int]:
        lo = self.kv_base + page * page_bytes
        return lo, lo + page_bytes

    # -- pointer check -------------------------------------------------------------------

    def bases(self) -> RegionBases:
        p = self.buf.data_ptr()
        return RegionBases(weight=p, kv=p + self.kv_base, runtime=p + self.runtime_base)

    def owns(self, t: torch.Tensor, lo: int = 0, hi: int | None = None) -> bool:
        """True when `t`'s storage lies inside buf[lo:hi] (a view, not a copy)."""
        hi = self.size if hi is None else hi
        start = t.data_ptr() - self.buf.data_ptr()
        return lo <= start and start + t.numel() * t.element_size() <= hi
