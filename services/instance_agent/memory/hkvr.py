"""Host KV registry on tensors: one host page pool shared by every model and layout.

    host pool  [capacity_pages, slot_bytes] uint8 (pinned when the device is CUDA)
    slot s     holds one rank's slab of one KV page, viewed through its LayoutDescriptor
               (page-first: [layers, k|v, page_size, kv_heads/ranks, head_dim])

A finished call's full pages are copied D2H asynchronously (`save`); the engine keeps a
use ref (transfer pin) on each source device page until the copy's completion event is
seen in `poll`/`drain`, and only then does the core commit and publish. On a return,
`restore` copies the longest published prefix H2D into freshly allocated device pages.
Tensor-parallel ranks are modelled as head shards of one device page.

Threading: every method runs on the engine's worker thread; only the byte copies run on
the copier's thread (CPU) or stream (CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from talaria.services.instance_agent.memory.copier import Completion, Copier
from talaria.services.instance_agent.memory.hkvr_core import HkvrCore
from talaria.services.instance_agent.memory.host_pages import LayoutDescriptor, PageCopy, RankReport, SavePlan


class HostKvRegistry:
    def __init__(self, capacity_pages: int, slot_bytes: int, device: str | torch.device, ranks: int) -> None:
        self.device = torch.device(device)
        self.core = HkvrCore(capacity_pages, ranks)
        self.ranks = ranks
        self.slot_bytes = slot_bytes
        self.pool = torch.empty(
            (capacity_pages, slot_bytes), dtype=torch.uint8, pin_memory=self.device.type == "cuda"
        )
        self._copier = Copier(self.device, "hkvr-d2h")
        self._inflight: dict[int, tuple[Completion, Callable[[], None]]] = {}

    # -- views ---------------------------------------------------------------------------

    def _host_view(self, c: PageCopy) -> torch.Tensor:
        return self.pool[c.slot, : c.desc.nbytes].view(getattr(torch, c.desc.dtype)).view(c.desc.shape)

    def _dev_view(self, kv: torch.Tensor, page: int, rank: int) -> torch.Tensor:
        heads = kv.shape[4] // self.ranks
        return kv[page, :, :, :, rank * heads : (rank + 1) * heads]

    # -- save ----------------------------------------------------------------------------

    def save(
        self,
        model: str,
        session_id: str,
        kv: torch.Tensor,
        pages: list[int],
        reports: list[RankReport],
        template: LayoutDescriptor,
        on_done: Callable[[], None],
    ) -> SavePlan:
        """Start the D2H copy of the reported pages; `on_done` runs on completion (via poll)."""
        plan = self.core.plan_save(model, session_id, reports, template)
        pairs = [(self._host_view(c), self._dev_view(kv, pages[c.page_index], c.rank)) for c in plan.copies]
        done = self._copier.submit(pairs) if pairs else Completion()
        self._inflight[plan.job_id] = (done, on_done)
        return plan

    def poll(self) -> int:
        """Retire every finished copy: commit + publish in the core, release transfer pins."""
        finished = [j for j, (done, _) in self._inflight.items() if done.done()]
        for job in finished:
            self._retire(job)
        return len(finished)

    def drain(self, model: str | None = None) -> int:
        """Switch barrier: wait for `model`'s outstanding D2H copies only."""
        jobs = [j for j in self.core.pending_jobs(model) if j in self._inflight]
        for job in jobs:
            self._inflight[job][0].wait()
            self._retire(job)
        return len(jobs)

    def _retire(self, job: int) -> None:
        _, on_done = self._inflight.pop(job)
        self.core.complete(job)
        on_done()

    # -- restore -------------------------------------------------------------------------

    def restore(
        self, model: str, hashes: list[int], kv: torch.Tensor, alloc: Callable[[], int]
    ) -> list[int]:
        """Copy the longest published prefix of `hashes` into fresh device pages (returned)."""
        plan = self.core.begin_restore(model, hashes)
        pages: list[int] = []
        try:
            for row in plan.slots:
                page = alloc()
                pages.append(page)
                for c in row:
                    self._dev_view(kv, page, c.rank).copy_(self._host_view(c), non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        finally:
            self.core.end_restore(plan)
        return pages

    # -- migration (issue 40): a peer's pull ------------------------------------------------

    def export_pages(self, model: str, session_id: str, hashes: list[int], limit: int
                     ) -> list[tuple[int, LayoutDescriptor, list[bytes]]]:
        """(hash, layout, each rank's slab bytes) of up to `limit` leading pages of `hashes`
        that the session's own restorable prefix holds. Engine thread: the bytes are copied
        here, so no page is read after it could be evicted."""
        rows = self.core.shareable(session_id, model, hashes[:limit])
        return [(row[0].key[2], row[0].desc, [self.pool[p.slot, : p.desc.nbytes].numpy().tobytes() for p in row])
                for row in rows]

    def session_hashes(self, model: str, session_id: str) -> list[int]:
        """The session's own restorable host prefix, by hash (engine thread)."""
        self.drain(model)  # checkpoints still copying publish first
        return self.core.session_hashes(session_id, model)

    def import_pages(self, model: str, session_id: str, hashes: list[int], slabs: list[list[bytes]],
                     template: LayoutDescriptor) -> int:
        """Store pulled pages as the session's host prefix (published at once: the bytes are
        already here) and return the tokens now restorable; admission restores them as any
        host prefix. The caller checked each slab's size and digest."""
        self.drain(model)  # pages a checkpoint of ours is still copying publish first (the prefix may share them)
        ps = template.page_size
        reports = [RankReport(r, len(hashes) * ps, tuple(hashes)) for r in range(self.ranks)]
        plan = self.core.plan_save(model, session_id, reports, template)
        for c in plan.copies:
            self.pool[c.slot, : c.desc.nbytes].copy_(torch.frombuffer(bytearray(slabs[c.page_index][c.rank]),
                                                                      dtype=torch.uint8))
        self.core.complete(plan.job_id)
        return self.core.session_tokens(session_id, model, ps)

    def close(self) -> None:
        self.drain(None)
        self._copier.close()
