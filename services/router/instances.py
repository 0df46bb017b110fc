"""What the router knows about one instance: its latest snapshot plus the in-flight overlay.

Per-snapshot lookups (model residency by name, session KV by (session, model)) are built
once per snapshot, lazily, and reused while the snapshot is current, so a routing decision
costs O(instances), never O(sessions). When consecutive snapshots share the very same
`sessions` list object (an agent or the simulator that did not rebuild it), the KV index
is carried over instead of rebuilt.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

import msgspec

from talaria.shared.snapshots import InstanceSnapshot, ModelResidency, SessionKv

ON_DEVICE = ("active", "resident")  # weights in HBM: no open needed


@dataclass
class InstanceView:
    """Latest snapshot plus the overlay of calls routed since that snapshot.

    Invariant: `overlay` holds exactly the calls routed to this instance after the current
    snapshot was received and not yet finished; a fresh snapshot already counts the rest.
    """

    snapshot: InstanceSnapshot
    received_at: float
    overlay: dict[str, tuple[int, str, int]] = field(default_factory=dict)  # call -> (tokens, model, new)
    overlay_tokens: int = 0  # prompt tokens (the KV they will hold)
    overlay_new_tokens: int = 0  # of those, what must be computed (the prefix found is reused)
    overlay_models: dict[str, int] = field(default_factory=dict)
    inflight: set[str] = field(default_factory=set)  # every unfinished call placed here
    models: dict[str, ModelResidency] = field(init=False)
    pinned: str | None = field(init=False)
    _kv: dict[tuple[str, str], SessionKv] | None = field(default=None, init=False, repr=False)
    memo: dict = field(default_factory=dict, init=False, repr=False)  # costs.py per-model cache
    prior: InitVar[InstanceView | None] = None  # the view this one replaces (reuse its lookups)

    def __post_init__(self, prior: InstanceView | None = None) -> None:
        snap = self.snapshot
        if prior is not None:
            old = prior.snapshot
            if old.models is snap.models and old.pool == snap.pool and old.pinned_model == snap.pinned_model and old.active_model == snap.active_model:
                # same residency list object: the lookup table and pinned model are unchanged
                self.models, self.pinned = prior.models, prior.pinned
                if prior.memo and old.sessions is snap.sessions and _same_but_stamp(old, snap):
                    # a heartbeat re-send (only version/at differ): the per-model pricing
                    # memo is derived from the snapshot alone, so it stays valid
                    self.memo = prior.memo
                return
        self.models = {m.model: m for m in snap.models}
        self.pinned = _pinned_model(snap) if snap.pool == "hot" else None

    def restamp(self, snapshot: InstanceSnapshot, received_at: float) -> bool:
        """Take `snapshot` in place when it differs from the current one only in version and
        time (a heartbeat re-send): the same as replacing this view with a fresh one that
        inherits `inflight` and the lookups (the overlay is reset as by any fresh snapshot).
        Returns False, changing nothing, for any other snapshot."""
        old = self.snapshot
        if (old.sessions is not snapshot.sessions or old.models is not snapshot.models
                or not _same_but_stamp(old, snapshot)):
            return False
        self.snapshot = snapshot
        self.received_at = received_at
        self.overlay = {}
        self.overlay_tokens = 0
        self.overlay_new_tokens = 0
        self.overlay_models = {}
        return True

    @property
    def instance_id(self) -> str:
        return self.snapshot.instance_id

    @property
    def overlay_calls(self) -> int:
        return len(self.overlay)

    @property
    def kv(self) -> dict[tuple[str, str], SessionKv]:
        """(session, model) -> the KV the instance reports for it (device or host)."""
        if self._kv is None:
            self._kv = {(s.session_id, s.model): s for s in self.snapshot.sessions}
        return self._kv

    def inherit_kv_index(self, older: InstanceView) -> None:
        if older._kv is not None and older.snapshot.sessions is self.snapshot.sessions:
            self._kv = older._kv

    def model_state(self, model: str) -> str:
        if self.snapshot.active_model == model:
            return "active"
        m = self.models.get(model)
        return m.state if m is not None else "absent"

    def add_overlay(self, call_id: str, tokens: int, model: str, new_tokens: int | None = None) -> None:
        if call_id in self.overlay:
            return
        new = tokens if new_tokens is None else new_tokens
        self.overlay[call_id] = (tokens, model, new)
        self.overlay_tokens += tokens
        self.overlay_new_tokens += new
        self.overlay_models[model] = self.overlay_models.get(model, 0) + 1

    def drop_overlay(self, call_id: str) -> None:
        placed = self.overlay.pop(call_id, None)
        if placed is None:
            return
        tokens, model, new = placed
        self.overlay_tokens -= tokens
        self.overlay_new_tokens -= new
        left = self.overlay_models.get(model, 0) - 1
        if left > 0:
            self.overlay_models[model] = left
        else:
            self.overlay_models.pop(model, None)

    def queued_calls(self) -> int:
        """Calls waiting or running there, counting the overlay (the `queue` overload bound)."""
        snap = self.snapshot
        return sum(snap.queued.values()) + snap.running + len(self.overlay)


def _same_but_stamp(old: InstanceSnapshot, new: InstanceSnapshot) -> bool:
    """Whether two snapshots differ at most in `version` and `at`."""
    return msgspec.structs.replace(old, version=new.version, at=new.at) == new


def _pinned_model(snap: InstanceSnapshot) -> str | None:
    """A hot-pool instance serves exactly one model: the one it reports pinned, else its
    active one, else its only resident."""
    if snap.pinned_model:
        return snap.pinned_model
    if snap.active_model:
        return snap.active_model
    on_device = [m.model for m in snap.models if m.state in ON_DEVICE]
    if len(on_device) == 1:
        return on_device[0]
    return snap.models[0].model if len(snap.models) == 1 else None


def unavailable(view: InstanceView, draining, now: float, stale_after: float) -> str:
    """Why no call may be placed on the instance whatever its model ("" when it may): its
    snapshot is stale, its watchdog sees a stuck engine step, or an operator drains it
    (`draining`, RouterState.draining: `talaria drain`)."""
    if now - view.received_at > stale_after:
        return "stale"
    if not view.snapshot.healthy:
        return "unhealthy"
    if view.snapshot.instance_id in draining:
        return "draining"
    return ""
