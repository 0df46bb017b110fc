"""D2D weight staging (paper §4.4): pre-copy the next model's weights into free KV space.

    bump buffer:  | weights(m) | KV pages, low first ...     ...free... |c3|c2|c1|c0| runtime |
                                                                 staging slots grow downward
    chunk i holds bytes [i*C, (i+1)*C) of the next model's weight image, in the slot
    [hi - (i+1)*C, hi - i*C); slots stay above max(weights(m), weights(m')) so the gather
    never overwrites its own source.

Chunk states: missing -> writing -> clean; clean -> dirty when a KV page allocation
overlaps the slot; dirty/missing chunks are (re)written only while their slot is free.
While a chunk is `writing` the KV allocator skips pages overlapping it (`blocked`), so no
page is ever handed out over bytes being written, and nothing reads a chunk mid-write.
At switch time the executor waits for writes in flight, copies clean chunks D2D and
loads dirty or missing ones from the host image.

`StagingPlanner` is pure bookkeeping (usable by the simulator); `StagingExecutor` moves bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from services.instance_agent.memory.copier import Completion, Copier

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


@dataclass
class GatherResult:
    plan: GatherPlan
    d2d_s: float
    h2d_s: float
    bytes_d2d: int
    bytes_h2d: int


class StagingExecutor:
    """Writes planned chunks from a host image into bump-buffer slots, asynchronously."""

    def __init__(self, buf: torch.Tensor, chunk_bytes: int, device: str | torch.device, inflight: int = 2) -> None:
        self.buf = buf
        self.planner = StagingPlanner(chunk_bytes)
        self.inflight = inflight
        self._image: torch.Tensor | None = None
        self._copier = Copier(device, "staging-h2d")
        self._writes: dict[int, Completion] = {}

    def stage(self, target: str, image: torch.Tensor, lo_limit: int, hi: int) -> None:
        self.wait_all()
        self._image = image
        self.planner.plan(target, image.numel(), lo_limit, hi)

    def pump(self, slot_is_free: Callable[[int, int], bool]) -> int:
        """Retire finished writes, then start new ones up to the in-flight limit."""
        self.poll()
        if self._image is None:
            return 0
        started = self.planner.next_writes(slot_is_free, self.inflight - len(self._writes))
        for c in started:
            pair = (self.buf[c.dst_lo : c.dst_hi], self._image[c.src_lo : c.src_hi])
            self._writes[c.index] = self._copier.submit([pair])
        return len(started)

    def poll(self) -> None:
        for idx in [i for i, done in self._writes.items() if done.done()]:
            self._writes.pop(idx).wait()
            self.planner.write_done(idx)

    def wait_all(self) -> None:
        for idx in list(self._writes):
            self._writes.pop(idx).wait()
            self.planner.write_done(idx)

    def gather(self, target: str, image: torch.Tensor, weight_dst: torch.Tensor) -> GatherResult:
        """Fill `weight_dst` (the weight region) with `target`'s image: D2D clean, H2D the rest."""
        self.wait_all()  # never read a chunk under an active write
        plan = self.planner.gather_plan(target, image.numel())
        t0 = time.perf_counter()
        for c in plan.d2d:
            weight_dst[c.src_lo : c.src_hi].copy_(self.buf[c.dst_lo : c.dst_hi])
        _sync(weight_dst)
        t1 = time.perf_counter()
        for lo, hi in plan.h2d:
            weight_dst[lo:hi].copy_(image[lo:hi], non_blocking=True)
        _sync(weight_dst)
        t2 = time.perf_counter()
        self.planner.reset()
        self._image = None
        moved_h2d = sum(hi - lo for lo, hi in plan.h2d)
        return GatherResult(plan, t1 - t0, t2 - t1, plan.staged_bytes, moved_h2d)

    def close(self) -> None:
        self.wait_all()
        self._copier.close()


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
