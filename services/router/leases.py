"""Soft-reservation leases and their indexes. Pure data; changed only by `RouterState.apply`.

A lease `(s, m, i, k, t_exp)` (paper §4.1), held as the `LeaseIssued` event that installed it,
says: session `s`'s next call for model `m` is expected on instance `i`, whose prefix handle is
the completed call `k`; it is live while `now < t_exp`. While live it charges one admission unit
against `i` in the load overlay. `LeaseBook` indexes them so that no routing decision scans all
sessions (its indexes and their invariant: there).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right, insort
from dataclasses import dataclass, field

import msgspec

from talaria.shared.events import LeaseConsumed, LeaseDiscarded, LeaseIssued, RoutingDecision


@dataclass
class LeaseBook:
    """Every live lease, with three indexes so that no routing decision scans all sessions:

        by_instance[i] -> sorted expiries of leases on i      live count = len - bisect(now)
        by_model[m]    -> sorted expiries of leases for m     (reserved returns, Eq. 2)
        heap           -> (expires_at, session, call)         tick() pops the dead ones

    Invariant: every lease held in `SessionEntry.lease` has exactly one expiry in
    `by_instance[lease.instance_id]` and one in `by_model[lease.model]`; the heap may also hold
    entries of leases that were since consumed or replaced (lazy deletion: `prune` pops them
    once they reach the top, `due` skips them).
    """

    leases: dict[str, LeaseIssued] = field(default_factory=dict)  # session -> its one lease
    by_instance: dict[str, list[float]] = field(default_factory=dict)
    by_model: dict[str, list[float]] = field(default_factory=dict)
    heap: list[tuple[float, str, str]] = field(default_factory=list)

    def add(self, lease: LeaseIssued) -> None:
        self.remove(lease.session_id)
        self.leases[lease.session_id] = lease
        insort(self.by_instance.setdefault(lease.instance_id, []), lease.expires_at)
        insort(self.by_model.setdefault(lease.model, []), lease.expires_at)
        heapq.heappush(self.heap, (lease.expires_at, lease.session_id, lease.call_id))

    def remove(self, session_id: str) -> LeaseIssued | None:
        lease = self.leases.pop(session_id, None)
        if lease is not None:
            _drop(self.by_instance, lease.instance_id, lease.expires_at)
            _drop(self.by_model, lease.model, lease.expires_at)
            self.prune()
        return lease

    def live_on(self, instance_id: str, now: float) -> int:
        """Live leases charged against `instance_id` at `now` (O(log n))."""
        expiries = self.by_instance.get(instance_id)
        return len(expiries) - bisect_right(expiries, now) if expiries else 0

    def live_for(self, model: str, now: float) -> int:
        """Live leases for `model` anywhere: the reserved returns Eq. 2 counts as demand."""
        expiries = self.by_model.get(model)
        return len(expiries) - bisect_right(expiries, now) if expiries else 0

    def due(self, now: float) -> list[LeaseIssued]:
        """Leases dead at `now` (expires_at <= now), oldest first. Read-only.

        Entries with key <= now form a subtree at the heap's root (a child is never
        smaller than its parent), so this walks only that subtree: O(dead), not O(leases).
        """
        heap, out, stack = self.heap, [], [0] if self.heap else []
        while stack:
            k = stack.pop()
            expires_at, session_id, call_id = heap[k]
            if expires_at > now:
                continue
            lease = self.leases.get(session_id)
            if lease is not None and lease.call_id == call_id and lease.expires_at == expires_at:
                out.append(lease)
            stack.extend(c for c in (2 * k + 1, 2 * k + 2) if c < len(heap))
        out.sort(key=lambda lease: (lease.expires_at, lease.session_id))
        return out

    def prune(self) -> None:
        """Drop heap entries of leases that no longer exist (called from the fold)."""
        heap = self.heap
        while heap:
            expires_at, session_id, call_id = heap[0]
            lease = self.leases.get(session_id)
            if lease is not None and lease.call_id == call_id and lease.expires_at == expires_at:
                return
            heapq.heappop(heap)

    def to_list(self) -> list[dict]:
        return [msgspec.structs.asdict(lease) for lease in self.leases.values()]

    @classmethod
    def from_list(cls, rows: list[dict]) -> LeaseBook:
        book = cls()
        for row in rows:
            book.add(LeaseIssued(**row))
        return book


def settlement(lease: LeaseIssued | None, decision: RoutingDecision) -> list[LeaseConsumed | LeaseDiscarded]:
    """The lease event a routing decision records: the session's lease consumed by, or
    discarded (with the decision's reason) for, the decided call; none without a lease."""
    if lease is None or decision.lease_outcome == "none":
        return []
    at, call_id = decision.decided_at, decision.call_id
    if decision.lease_outcome == "consumed":
        return [LeaseConsumed(lease.session_id, lease.model, lease.instance_id, call_id, at)]
    return [LeaseDiscarded(lease.session_id, lease.model, lease.instance_id, call_id,
                           decision.discard_reason or "", at)]


def _drop(index: dict[str, list[float]], key: str, expires_at: float) -> None:
    expiries = index.get(key)
    if not expiries:
        return
    pos = bisect_right(expiries, expires_at) - 1
    if pos >= 0 and expiries[pos] == expires_at:
        del expiries[pos]
    if not expiries:
        del index[key]
