"""D2D weight staging (paper §4.4): pre-copy the next model's weights into free KV space.

    bump buffer:  | weights(m) | KV pages, low first ...     ...free... |c3|c2|c1|c0| runtime |
                                                                 staging slots grow downward
    chunk i holds bytes [i*C, (i+1)*C) of the next model's weight image, in the slot
    [hi - (i+1)*C, hi - i*C); slots stay above max(weights(m), weights(m')) so the gather
    never overwrites its own source.

`StagingPlanner` (staging_plan.py) is pure bookkeeping, driven by the simulator too;
`StagingExecutor` moves bytes (a chunk's states, and why nothing reads one mid-write: there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from talaria.services.instance_agent.memory.copier import Completion, Copier
from talaria.services.instance_agent.memory.staging_plan import (  # noqa: F401  (re-exported)
    Chunk,
    ChunkState,
    GatherPlan,
    StagingPlanner,
)


@dataclass
class GatherResult:
    plan: GatherPlan
    d2d_s: float
    h2d_s: float
    bytes_d2d: int
    bytes_h2d: int


class StagingExecutor:
    """Writes planned chunks from a host image into bump-buffer slots, asynchronously.

    Chunk states: missing -> writing -> clean; clean -> dirty when a KV page allocation
    overlaps the slot; dirty/missing chunks are (re)written only while their slot is free.
    While a chunk is `writing` the KV allocator skips pages overlapping it (`blocked`), so no
    page is ever handed out over bytes being written, and nothing reads a chunk mid-write.
    At switch time the executor waits for writes in flight, copies clean chunks D2D and
    loads dirty or missing ones from the host image.
    """

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
