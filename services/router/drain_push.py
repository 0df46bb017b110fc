"""A drain pushes its sessions' KV ahead of their next calls (issue 40). Pure: no I/O.

When an instance is drained, every session whose KV lives there (homed there in the book,
or reported in its snapshot's device or host registry and homed nowhere else) is moved:
`plan` names, per session, the instance its next call would most likely land on, and asks
that agent to pull the pages from the drained holder (`KvPushRequested`); its `KvPushed`
report moves the session's home there (`PushBook.fold_pushed`), so the next call finds its
KV in that instance's host registry. A push unanswered for `RETRY_AFTER_S` is asked again,
up to `ATTEMPTS` times; one that moved fewer pages than the holder listed, never reported,
or that no instance can take loses that session's context (counted in the drain's status).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from talaria.services.router.instances import unavailable
from talaria.shared.events import KvPushed, KvPushRequested

RETRY_AFTER_S = 30.0  # a push not reported by then is asked again (its agent may have restarted)
ATTEMPTS = 3  # asks per session before its context counts as lost


@dataclass
class PushBook:
    """The drains' pushes: asked and unanswered, moved and lost, per holder."""

    pending: dict[str, KvPushRequested] = field(default_factory=dict)  # session -> the last ask
    moved: dict[str, set[str]] = field(default_factory=dict)  # holder -> sessions moved off it
    lost: dict[str, dict[str, str]] = field(default_factory=dict)  # holder -> session -> why

    def fold_requested(self, ask: KvPushRequested) -> None:
        self.pending[ask.session_id] = ask

    def fold_pushed(self, done: KvPushed) -> bool:
        """Fold a report; True when the session's KV now lives on `done.instance_id`."""
        ask = self.pending.get(done.session_id)
        if ask is None or ask.holder != done.holder or ask.instance_id != done.instance_id:
            return False  # a stale report (a retry went elsewhere, or this push was not ours)
        del self.pending[done.session_id]
        if done.pages < done.listed:
            why = done.why or f"{done.pages} of {done.listed} pages arrived"
            self.lost.setdefault(done.holder, {})[done.session_id] = why
            return False
        self.moved.setdefault(done.holder, set()).add(done.session_id)
        return done.pages > 0

    def settled(self, holder: str, session_id: str) -> bool:
        return session_id in self.moved.get(holder, ()) or session_id in self.lost.get(holder, {})

    def forget(self, holder: str) -> None:
        """The holder is back in service (restarted): a later drain starts afresh."""
        self.moved.pop(holder, None)
        self.lost.pop(holder, None)
        for s in [s for s, a in self.pending.items() if a.holder == holder]:
            del self.pending[s]


def kv_on(state, holder: str) -> list[tuple[str, str]]:
    """(session, model) of every session whose KV lives on `holder`: homed there in the book
    (live or idle, not yet expired), or in its snapshot's device or host registry and homed
    nowhere else (a session that returned elsewhere has moved on)."""
    out = {(s, m) for m, homes in state.homes.by_instance.get(holder, {}).items() for s in homes.idle_since}
    view = state.instances.get(holder)
    if view is not None:
        for kv in view.snapshot.sessions:
            home = state.homes.home_of.get(kv.session_id)
            if kv.state in ("device", "host") and kv.kv_tokens > 0 and (home is None or home[0] == holder):
                out.add((kv.session_id, kv.model))
    return sorted(out)


def choose_target(state, holder: str, model: str, now: float, stale_after_s: float):
    """The InstanceView where the session's next call would most likely land, of the instances able to take
    its pages: the cost model's hard filters (`instances.unavailable`, serving `model`,
    not pinned to another), with `model`'s KV bytes reported and a page server; then the
    cheapest KV home first: `model` resident, then the fewest sessions homed, then the id.
    (Not a full pricing: the next call's prompt is not known until it comes.)"""
    best, best_key = None, None
    for iid, view in state.instances.items():
        snap = view.snapshot
        if iid == holder or not snap.page_address or unavailable(view, state.draining, now, stale_after_s):
            continue
        res = view.models.get(model)
        if res is None or res.kv_bytes_per_token <= 0 or (view.pinned is not None and view.pinned != model):
            continue
        resident = model in (snap.active_model, snap.pinned_model)
        key = (not resident, state.homes.sessions_on(iid), iid)
        if best_key is None or key < best_key:
            best, best_key = view, key
    return best


def plan(state, holder: str, now: float, stale_after_s: float, owns
         ) -> tuple[list[KvPushRequested], list[tuple[str, str]]]:
    """(pushes to ask, (session, why) of sessions no push can move) for `holder`'s sessions no
    call runs for, not yet settled and not pending (or pending past RETRY_AFTER_S); asks only
    for the sessions `owns` (this router's partitions)."""
    view = state.instances.get(holder)
    address = view.snapshot.page_address if view is not None else ""
    asks: list[KvPushRequested] = []
    lost: list[tuple[str, str]] = []
    book = state.pushes
    for session_id, model in kv_on(state, holder):
        if book.settled(holder, session_id) or _running(state, session_id):
            continue
        prior = book.pending.get(session_id)
        if prior is not None and now - prior.at < RETRY_AFTER_S:
            continue
        attempt = prior.attempt + 1 if prior is not None else 1
        # Every router counts the lost alike (any may answer `talaria drain`); only the
        # session's owner asks.
        if attempt > ATTEMPTS:
            lost.append((session_id, f"no report after {ATTEMPTS} asks"))
            continue
        if not address:
            lost.append((session_id, f"{holder} serves no KV pages (migration off there)"))
            continue
        target = choose_target(state, holder, model, now, stale_after_s)
        if target is None:
            lost.append((session_id, f"no instance that serves {model} can take KV pages"))
        elif owns(session_id):
            asks.append(KvPushRequested(target.snapshot.instance_id, session_id, model, holder, address, now,
                                        attempt))
    return asks, lost


def _running(state, session_id: str) -> bool:
    home = state.homes.home_of.get(session_id)
    if home is None:
        return False
    homes = state.homes.by_instance.get(home[0], {}).get(home[1])
    return homes is not None and bool(homes.running.get(session_id))
