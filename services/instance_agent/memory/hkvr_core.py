"""Host KV registry bookkeeping (paper §4.3, App. B-C), pure: no tensors, no clock.

The simulator drives it directly; `hkvr.HostKvRegistry` wraps it with a host page pool and
asynchronous copies; all methods run on the engine's thread. A host page is keyed by (model,
rank, cumulative prefix hash); its invariants (lifetime separation, no early publication,
rank agreement, the switch barrier) and indexes are `HkvrCore`'s docstring, each with a test.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from talaria.services.instance_agent.memory.host_pages import (
    HkvrCounters,
    HostPage,
    Key,
    LayoutDescriptor,
    PageCopy,
    RankReport,
    RestorePlan,
    SavePlan,
    SessionKey,
    agreed_prefix,
)


@dataclass
class _Job:
    model: str
    keys: list[Key]
    agreed: tuple[int, ...]


@dataclass
class _SessionPrefix:
    model: str
    hashes: tuple[int, ...]
    pages: list[HostPage] = field(default_factory=list)
    published: int = 0  # leading hashes that are restorable now (== match(model, hashes))


class HkvrCore:
    """The simulator drives this class directly; `hkvr.HostKvRegistry` wraps it with a host page
    pool and asynchronous copies. All methods run on one thread (the engine's worker).

    Keys and states
        A host page is keyed by (model, rank, cumulative prefix hash) and carries a layout
        descriptor. It is `copying` from the moment a slot is reserved for its D2H copy until
        the copy's completion event is reported (`complete`), then `committed`.

    Invariants (each has a test)
        1. Lifetime separation. `pins` (transfer pins: a D2H or H2D copy in flight) and `refs`
           (cache references: session prefixes that include the page) are separate counts.
           A pinned page is never reclaimed, whatever its refs; an unreferenced page is
           reclaimed before any referenced one.
        2. No early publication. (model, hash) becomes restorable only when every rank's page
           for it is committed, so a page whose copy has not completed is never published.
        3. Rank agreement. A save publishes at most the longest page-aligned prefix on which
           every rank reports the same committed length and hashes; a disagreeing tail stays
           private (stored under that rank's own key, never matched) and is recomputed.
        4. Switch barrier. `pending_jobs(model)` lists the outgoing model's copies in flight; the
           engine drains exactly those before releasing the device KV region.

    Indexes (so a query costs O(1), not a walk over the session's pages)
        Each session prefix keeps `published`, the length of its restorable prefix, always equal
        to `match(model, hashes)`. `_readers[(model, h)]` lists the sessions whose restorable
        prefix contains h (an eviction cuts them back); `_waiting[(model, h)]` lists those whose
        restorable prefix stops just before h (a publication extends them). A save, a publication
        or an eviction updates only the sessions it touches.
    """

    def __init__(self, capacity_pages: int, ranks: int = 1) -> None:
        self.capacity = capacity_pages
        self.ranks = ranks
        self.pages: OrderedDict[Key, HostPage] = OrderedDict()  # LRU order, oldest first
        self.published: set[tuple[str, int]] = set()
        self.sessions: dict[SessionKey, _SessionPrefix] = {}
        self._readers: dict[tuple[str, int], set[SessionKey]] = {}
        self._waiting: dict[tuple[str, int], set[SessionKey]] = {}
        self.jobs: dict[int, _Job] = {}
        self.counters = HkvrCounters()
        self._free_slots = list(range(capacity_pages - 1, -1, -1))
        self._job_ids = itertools.count(1)
        self._ticks = itertools.count(1)
        # every reclaimable page (committed, unpinned) with refs <= 0 is here; entries that got
        # pinned again are skipped when a victim is chosen
        self._unreferenced: set[Key] = set()
        # Opt-in change feed for a consumer that mirrors `session_prefixes` incrementally (the
        # simulator's snapshots): sessions whose restorable length changed or that were dropped.
        self.changes: set[SessionKey] | None = None

    # -- save (D2H) ----------------------------------------------------------------------

    def plan_save(
        self, model: str, session_id: str, reports: list[RankReport], template: LayoutDescriptor
    ) -> SavePlan:
        """Reserve slots for every reported page not already held; pin them until `complete`."""
        ps = template.page_size
        agreed = agreed_prefix(reports, ps)
        if any(min(r.committed_tokens // ps, len(r.hashes)) > agreed for r in reports):
            self.counters.truncated_saves += 1
        job_id = next(self._job_ids)
        pages, move_to_end, ticks = self.pages, self.pages.move_to_end, self._ticks
        copies: list[PageCopy] = []
        keys: list[Key] = []
        for rep in reports:
            for j, h in enumerate(rep.hashes[: rep.committed_tokens // ps]):
                key = (model, rep.rank, h)
                page = pages.get(key)
                if page is not None:
                    move_to_end(key)  # LRU touch (with its tick) for every page already held
                    page.tick = next(ticks)
                    continue
                slot = self._take_slot()
                if slot is None:
                    self.counters.full_saves += 1
                    break  # later pages are useless without this one (cumulative hashes)
                desc = LayoutDescriptor(model, rep.rank, h, (j + 1) * ps, ps, template.dtype,
                                        template.attention, template.shape, template.itemsize)
                pages[key] = HostPage(key, slot, desc, pins=1, tick=next(ticks))  # unreclaimable until complete
                keys.append(key)
                copies.append(PageCopy(rep.rank, j, key, slot, desc))
        agreed_hashes = tuple(reports[0].hashes[:agreed]) if reports else ()
        self._set_session(session_id, model, agreed_hashes)
        self.jobs[job_id] = _Job(model, keys, agreed_hashes)
        self.counters.saved_pages += len(copies)
        return SavePlan(job_id, model, session_id, tuple(copies), agreed)

    def complete(self, job_id: int) -> list[int]:
        """The job's copy-completion event fired: commit, unpin, publish what is now whole."""
        job = self.jobs.pop(job_id)
        for key in job.keys:
            page = self.pages.get(key)
            if page is not None:
                page.state = "committed"
                page.pins -= 1
                if page.refs <= 0 and page.pins == 0:
                    self._unreferenced.add(key)  # reclaimable from now on
        return self._publish(job.model, job.agreed)

    def pending_jobs(self, model: str | None = None) -> list[int]:
        return [j for j, job in self.jobs.items() if model is None or job.model == model]

    def _publish(self, model: str, hashes: tuple[int, ...]) -> list[int]:
        """Publish the leading whole (every rank committed) pages of `hashes`; each
        publication also continues along the prefixes of the sessions waiting on it: a page a
        later save committed first (it shares this prefix, its copy finished sooner) waits
        for this one, and is published now rather than never."""
        out: list[int] = []
        published, pages, ranks = self.published, self.pages, range(self.ranks)
        todo = [hashes]
        while todo:
            for h in todo.pop():
                if (model, h) in published:
                    continue
                if any((page := pages.get((model, r, h))) is None or page.state != "committed" for r in ranks):
                    break  # prefix property: nothing past a hole is restorable
                published.add((model, h))
                out.append(h)
                for skey in self._waiting.pop((model, h), ()):
                    pre = self.sessions[skey]
                    self._advance(skey, pre)
                    if pre.published < len(pre.hashes):
                        todo.append(pre.hashes[pre.published:])
        return out

    # -- restore (H2D) -------------------------------------------------------------------

    def match(self, model: str, hashes: list[int] | tuple[int, ...]) -> int:
        """Leading pages of `hashes` that are published (restorable) for `model`."""
        n = 0
        for h in hashes:
            if (model, h) not in self.published:
                break
            n += 1
        return n

    def begin_restore(self, model: str, hashes: list[int] | tuple[int, ...]) -> RestorePlan:
        """Pin the longest published prefix of `hashes` for copying; counts a hit or a miss."""
        n = self.match(model, hashes)
        if n == 0:
            self.counters.misses += 1
            return RestorePlan(model, (), ())
        self.counters.hits += 1
        pages, move_to_end, ticks = self.pages, self.pages.move_to_end, self._ticks
        per_page = []
        for j, h in enumerate(hashes[:n]):
            row = []
            for r in range(self.ranks):
                page = pages[(key := (model, r, h))]
                page.pins += 1
                move_to_end(key)  # LRU touch
                page.tick = next(ticks)
                row.append(PageCopy(r, j, key, page.slot, page.desc))
            per_page.append(tuple(row))
        self.counters.restored_pages += n
        return RestorePlan(model, tuple(hashes[:n]), tuple(per_page))

    def end_restore(self, plan: RestorePlan) -> None:
        for row in plan.slots:
            for c in row:
                self.pages[c.key].pins -= 1

    # -- sessions ------------------------------------------------------------------------

    def _set_session(self, session_id: str, model: str, hashes: tuple[int, ...]) -> None:
        skey = (session_id, model)
        pages = self.pages
        held = [pages[k] for h in hashes for r in range(self.ranks) if (k := (model, r, h)) in pages]
        old = self.sessions.get(skey)
        if (old is not None and hashes[:len(old.hashes)] == old.hashes
                and list(map(id, held[:len(old.pages)])) == list(map(id, old.pages))):
            # Every later checkpoint of a session extends the prefix it already holds, over
            # the same live pages: ref the new pages only, and extend the index from where
            # it stands (its entries for the old hashes are still exact).
            for page in held[len(old.pages):]:
                page.refs += 1
                self._unreferenced.discard(page.key)
            old.hashes, old.pages = hashes, held
            self._advance(skey, old)
            self.sessions[skey] = self.sessions.pop(skey)  # the most recently saved last
            return
        self.drop_session(session_id, model)
        for page in held:
            page.refs += 1
            self._unreferenced.discard(page.key)
        pre = self.sessions[skey] = _SessionPrefix(model, hashes, held)
        self._advance(skey, pre)
        self._forget_oldest_sessions(keep=skey)

    def _forget_oldest_sessions(self, keep: SessionKey) -> None:
        """Past capacity / ranks sessions, some hold no page of their own (a page per rank is
        the least one holds), so the least recently saved are dropped: their refs go, and their
        pages are reclaimed first. Without it every session ever saved stayed (measured: 32 KB
        each for a 256-page prefix, 0.7 GB a day at 0.25 sessions/s; ~1 KB now), and each
        heartbeat listed them all."""
        limit = max(1, self.capacity // self.ranks)
        while len(self.sessions) > limit:
            oldest = next(iter(self.sessions))
            if oldest == keep:
                return
            self.drop_session(*oldest)

    def drop_session(self, session_id: str, model: str) -> None:
        skey = (session_id, model)
        old = self.sessions.pop(skey, None)
        if old is None:
            return
        for page in old.pages:
            if self.pages.get(page.key) is page:  # an evicted-and-recreated key is a new page
                page.refs -= 1
                if page.refs <= 0:
                    self._unreferenced.add(page.key)
        self._unindex(skey, old, 0)

    def shareable(self, session_id: str, model: str, hashes: list[int] | tuple[int, ...]) -> list[list[HostPage]]:
        """Per page, each rank's host page of the leading `hashes` that `session_id`'s own
        restorable prefix holds: what a peer may be sent for this session (issue 40). Pages
        another session (or tenant: the hashes are scoped) left are never in it."""
        pre = self.sessions.get((session_id, model))
        if pre is None:
            return []
        n, limit = 0, min(len(hashes), pre.published)
        while n < limit and hashes[n] == pre.hashes[n]:
            n += 1
        return [[self.pages[(model, r, h)] for r in range(self.ranks)] for h in hashes[:n]]

    def lease_shareable(self, session_id: str, model: str, hashes: list[int] | tuple[int, ...]) -> RestorePlan:
        """`shareable`'s pages, each pinned (a transfer pin) until `end_restore(plan)`: for an
        export whose bytes are copied out after this returns (vLLM: by the agent's process,
        from the shared pool), while the engine may save and evict around them. Counts no hit."""
        rows = self.shareable(session_id, model, hashes)
        for row in rows:
            for page in row:
                page.pins += 1
        return RestorePlan(model, tuple(hashes[:len(rows)]),
                           tuple(tuple(PageCopy(p.key[1], j, p.key, p.slot, p.desc) for p in row)
                                 for j, row in enumerate(rows)))

    def session_hashes(self, session_id: str, model: str) -> list[int]:
        """The hashes of the session's own restorable prefix (what a drain's push lists)."""
        pre = self.sessions.get((session_id, model))
        return [] if pre is None else list(pre.hashes[: pre.published])

    def session_tokens(self, session_id: str, model: str, page_size: int) -> int:
        pre = self.sessions.get((session_id, model))
        return 0 if pre is None else pre.published * page_size

    def session_prefixes(self, page_size: int) -> list[tuple[str, str, int]]:
        return [(sid, model, pre.published * page_size)
                for (sid, model), pre in self.sessions.items() if pre.published]

    # -- restorable-prefix index ---------------------------------------------------------

    def _advance(self, skey: SessionKey, pre: _SessionPrefix) -> None:
        """Extend `pre.published` over hashes that are published now; wait on the next one."""
        model, hashes, published, readers = pre.model, pre.hashes, self.published, self._readers
        n = pre.published
        while n < len(hashes) and (key := (model, hashes[n])) in published:
            group = readers.get(key)
            if group is None:
                readers[key] = {skey}
            else:
                group.add(skey)
            n += 1
        if n != pre.published and self.changes is not None:
            self.changes.add(skey)
        pre.published = n
        if n < len(hashes):
            self._waiting.setdefault((model, hashes[n]), set()).add(skey)

    def _unindex(self, skey: SessionKey, pre: _SessionPrefix, keep: int) -> None:
        """Cut `pre.published` back to `keep` pages, removing it from the indexes past that."""
        model, hashes = pre.model, pre.hashes
        for h in hashes[keep:pre.published]:
            _discard(self._readers, (model, h), skey)
        if pre.published < len(hashes):
            _discard(self._waiting, (model, hashes[pre.published]), skey)
        if keep != pre.published and self.changes is not None:
            self.changes.add(skey)
        pre.published = keep

    def _unpublished(self, model: str, h: int, position: int) -> None:
        """(model, h), page `position` of every prefix holding it, is no longer restorable."""
        for skey in self._readers.pop((model, h), ()):
            pre = self.sessions[skey]
            j = position if pre.hashes[position:position + 1] == (h,) else pre.hashes.index(h)
            self._unindex(skey, pre, j)
            self._waiting.setdefault((model, h), set()).add(skey)

    # -- capacity ------------------------------------------------------------------------

    @property
    def used_pages(self) -> int:
        return len(self.pages)

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = self._victim()
        if victim is None:
            return None
        return self._evict(victim)

    def _victim(self) -> HostPage | None:
        """Least recently used unpinned page, unreferenced pages first. Never a pinned one."""
        free = [p for k in self._unreferenced if (p := self.pages[k]).pins == 0 and p.state == "committed"]
        if free:
            return min(free, key=lambda p: p.tick)
        for page in self.pages.values():  # every reclaimable page is referenced: oldest of them
            if page.pins == 0 and page.state == "committed":
                return page
        return None

    def _evict(self, page: HostPage) -> int:
        assert page.pins == 0 and page.state == "committed", "evicting a page under transfer"
        del self.pages[page.key]
        self._unreferenced.discard(page.key)
        model, _, h = page.key
        if (model, h) in self.published:
            self.published.discard((model, h))
            self._unpublished(model, h, page.desc.committed_tokens // page.desc.page_size - 1)
        self.counters.evictions += 1
        return page.slot


def _discard(index: dict, key, skey: SessionKey) -> None:
    group = index.get(key)
    if group is not None:
        group.discard(skey)
        if not group:
            del index[key]
