"""Staging bookkeeping, pure (no torch, no clock): chunk layout, states, dirty tracking and
the switch-time gather plan. `staging.StagingExecutor` moves the bytes; the simulator drives
this planner directly. See `staging.py` for the layout diagram.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

ChunkState = Literal["missing", "writing", "clean", "dirty", "unplaced"]


@dataclass(slots=True)
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


@functools.lru_cache(maxsize=256)
def _layout(chunk_bytes: int, weight_bytes: int, lo_limit: int, hi: int) -> tuple[tuple, ...]:
    """Chunk geometry (the same few layouts recur on every re-plan, so it is computed once)."""
    out = []
    for i in range(-(-weight_bytes // chunk_bytes)):
        src_lo, src_hi = i * chunk_bytes, min((i + 1) * chunk_bytes, weight_bytes)
        dst_lo = hi - (i + 1) * chunk_bytes
        if dst_lo < lo_limit:
            out.append((i, src_lo, src_hi, -1, -1, "unplaced"))
        else:
            out.append((i, src_lo, src_hi, dst_lo, dst_lo + (src_hi - src_lo), "missing"))
    return tuple(out)


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
    """Chunk states of the model being staged. Every state change keeps per-state counts (one
    at a time in `_set`, in bulk in `write_through`), so the questions asked on every step
    (staged bytes, anything in flight, anything left to write) cost O(1), and a KV
    allocation visits only the chunks laid out over it."""

    chunk_bytes: int
    target: str | None = None
    chunks: list[Chunk] = field(default_factory=list)
    dirty_events: int = 0
    _top: int = 0  # `hi` of the current layout: chunk i sits just below top - i * chunk_bytes
    _clean_bytes: int = 0
    _count: dict[str, int] = field(default_factory=dict)
    _first_pending: int = 0  # no chunk below this index is missing or dirty

    def plan(self, target: str, weight_bytes: int, lo_limit: int, hi: int) -> None:
        """Lay out `target`'s chunks in slots from `hi` downward, none below `lo_limit`."""
        self.target, self._top = target, hi
        self.chunks = [Chunk(*g) for g in _layout(self.chunk_bytes, weight_bytes, lo_limit, hi)]
        self._recount()

    def reset(self) -> None:
        self.target, self.chunks = None, []
        self._recount()

    def _recount(self) -> None:
        self._count = {"missing": 0, "writing": 0, "clean": 0, "dirty": 0, "unplaced": 0}
        for c in self.chunks:
            self._count[c.state] += 1
        self._clean_bytes = sum(c.nbytes for c in self.chunks if c.state == "clean")
        self._first_pending = 0

    def _set(self, c: Chunk, state: ChunkState) -> None:
        self._count[c.state] -= 1
        self._count[state] += 1
        if c.state == "clean":
            self._clean_bytes -= c.nbytes
        if state == "clean":
            self._clean_bytes += c.nbytes
        elif state == "dirty" and c.index < self._first_pending:
            self._first_pending = c.index
        c.state = state

    def _over(self, lo: int, hi: int) -> list[Chunk]:
        """The chunks whose slot can overlap [lo, hi): slots are laid out downward from
        `_top` in index order, so only an index window needs checking."""
        cb = self.chunk_bytes
        first = max(0, (self._top - hi) // cb - 1)
        last = min(len(self.chunks), (self._top - lo) // cb + 1)
        return self.chunks[first:last]

    def _writable(self, slot_is_free: Callable[[int, int], bool], limit: int) -> list[Chunk]:
        """Up to `limit` missing/dirty chunks whose slot is free, in index order; the scan
        starts at the first chunk that can still need a write, and moves that mark on."""
        out: list[Chunk] = []
        if limit <= 0 or self._count["missing"] + self._count["dirty"] == 0:
            return out
        chunks, i, first = self.chunks, self._first_pending, None
        while i < len(chunks) and len(out) < limit:
            c = chunks[i]
            if c.state == "missing" or c.state == "dirty":
                if slot_is_free(c.dst_lo, c.dst_hi):
                    out.append(c)
                elif first is None:
                    first = i
            i += 1
        self._first_pending = i if first is None else first
        return out

    def next_writes(self, slot_is_free: Callable[[int, int], bool], limit: int) -> list[Chunk]:
        """Mark up to `limit` missing/dirty chunks whose slot is free as writing."""
        out = self._writable(slot_is_free, limit)
        for c in out:
            self._set(c, "writing")
        return out

    def write_through(self, slot_is_free: Callable[[int, int], bool], limit: int) -> int:
        """`next_writes` and `write_done` for each, as one bulk transition: for a driver (the
        simulator) whose writes have all completed by the time it asks. Returns the count."""
        out = self._writable(slot_is_free, limit)
        for c in out:
            self._count[c.state] -= 1
            c.state = "clean"
        self._count["clean"] += len(out)
        self._clean_bytes += sum([c.nbytes for c in out])
        return len(out)

    def write_done(self, index: int) -> None:
        c = self.chunks[index]
        if c.state == "writing":
            self._set(c, "clean")

    def blocked(self, lo: int, hi: int) -> bool:
        """True when [lo, hi) overlaps a chunk being written: the allocator must skip it."""
        if not self._count["writing"]:
            return False
        return any(c.state == "writing" and c.overlaps(lo, hi) for c in self._over(lo, hi))

    def on_kv_alloc(self, lo: int, hi: int) -> None:
        if not self._count["clean"]:
            return
        for c in self._over(lo, hi):
            if c.state == "clean" and c.overlaps(lo, hi):
                self._set(c, "dirty")
                self.dirty_events += 1

    def writing(self) -> list[Chunk]:
        if not self._count["writing"]:
            return []
        return [c for c in self.chunks if c.state == "writing"]

    def staged_bytes(self) -> int:
        return self._clean_bytes

    def gather_plan(self, target: str, weight_bytes: int) -> GatherPlan:
        if target != self.target:
            return GatherPlan(target, (), ((0, weight_bytes),), 0, weight_bytes, 0)
        if self._count["writing"]:
            raise RuntimeError("gather planned while a staging write is in flight")
        d2d = tuple(c for c in self.chunks if c.state == "clean")
        h2d = tuple((c.src_lo, c.src_hi) for c in self.chunks if c.state != "clean")
        staged = self._clean_bytes
        return GatherPlan(target, d2d, h2d, staged, weight_bytes - staged, self._count["dirty"])
