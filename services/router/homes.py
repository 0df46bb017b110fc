"""Where each live session lives: the instance that ran (or runs) its latest call.

A session is live on its home while one of its calls runs there, and after its last call
until it has been idle longer than `horizon_s` (the caller derives it from the tool gaps
the router measured): a session in a tool gap still brings its model back into that
instance's rounds. Past the horizon it is taken to have ended (an agent that returns
later is simply live again).

Folded from `CallRouted`, call ends and instance losses, like the rest of `RouterState`,
and stored with it in the projection; what the book keeps so the cost model's question
costs O(models on the instance): `HomeBook`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

NEVER = float("-inf")


@dataclass(slots=True)
class _ModelHomes:
    idle_since: dict[str, float] = field(default_factory=dict)  # session -> routed or ended at
    running: dict[str, int] = field(default_factory=dict)  # session -> calls in flight here
    latest: float = NEVER  # max(idle_since.values()), kept current

    def add(self, session_id: str, at: float) -> None:
        self.idle_since[session_id] = max(at, self.idle_since.get(session_id, NEVER))
        self.latest = max(self.latest, at)

    def remove(self, session_id: str) -> None:
        last = self.idle_since.pop(session_id, NEVER)
        self.running.pop(session_id, None)
        if last >= self.latest:
            self.latest = max(self.idle_since.values(), default=NEVER)

    def live(self, now: float, horizon_s: float) -> bool:
        return bool(self.running) or now - self.latest <= horizon_s


@dataclass
class HomeBook:
    """Live sessions per instance and model.

    The cost model asks, per instance, which models have live sessions there: per (instance,
    model) the book keeps the sessions, which of them have a call running and the latest time one
    of them went idle, so the answer costs O(models on the instance), not O(sessions); it is
    cached per instance until that instance's homes change, a horizon changes (`epoch`) or the
    first of its live models expires. Each routing into an instance prunes that instance's
    sessions idle past the horizon, so the book never holds the whole history.
    """

    by_instance: dict[str, dict[str, _ModelHomes]] = field(default_factory=dict)
    home_of: dict[str, tuple[str, str]] = field(default_factory=dict)  # session -> (instance, model)
    # instance -> (its homes' version, epoch, valid until, live models, computed at): a cache
    _live: dict[str, tuple] = field(default_factory=dict, compare=False, repr=False)
    _versions: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def _touch(self, instance_id: str) -> None:
        self._versions[instance_id] = self._versions.get(instance_id, 0) + 1

    def routed(self, session_id: str, instance_id: str, model: str, at: float) -> None:
        old = self.home_of.get(session_id)
        if old is not None and old != (instance_id, model):
            self._drop(session_id, *old)
        self.home_of[session_id] = (instance_id, model)
        homes = self.by_instance.setdefault(instance_id, {}).setdefault(model, _ModelHomes())
        homes.add(session_id, at)
        homes.running[session_id] = homes.running.get(session_id, 0) + 1
        self._touch(instance_id)

    def moved(self, session_id: str, instance_id: str, model: str) -> None:
        """A drain moved the session's KV to `instance_id` (router/drain_push.py): it lives there
        now, idle since it was (the move does not make it live longer)."""
        old = self.home_of.get(session_id)
        since = NEVER
        if old is not None:
            since = self.by_instance.get(old[0], {}).get(old[1], _ModelHomes()).idle_since.get(session_id, NEVER)
            if old != (instance_id, model):
                self._drop(session_id, *old)
        self.home_of[session_id] = (instance_id, model)
        self.by_instance.setdefault(instance_id, {}).setdefault(model, _ModelHomes()).add(session_id, since)
        self._touch(instance_id)

    def ended(self, session_id: str, instance_id: str, at: float) -> None:
        """A call of the session ended on `instance_id` (completed or failed there)."""
        home = self.home_of.get(session_id)
        if home is None or home[0] != instance_id:
            return  # it has moved on since
        homes = self.by_instance[instance_id][home[1]]
        left = homes.running.get(session_id, 0) - 1
        if left > 0:
            homes.running[session_id] = left
        else:
            homes.running.pop(session_id, None)
        homes.add(session_id, at)
        self._touch(instance_id)

    def forget_instance(self, instance_id: str) -> None:
        """The agent process is gone, and its sessions' KV with it: they live nowhere."""
        for homes in self.by_instance.pop(instance_id, {}).values():
            for session_id in homes.idle_since:
                self.home_of.pop(session_id, None)
        # its cache entries go too (agents restart under new ids: one each per restart stayed)
        self._live.pop(instance_id, None)
        self._versions.pop(instance_id, None)

    def prune(self, instance_id: str, now: float, horizon_s: Callable[[str], float]) -> None:
        models = self.by_instance.get(instance_id)
        if not models:
            return
        for model, homes in list(models.items()):
            horizon = horizon_s(model)
            for session_id in [s for s, t in homes.idle_since.items()
                               if s not in homes.running and now - t > horizon]:
                homes.remove(session_id)
                del self.home_of[session_id]
            if not homes.idle_since:
                del models[model]
        self._touch(instance_id)

    def live_models(self, instance_id: str, now: float, horizon_s: Callable[[str], float],
                    epoch: int = 0) -> tuple[str, ...]:
        """The models with a live session on the instance. `epoch` changes whenever a
        horizon does (the cache must not outlive it)."""
        version = self._versions.get(instance_id, 0)
        cached = self._live.get(instance_id)
        # valid from when it was computed until the first live model expires (not before:
        # a session idle at `now` may have been live earlier)
        if cached is not None and cached[0] == version and cached[1] == epoch and cached[4] <= now <= cached[2]:
            return cached[3]
        live, until = [], float("inf")
        for m, homes in self.by_instance.get(instance_id, {}).items():
            h = horizon_s(m)
            if homes.running:
                live.append(m)
            elif now - homes.latest <= h:
                live.append(m)
                until = min(until, homes.latest + h)
        out = tuple(live)
        self._live[instance_id] = (version, epoch, until, out, now)
        return out

    def sessions_of_other_models(self, instance_id: str, model: str) -> int:
        """How many sessions of models other than `model` the book homes on the instance."""
        return sum(len(h.idle_since) for m, h in self.by_instance.get(instance_id, {}).items() if m != model)

    def sessions_on(self, instance_id: str, except_session: str = "") -> int:
        """How many sessions the book homes on the instance (all models), but one."""
        n = sum(len(h.idle_since) for h in self.by_instance.get(instance_id, {}).values())
        return n - 1 if self.home_of.get(except_session, ("",))[0] == instance_id else n

    def to_list(self) -> list[list]:
        return [[s, i, m, t, homes.running.get(s, 0)]
                for i, models in self.by_instance.items() for m, homes in models.items()
                for s, t in homes.idle_since.items()]

    @classmethod
    def from_list(cls, rows) -> HomeBook:
        book = cls()
        for session_id, instance_id, model, last_s, running in rows:
            homes = book.by_instance.setdefault(instance_id, {}).setdefault(model, _ModelHomes())
            homes.add(session_id, last_s)
            if running:
                homes.running[session_id] = running
            book.home_of[session_id] = (instance_id, model)
        return book

    def _drop(self, session_id: str, instance_id: str, model: str) -> None:
        self._touch(instance_id)
        models = self.by_instance.get(instance_id, {})
        homes = models.get(model)
        if homes is not None:
            homes.remove(session_id)
            if not homes.idle_since:
                del models[model]
