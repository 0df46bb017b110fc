"""What a drain's pushes of its sessions' KV came to (issue 40, drain_push.py): asked and
unanswered, moved and lost, per holder. Folded by `RouterState.apply`; pure."""

from __future__ import annotations

from dataclasses import dataclass, field

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
        if done.pages < done.listed or (done.listed == 0 and done.why):  # fewer arrived, or no listing came
            why = done.why or f"{done.pages} of {done.listed} pages arrived"
            self.lost.setdefault(done.holder, {})[done.session_id] = why
            return False
        self.moved.setdefault(done.holder, set()).add(done.session_id)
        return done.pages > 0

    def holder_lost(self, holder: str, sessions: list[str], why: str) -> None:
        """The drained holder's process is gone: its sessions not moved, lost or being pushed
        lost their context with it (a pending push still reports what its pull got)."""
        for s in sessions:
            asked = self.pending.get(s)
            if not self.settled(holder, s) and (asked is None or asked.holder != holder):
                self.lost.setdefault(holder, {})[s] = why

    def settled(self, holder: str, session_id: str) -> bool:
        return session_id in self.moved.get(holder, ()) or session_id in self.lost.get(holder, {})

    def forget(self, holder: str) -> None:
        """The holder is back in service (restarted): a later drain starts afresh."""
        self.moved.pop(holder, None)
        self.lost.pop(holder, None)
        for s in [s for s, a in self.pending.items() if a.holder == holder]:
            del self.pending[s]
