"""Device KV bookkeeping for the active model: page pool, prefix index, session entries.

Every page has two independent holder counts (the device-side half of HKVR's lifetime
separation):

* cache refs: the prefix index and session entries that point at the page;
* use refs:   running calls that read/write it and D2H copies in flight (transfer pins).

A page is free only when both are zero; a page with use refs is never reclaimed, so an
eviction can drop the cache's pointer to a page under copy without the page being reused.
The allocator hands out the lowest free page first, which keeps the high-address tail of
the pool free for weight staging; pages the staging executor is writing are skipped.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


class PagePool:
    def __init__(
        self,
        num_pages: int,
        *,
        is_blocked: Callable[[int], bool] = lambda page: False,
        on_alloc: Callable[[int], None] = lambda page: None,
    ) -> None:
        self.num_pages = num_pages
        self.cache_refs = [0] * num_pages
        self.use_refs = [0] * num_pages
        self._free = list(range(num_pages))  # a heap: lowest address first
        self._is_blocked, self._on_alloc = is_blocked, on_alloc
        # Kept as pages change hands, so the counts a snapshot and every admission read
        # cost O(1) instead of a scan of the whole pool (milliseconds on the event loop).
        self._in_free = bytearray(b"\x01") * num_pages
        self._unused = num_pages  # pages with no use ref
        self._taken: list[int] = []  # a heap of -page for pages not free (lazy: checked on read)

    def alloc(self) -> int | None:
        """Lowest free, unblocked page (taken with one use ref), or None."""
        skipped, page = [], None
        while self._free:
            cand = heapq.heappop(self._free)
            if self._is_blocked(cand):
                skipped.append(cand)
                continue
            page = cand
            break
        for s in skipped:
            heapq.heappush(self._free, s)
        if page is not None:
            self._in_free[page] = 0
            self._take(page)
            self.use(page)
            self._on_alloc(page)
        return page

    def use(self, page: int) -> None:
        if self.use_refs[page] == 0:
            self._unused -= 1
        self.use_refs[page] += 1

    def unuse(self, page: int) -> None:
        assert self.use_refs[page] > 0, f"page {page} has no use ref"
        self.use_refs[page] -= 1
        if self.use_refs[page] == 0:
            self._unused += 1
        self._maybe_free(page)

    def cache(self, page: int) -> None:
        self.cache_refs[page] += 1

    def uncache(self, page: int) -> None:
        assert self.cache_refs[page] > 0, f"page {page} has no cache ref"
        self.cache_refs[page] -= 1
        self._maybe_free(page)

    def _maybe_free(self, page: int) -> None:
        if self.cache_refs[page] == 0 and self.use_refs[page] == 0 and not self._in_free[page]:
            self._in_free[page] = 1
            heapq.heappush(self._free, page)

    def _take(self, page: int) -> None:
        heapq.heappush(self._taken, -page)
        if len(self._taken) > 2 * self.num_pages:  # stale entries of pages freed since: rebuild
            self._taken = [-p for p in range(self.num_pages) if not self._in_free[p]]
            heapq.heapify(self._taken)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def num_unused(self) -> int:
        """Pages no call or copy holds: free now or after evicting cached prefixes."""
        return self._unused

    def used_pages(self) -> list[int]:
        free = set(self._free)
        return [p for p in range(self.num_pages) if p not in free]

    def highest_used(self) -> int:
        """Index of the highest page not free (-1 when the pool is empty)."""
        taken = self._taken
        while taken and self._in_free[-taken[0]]:
            heapq.heappop(taken)
        return -taken[0] if taken else -1


class DevicePrefixIndex:
    """Cumulative page hash -> device page, LRU. Holds one cache ref per entry."""

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self._map: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def match(self, hashes: list[int]) -> list[int]:
        pages = []
        for h in hashes:
            page = self._map.get(h)
            if page is None:
                break
            self._map.move_to_end(h)
            pages.append(page)
        return pages

    def insert(self, h: int, page: int) -> None:
        if h in self._map:
            self._map.move_to_end(h)
            return
        self._map[h] = page
        self._pool.cache(page)

    def evict_one(self) -> bool:
        """Drop the least recent entry whose page only the index holds. False if none."""
        for h, page in self._map.items():
            if self._pool.cache_refs[page] == 1 and self._pool.use_refs[page] == 0:
                del self._map[h]
                self._pool.uncache(page)
                return True
        return False

    def clear(self) -> None:
        for page in self._map.values():
            self._pool.uncache(page)
        self._map.clear()


@dataclass
class DeviceKvSession:
    """A finished call's KV kept for the session's return: tokens[i] has KV in pages[i // ps]."""

    session_id: str
    model: str
    tokens: list[int]
    pages: list[int]


class SessionCache:
    """session_id -> its last committed KV on device (LRU). Entries hold cache refs."""

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self._map: OrderedDict[str, DeviceKvSession] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def get(self, session_id: str) -> DeviceKvSession | None:
        return self._map.get(session_id)

    def entries(self) -> list[DeviceKvSession]:
        return list(self._map.values())

    def put(self, entry: DeviceKvSession) -> None:
        self.drop(entry.session_id)
        for page in entry.pages:
            self._pool.cache(page)
        self._map[entry.session_id] = entry

    def drop(self, session_id: str) -> None:
        old = self._map.pop(session_id, None)
        if old is not None:
            for page in old.pages:
                self._pool.uncache(page)

    def evict_lru(self) -> bool:
        if not self._map:
            return False
        self.drop(next(iter(self._map)))
        return True

    def clear(self) -> None:
        for sid in list(self._map):
            self.drop(sid)
