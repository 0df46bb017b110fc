"""RouterCore: policy + state, pure. Turns inputs into events and folds them in.

The asyncio service (`router_service.py`) publishes whatever `handle` returns; the simulator
and the tests call the same methods with a virtual clock.

With router replicas (ownership.py) each router folds every event into the same state but
acts only for the sessions of the partitions it owns (`partitioning`): it decides their
calls, reacts to their completions (successor leases), expires their leases and fails their
calls on a lost instance; another router's outputs come in through `fold_peer`. Decisions
are the policy's, unchanged: given the same state, every router decides a call as one would.
"""

from __future__ import annotations

# The policies first: costs.py (here and in drain_push.py) imports policy.base, whose package
# imports the talaria policy, which imports costs.py.
from talaria.services.router.policy.base import PlacementPolicy  # isort: skip
from talaria.services.router.costs import CostModel
from talaria.services.router.drain_push import plan
from talaria.services.router.push_book import RETRY_AFTER_S
from talaria.services.router.hot_pools import HotPools, decide_from_state
from talaria.services.router.instances import InstanceView
from talaria.services.router.leases import settlement
from talaria.services.router.ownership import Partitioning
from talaria.services.router.state import RouterState, SnapshotReceived, kv_on
from talaria.shared.messages import DrainStatus
from talaria.shared.events import (CallFailed, CallRouted, CallSubmitted, Event, InstanceLost, KvPushRequested,
                                   LeaseConsumed, LeaseDiscarded, LeaseExpired, LeaseIssued, PoolPinned)
from talaria.shared.snapshots import InstanceSnapshot

# An agent is declared lost after this many of its own heartbeat intervals without a snapshot
# (the interval is in each snapshot, so the bound follows the agent's configuration).
LOST_AFTER_BEATS = 4

# Other routers' outputs: folded as facts (RouterCore.fold_peer), never reacted to.
PEER_OUTPUTS = (CallRouted, LeaseIssued, LeaseConsumed, LeaseDiscarded, LeaseExpired, InstanceLost, PoolPinned,
                KvPushRequested)


