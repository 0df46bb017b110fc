"""Staging bookkeeping, pure (no torch, no clock): chunk layout, states, dirty tracking and
the switch-time gather plan. `staging.StagingExecutor` moves the bytes; the simulator drives
this planner directly. See `staging.py` for the layout diagram.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

ChunkState = Literal["missing", "writing", "clean", "dirty", "unplaced"]


@dataclass
class Chunk:
    index: int
    src_lo: int  # within the target weight image
    src_hi: int
    dst_lo: int  # slot, absolute offset in the bump buffer (-1 when it has no slot)
    dst_hi: int
    state: ChunkState = "missing"

    @property
    def nbytes(self) -> int:
        return self.src_hi - self.src_lo

    def overlaps(self, lo: int, hi: int) -> bool:
        return self.dst_lo >= 0 and lo < self.dst_hi and self.dst_lo < hi


@dataclass(frozen=True)
class GatherPlan:
    target: str
    d2d: tuple[Chunk, ...]
    h2d: tuple[tuple[int, int], ...]  # (src_lo, src_hi) ranges to load from host
    staged_bytes: int
    uncovered_bytes: int
    dirty_chunks: int

    @property
    def path(self) -> str:
        if not self.d2d:
            return "host_only"
        return "d2d_full" if self.uncovered_bytes == 0 else "d2d_partial"


@dataclass
class StagingPlanner:
    chunk_bytes: int
    target: str | None = None
    chunks: list[Chunk] = field(default_factory=list)
    dirty_events: int = 0

    def plan(self, target: str, weight_bytes: int, lo_limit: int, hi: int) -> None:
        """Lay out `target`'s chunks in slots from `hi` downward, none below `lo_limit`."""
        self.target, self.chunks = target, []
        n = -(-weight_bytes // self.chunk_bytes)
        for i in range(n):
            src_lo, src_hi = i * self.chunk_bytes, min((i + 1) * self.chunk_bytes, weight_bytes)
            dst_lo = hi - (i + 1) * self.chunk_bytes
            if dst_lo < lo_limit:
                self.chunks.append(Chunk(i, src_lo, src_hi, -1, -1, "unplaced"))
            else:
                self.chunks.append(Chunk(i, src_lo, src_hi, dst_lo, dst_lo + (src_hi - src_lo)))

    def reset(self) -> None:
        self.target, self.chunks = None, []

    def next_writes(self, slot_is_free: Callable[[int, int], bool], limit: int) -> list[Chunk]:
        """Mark up to `limit` missing/dirty chunks whose slot is free as writing."""
        out = []
        for c in self.chunks:
            if len(out) >= limit:
                break
            if c.state in ("missing", "dirty") and slot_is_free(c.dst_lo, c.dst_hi):
                c.state = "writing"
                out.append(c)
        return out

    def write_done(self, index: int) -> None:
        c = self.chunks[index]
        if c.state == "writing":
            c.state = "clean"

    def blocked(self, lo: int, hi: int) -> bool:
        """True when [lo, hi) overlaps a chunk being written: the allocator must skip it."""
        return any(c.state == "writing" and c.overlaps(lo, hi) for c in self.chunks)

    def on_kv_alloc(self, lo: int, hi: int) -> None:
        for c in self.chunks:
            if c.state == "clean" and c.overlaps(lo, hi):
                c.state = "dirty"
                self.dirty_events += 1

    def writing(self) -> list[Chunk]:
        return [c for c in self.chunks if c.state == "writing"]

    def staged_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks if c.state == "clean")

    def gather_plan(self, target: str, weight_bytes: int) -> GatherPlan:
        if target != self.target or any(c.state == "writing" for c in self.chunks):
            if target != self.target:
                return GatherPlan(target, (), ((0, weight_bytes),), 0, weight_bytes, 0)
            raise RuntimeError("gather planned while a staging write is in flight")
        d2d = tuple(c for c in self.chunks if c.state == "clean")
        h2d = tuple((c.src_lo, c.src_hi) for c in self.chunks if c.state != "clean")
        staged = sum(c.nbytes for c in d2d)
        dirty = sum(1 for c in self.chunks if c.state == "dirty")
        return GatherPlan(target, d2d, h2d, staged, weight_bytes - staged, dirty)
