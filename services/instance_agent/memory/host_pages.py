"""The host KV registry's records (paper App. B-C): how a rank's page is laid out, what
each TP rank reports it committed and the rule that decides how much of a save all ranks
agree on, the host pages themselves, and the copy plans `HkvrCore` hands to its executor.

Pure data; the bookkeeping that changes them is `hkvr_core.HkvrCore`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

Key = tuple[str, int, int]  # (model, rank, prefix hash)


class LayoutDescriptor(NamedTuple):
    """How one rank's page slab is laid out (a tuple: one is built per saved page)."""

    model: str
    rank: int
    prefix_hash: int
    committed_tokens: int
    page_size: int
    dtype: str
    attention: str  # mha | gqa | mla | mamba
    shape: tuple[int, ...]  # of this rank's page slab
    itemsize: int = 4

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class RankReport:
    """What one TP rank says it committed: token count and cumulative hashes of full pages."""

    rank: int
    committed_tokens: int
    hashes: tuple[int, ...]


@dataclass(slots=True)
class HostPage:
    key: Key
    slot: int
    desc: LayoutDescriptor
    state: Literal["copying", "committed"] = "copying"
    pins: int = 0
    refs: int = 0
    tick: int = 0  # LRU stamp: the order of `HkvrCore.pages`, as a number


class PageCopy(NamedTuple):
    rank: int
    page_index: int  # position in the saved sequence's page list
    key: Key
    slot: int
    desc: LayoutDescriptor


@dataclass(frozen=True)
class SavePlan:
    job_id: int
    model: str
    session_id: str
    copies: tuple[PageCopy, ...]
    agreed_pages: int


@dataclass(frozen=True)
class RestorePlan:
    model: str
    hashes: tuple[int, ...]
    slots: tuple[tuple[PageCopy, ...], ...]  # per page: one entry per rank


@dataclass
class HkvrCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    saved_pages: int = 0
    restored_pages: int = 0
    truncated_saves: int = 0  # saves whose published prefix was cut by rank disagreement
    full_saves: int = 0  # saves cut short because no slot could be reclaimed


SessionKey = tuple[str, str]  # (session id, model)


def agreed_prefix(reports: list[RankReport], page_size: int) -> int:
    """Longest page count on which all ranks report the same committed hashes."""
    if not reports:
        return 0
    n = min(min(r.committed_tokens // page_size, len(r.hashes)) for r in reports)
    first = reports[0].hashes
    if all(r.hashes[:n] == first[:n] for r in reports[1:]):
        return n  # the common case, one tuple comparison per rank
    for j in range(n):
        if any(r.hashes[j] != first[j] for r in reports[1:]):
            return j
    return n