class RouterCore:
    """Policy + state. `handle`/`tick` return the events they caused, already folded in."""

    def __init__(self, policy: PlacementPolicy, state: RouterState | None = None,
                 pools: HotPools | None = None, partitioning: Partitioning | None = None) -> None:
        self.policy = policy
        self.state = state or RouterState()
        # The router's hot-pool controller (hot_pools.py), when the system chooses the pools:
        # part of the state (it hears the events the state folds, and is checkpointed with it);
        # its decisions are PoolPinned events. With replicas every router's controller hears
        # every placement and completion; only partition 0's owner emits its decisions.
        if pools is not None:
            self.state.pools = pools
        self.partitioning = partitioning or Partitioning.everything()  # one router: every session
        # A drain prices each session's next call as the policy's config says (drain_push.py),
        # whichever policy places calls: the push lands where talaria's cost model would.
        self._push_costs = CostModel(policy.config)

    @property
    def pools(self) -> HotPools | None:
        return self.state.pools

    @pools.setter
    def pools(self, pools: HotPools | None) -> None:
        self.state.pools = pools

    def owns(self, event) -> bool:
        """Does this router act for `event`'s session (router-wide events: partition 0's owner)?"""
        return self.partitioning.owns(getattr(event, "session_id", None))

    def observe(self, snapshot: InstanceSnapshot, now: float) -> list[Event]:
        """Fold a heartbeat. A new incarnation (the agent restarted) first loses the old
        process: its in-flight calls are failed (retryable 503) and the returned events say so."""
        old = self.state.instances.get(snapshot.instance_id)
        out = []
        if old is not None and old.snapshot.incarnation != snapshot.incarnation:
            out = self.lose(old, f"instance {snapshot.instance_id} restarted", now)
        self.state.apply(SnapshotReceived(snapshot, now), now)
        return out

    def check_liveness(self, now: float, since: float) -> list[Event]:
        """Lose every instance silent for LOST_AFTER_BEATS heartbeats. `since` is when this
        router started listening: a view restored from a checkpoint is not silent before it."""
        out: list[Event] = []
        for view in list(self.state.instances.values()):
            silent = now - max(view.received_at, since)
            if silent > LOST_AFTER_BEATS * view.snapshot.heartbeat_s:
                out += self.lose(view, f"instance {view.instance_id} lost: no heartbeat for {silent:.1f}s", now)
        return out

    def lose(self, view: InstanceView, reason: str, now: float) -> list[Event]:
        """The process behind `view` is gone: an InstanceLost event plus a retryable 503 for
        each call placed there (a restarted agent drops them, so they never run late)."""
        placed = sorted(c for c, p in self.state.inflight_calls.items() if p.instance_id == view.instance_id)
        # Every router that notices says so (the stream keeps one copy: its message id); each
        # fails only its own sessions' calls, so a client is answered once.
        out: list[Event] = [InstanceLost(view.instance_id, view.snapshot.incarnation, reason, now, placed)]
        out += self._fail_placed(placed, view.instance_id, reason, now)
        for event in out:
            self.state.apply(event, now)
        return out

    def _fail_placed(self, calls, instance_id: str, reason: str, now: float) -> list[Event]:
        out: list[Event] = []
        for call_id in calls:
            p = self.state.inflight_calls.get(call_id)
            if p is None or not self.partitioning.owns(p.session_id):
                continue
            out.append(CallFailed(call_id=call_id, session_id=p.session_id, model=p.model,
                                  reason=f"{reason}; the call did not finish there, retry it", stage="agent",
                                  at=now, status=503, instance_id=instance_id, call_index=p.call_index,
                                  reply_to=p.reply_to))
        return out

    def drain(self, instance_id: str, now: float) -> tuple[DrainStatus, list[Event]]:
        """`talaria drain`: no call is placed on the instance from now on (costs.py prices it
        "draining"), and every session whose KV lives there is pushed ahead of its next call
        (drain_push.py): the returned `KvPushRequested` events (folded in) ask, per session this
        router owns, the agent its next call would land on to pull the pages. Drained once
        nothing runs, is queued or was placed there and no session's KV is left to move, so
        stopping it then loses only the contexts the status counts as lost."""
        view = self.state.instances.get(instance_id)
        if view is None and instance_id in self.state.draining:
            return self._drain_of_lost(instance_id, now), []
        if view is None:
            known = ", ".join(sorted(self.state.instances)) or "none"
            return DrainStatus(instance_id, error=f"no instance {instance_id!r} is known to this router (known: {known})"), []
        self.state.draining.add(instance_id)
        self.state.drained_as.setdefault(instance_id, view.snapshot.incarnation)
        asks, stuck = plan(self._push_costs, self.state, instance_id, now, self.partitioning.owns)
        for ask in asks:
            self.state.apply(ask, now)
        snap = view.snapshot
        calls = max(snap.running + sum(snap.queued.values()), len(view.inflight))
        book = self.state.pushes
        stuck_ids = {s for s, _ in stuck}
        left = sum(1 for s, _ in kv_on(self.state, instance_id)
                   if not book.settled(instance_id, s) and s not in stuck_ids)
        lost = {**book.lost.get(instance_id, {}), **dict(stuck)}
        status = DrainStatus(instance_id, drained=calls == 0 and left == 0, calls=calls, sessions=left,
                             moved=len(book.moved.get(instance_id, ())), lost=len(lost),
                             why_lost=next(iter(lost.values()), ""))
        return status, list(asks)

    def _drain_of_lost(self, instance_id: str, now: float) -> DrainStatus:
        """The status of a drain whose instance was lost (killed, crashed) before it ended:
        nothing runs there now; a push still pending reports what its pull got before the
        holder died (its connection breaks: at once), one unreported for RETRY_AFTER_S
        counts as lost, as do the sessions no push had moved (PushBook.holder_lost)."""
        book = self.state.pushes
        asks = [a for a in book.pending.values() if a.holder == instance_id]
        waiting = sum(1 for a in asks if now - a.at < RETRY_AFTER_S)
        stale = {a.session_id: f"no report of its push after {instance_id} was lost"
                 for a in asks if now - a.at >= RETRY_AFTER_S}
        lost = {**book.lost.get(instance_id, {}), **stale}
        return DrainStatus(instance_id, drained=waiting == 0, sessions=waiting,
                           moved=len(book.moved.get(instance_id, ())), lost=len(lost),
                           why_lost=next(iter(lost.values()), ""))

    def fold_peer(self, event: Event, now: float) -> list[Event]:
        """Another router's output (read from the stream): fold it in. Its InstanceLost also
        fails this router's own calls on that instance (the peer failed only its own)."""
        out: list[Event] = []
        if isinstance(event, InstanceLost):
            view = self.state.instances.get(event.instance_id)
            if view is None or view.snapshot.incarnation == event.incarnation:
                mine = [c for c, p in self.state.inflight_calls.items() if p.instance_id == event.instance_id]
                out = self._fail_placed(sorted(mine), event.instance_id, event.reason, now)
        self.state.apply(event, now)  # a PoolPinned moves this router's pools too
        for produced in out:
            self.state.apply(produced, now)
        return out

    def handle(self, event: Event, now: float) -> list[Event]:
        """Process one input event; return the events it causes (already folded in)."""
        match event:
            case CallSubmitted():
                out = self._route(event, now)
            case _:
                # Fold first, then let the policy react to the updated state (a completion
                # installs its successor lease; a round summary has refreshed the profiles).
                self.state.apply(event, now)
                out = self.policy.react(self.state, event, now) if self.owns(event) else []
        for produced in out:
            self.state.apply(produced, now)
        if self.pools is not None and self.partitioning.owns(None):  # else partition 0's owner decides
            moves = [PoolPinned(m.instance_id, m.model, m.previous, m.at, m.reason)
                     for m in decide_from_state(self.pools, self.state, now)]
            for move in moves:  # the pools move as every router's do: by folding the event
                self.state.apply(move, now)
            out += moves
        return out

    def tick(self, now: float) -> list[Event]:
        # Another router's due leases are its to expire: they leave this view when its
        # LeaseExpired arrives (or this router takes their partition over).
        out = [e for e in self.policy.tick(self.state, now) if self.owns(e)]
        if self.pools is not None:
            self.pools.expire(now, self.state.idle_horizon_s)
        for produced in out:
            self.state.apply(produced, now)
        return out

    def _route(self, call: CallSubmitted, now: float) -> list[Event]:
        if call.call_id in self.state.routed:
            return []  # redelivered after a restart: already routed once, never twice
        entry = self.state.sessions.get(call.session_id)
        # The policy returns the audit record itself; the lease event it records comes first.
        decision = self.policy.decide(self.state, call, now)
        events: list[Event] = [*settlement(entry.lease if entry is not None else None, decision), decision]
        call_index = decision.call_index
        if decision.action == "route" and decision.chosen is not None:
            view = self.state.instances.get(decision.chosen)
            kv_from = next((c.kv_from for c in decision.candidates if c.instance_id == decision.chosen), "")
            holder = self.state.instances.get(kv_from) if kv_from else None
            events.append(
                CallRouted(
                    incarnation=view.snapshot.incarnation if view is not None else "",
                    call=call,
                    call_index=call_index,
                    instance_id=decision.chosen,
                    policy=self.policy.name,
                    routed_at=now,
                    lease=decision.lease_outcome,
                    kv_output_tokens=self.state.outputs.kv_tokens(call.session_id, call.model, call.max_tokens),
                    fence=self.partitioning.fence(call.session_id),
                    kv_from=kv_from, kv_from_address=holder.snapshot.page_address if holder is not None else "",
                )
            )
        else:
            events.append(
                CallFailed(
                    call_id=call.call_id,
                    session_id=call.session_id,
                    model=call.model,
                    reason=decision.reason or "no instance can serve this call",
                    stage="router",
                    at=now,
                    status=decision.status,
                    call_index=call_index,
                    reply_to=call.reply_to,
                )
            )
        return events

