"""Hot pools chosen by the system from measured demand (paper §3.1's hot pool; issue 21). Pure.

The router decides how many instances each model keeps resident (pinned: a hot instance
serves one model and never switches) from what it sees, and publishes the decision; agents
pin what it names (the simulator applies it in place). Driven by (event, now) like the rest
of the router's policy: the same object runs live, in the simulator and in unit tests.

Demand (signal "live", the default). A model's demand is the work its open sessions will
offer: the sessions live now (first call routed, last not completed) x the model's mean
work per call measured so far (pooled over models until it has completions). Sessions are
counted the moment they start, so the signal leads the completions by a session's length.
Measured alternative (signal "window"): the server-seconds of work its calls offered over a
sliding window W, from completions as the router sees them; it reacts a window late and in
the matrix's 20-64-session cells moved instances on noise (base@60 %: 2 repins that ended
where they began, SCT p95 551 vs 495 s). A call's work is measured as

    work(call) = (prompt - cached) tokens x the model's prefill s/token
                 + output tokens x its decode step time (s/token of one sequence)

with the rates the engines serving the model report in their snapshots (`observe_rates`;
before any, the completion's own prefill_s + decode_s). The decode term is an engine step
per token, not that step shared by a batch: every model's decode is charged the same way,
so the shares are unbiased by how each is batched, and a model's share does not grow
because it was given too few instances (a measure from per-call decode_s would: its
batches grow). Calls routed and not yet completed count too (their expected work: the
model's mean work per call so far), so a model starved of instances, whose completions
lag, is not under-measured.

Decision. Each model's target is its share of the instances (the largest-remainder split of
deployment.pool_split: one instance per model while they fit, then by demand); the
controller moves one instance at a time from the most over-provisioned model d to the most
under-provisioned r, x_m = share_m x N - count_m, and only when the move pays for itself:

    (x_r - x_d - 1) x W  >  move cost = switch_s(r) + the donor instance's live sessions'
                                        last prompts x d's prefill s/token

(x_r - x_d - 1 is the instance-share imbalance the move removes, held over the window; the
cost is the weights load and the context the donor instance's live sessions recompute
elsewhere: their last prompt x d's prefill s/token), and the imbalance beats the sampling
noise of the demand it is measured from: x_r - x_d - 1 > z x sqrt(sum over r, d of
(share x N)^2 / sessions seen in W) (a model's work comes in sessions, so its share is
known to about 1 / sqrt(sessions), the live ones with the default signal); z = 2 standard
errors (results/matrix_notes.md shows the sweep). A move never
takes a model below its operator floor (`talaria up --hot MODEL`) or below one instance.
The hysteresis is measured but for z: the window W is the mean measured session duration
(first call submitted to last completion; placements are sticky for that long, so a
decision's effect lasts that long), and before the first session completes it is the time
since the first call. Decisions are at most one per W / N (each instance may change once per
window), so a burst of demand cannot flap the pools.

What is left as a constant: z (flat in the sweep, matrix_notes.md); `min_window_s` only
keeps W from being zero at start.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolMove:
    """Pin `instance_id` to `model` (it served `previous`); None: a cold instance."""

    instance_id: str
    model: str | None
    previous: str | None
    at: float
    reason: str


@dataclass
class _Model:
    done: deque = field(default_factory=deque)  # (completed_at, work_s)
    window_work: float = 0.0
    calls: int = 0
    total_work: float = 0.0
    total_prefill: float = 0.0
    inflight: set = field(default_factory=set)
    prefill_s_per_tok: float = 0.0
    decode_s_per_tok: float = 0.0


def split(demand: Mapping[str, float], instances: int, floor: Mapping[str, int] | None = None) -> dict[str, int]:
    """Instances per model: its floor (at least 1), then each spare one to the model furthest
    below its share of `demand` (deployment.pool_split's rule, ties to the first name)."""
    models = sorted(demand)
    count = {m: max(1, (floor or {}).get(m, 1)) for m in models}
    if sum(count.values()) > instances:
        raise ValueError(f"floors {count} do not fit {instances} instances")
    total = sum(max(0.0, demand[m]) for m in models)
    share = {m: (max(0.0, demand[m]) / total if total > 0 else 1.0 / len(models)) for m in models}
    for _ in range(instances - sum(count.values())):
        m = max(models, key=lambda m: (share[m] * instances - count[m], -models.index(m)))
        count[m] += 1
    return count


class HotPools:
    """The router's hot-pool controller: which model each instance keeps resident."""

    def __init__(self, pins: Mapping[str, str | None], floor: Mapping[str, int] | None = None,
                 min_window_s: float = 1.0, z: float = 2.0, signal: str = "live",
                 models: Sequence[str] = ()) -> None:
        if not pins:
            raise ValueError("no instances to pin")
        self.pins = dict(pins)  # instance -> model it keeps resident (None: a cold instance)
        # Started with cold instances: hot pools grow from and shrink to the cold pool
        # (_hot_cold); else every instance is hot and moves between models (the swap rule).
        self.cold_pool = None in self.pins.values()
        self.models = tuple(sorted({m for m in pins.values() if m} | set(floor or {}) | set(models)))
        self.floor = {m: max(1, (floor or {}).get(m, 1)) for m in self.models}
        if sum(self.floor.values()) > len(self.pins):
            raise ValueError(f"hot floors {self.floor} need more than {len(self.pins)} instances")
        self.min_window_s = min_window_s
        self._m = {m: _Model() for m in self.models}
        self._call_model: dict[str, tuple[str, str]] = {}  # call -> (model, instance)
        self._session_start: dict[str, float] = {}
        self._session_last: dict[str, float] = {}
        self._session_spans: list[float] = []
        self._home: dict[str, tuple[str, str, int]] = {}  # live session -> (instance, model, last prompt)
        self._seen: dict[str, deque] = {m: deque() for m in self.models}  # (at, session) completions
        self.z = z
        self.signal = signal
        self._changed = False  # a completion since the last decision (demand can only move then)
        self._first_at: float | None = None
        self._last_move_at = float("-inf")
        self.moves: list[PoolMove] = []

    @classmethod
    def even(cls, instances: Sequence[str], models: Sequence[str], floor: Mapping[str, int] | None = None,
             **kw) -> HotPools:
        """Start from an even split (no forecast): equal demand per model."""
        count = split({m: 1.0 for m in models}, len(instances), floor)
        names = [m for m in sorted(count) for _ in range(count[m])]
        return cls(dict(zip(instances, names)), floor, **kw)

    @classmethod
    def spare_cold(cls, instances: Sequence[str], models: Sequence[str], floor: Mapping[str, int] | None = None,
                   **kw) -> HotPools:
        """Start with the instances an even share surely fills hot, floor(N / models) per
        model (at least its floor: one, or the operator's `--hot`), and the remainder cold:
        no forecast; the demand decides what else turns hot or cold."""
        even = max(1, len(instances) // max(1, len(models)))
        fl = {m: max(even, (floor or {}).get(m, 1)) for m in models}
        names: list[str | None] = [m for m in sorted(fl) for _ in range(fl[m])]
        if len(names) > len(instances):
            raise ValueError(f"hot floors {fl} need more than {len(instances)} instances")
        names += [None] * (len(instances) - len(names))
        return cls(dict(zip(instances, names)), floor, models=models, **kw)

    # ---- what the router sees -------------------------------------------------------------

    def observe_rates(self, model: str, prefill_tok_s: float, decode_tok_s: float) -> None:
        """An engine serving `model` reported its rates (a snapshot whose active model it is)."""
        m = self._m.get(model)
        if m is None:
            return
        if prefill_tok_s > 0:
            m.prefill_s_per_tok = 1.0 / prefill_tok_s
        if decode_tok_s > 0:
            m.decode_s_per_tok = 1.0 / decode_tok_s

    def routed(self, call_id: str, session_id: str, model: str, instance_id: str, now: float,
               prompt_tokens: int = 0) -> None:
        if self._first_at is None:
            self._first_at = now
        self._session_start.setdefault(session_id, now)
        self._changed = self._changed or session_id not in self._home
        self._home[session_id] = (instance_id, model, prompt_tokens)
        if model in self._m:
            self._m[model].inflight.add(call_id)
            self._call_model[call_id] = (model, instance_id)

    def completed(self, call_id: str, session_id: str, model: str, prompt_tokens: int, cached_tokens: int,
                  output_tokens: int, prefill_s: float, decode_s: float, now: float) -> None:
        self._call_model.pop(call_id, None)
        m = self._m.get(model)
        if m is None:
            return
        m.inflight.discard(call_id)
        self._changed = True
        fresh = max(0, prompt_tokens - cached_tokens)
        if m.prefill_s_per_tok > 0 and m.decode_s_per_tok > 0:
            pf = fresh * m.prefill_s_per_tok
            work = pf + output_tokens * m.decode_s_per_tok
        else:
            pf, work = prefill_s, prefill_s + decode_s
        m.done.append((now, work))
        self._seen[model].append((now, session_id))
        m.window_work += work
        m.calls += 1
        m.total_work += work
        m.total_prefill += pf
        self._session_last[session_id] = now

    def session_done(self, session_id: str, now: float) -> None:
        """A session made its last call (the router learns it from the session's end or its
        idle expiry; the simulator knows it at once)."""
        start = self._session_start.pop(session_id, None)
        self._session_last.pop(session_id, None)
        self._home.pop(session_id, None)
        if start is not None:
            self._session_spans.append(now - start)

    # ---- measured quantities ---------------------------------------------------------------

    def window_s(self, now: float) -> float:
        """W: the mean session duration measured so far, else the time since the first call."""
        if self._session_spans:
            w = sum(self._session_spans) / len(self._session_spans)
        elif self._first_at is not None:
            w = now - self._first_at
        else:
            w = 0.0
        return max(self.min_window_s, w)

    def demand(self, now: float) -> dict[str, float]:
        """Server-seconds per model offered over the last W (completed + expected in flight)."""
        if self.signal == "live":
            return self._live_demand()
        w = self.window_s(now)
        out = {}
        for name, m in self._m.items():
            while m.done and m.done[0][0] < now - w:
                m.window_work -= m.done.popleft()[1]
            seen = self._seen[name]
            while seen and seen[0][0] < now - w:
                seen.popleft()
            mean = m.total_work / m.calls if m.calls else 0.0
            out[name] = max(0.0, m.window_work) + len(m.inflight) * mean
        return out

    def _live_demand(self) -> dict[str, float]:
        """The work the sessions open now will offer: live sessions per model x the model's
        mean work per call (pooled over models until it has completions)."""
        calls = sum(m.calls for m in self._m.values())
        pooled = sum(m.total_work for m in self._m.values()) / calls if calls else 1.0
        live = {m: 0 for m in self.models}
        for _, model, _ in self._home.values():
            if model in live:
                live[model] += 1
        return {m: live[m] * (self._m[m].total_work / self._m[m].calls if self._m[m].calls else pooled)
                for m in self.models}

    def counts(self) -> dict[str, int]:
        out = {m: 0 for m in self.models}
        for model in self.pins.values():
            if model is not None:
                out[model] = out.get(model, 0) + 1
        return out

    def _noise(self, demand: Mapping[str, float], total: float, n: int) -> dict[str, float]:
        """One standard error of each model's instance share (share x N / sqrt(sessions))."""
        out = {}
        for m in self.models:
            k = (sum(1 for _, mm, _ in self._home.values() if mm == m) if self.signal == "live"
                 else len({sid for _, sid in self._seen[m]}))
            share_n = demand[m] / total * n
            out[m] = share_n / k ** 0.5 if k else share_n
        return out

    def _displaced(self, instances: Iterable[str], keep: str | None) -> dict[str, float]:
        """Seconds of context the live sessions homed on each instance would recompute
        elsewhere if it stopped serving their model (all but `keep`'s)."""
        out = {i: 0.0 for i in instances}
        for inst_id, model, prompt in self._home.values():
            if inst_id in out and model != keep:
                m = self._m.get(model)
                if m is None:
                    continue
                out[inst_id] += prompt * m.prefill_s_per_tok if m.prefill_s_per_tok else (
                    m.total_prefill / m.calls if m.calls else 0.0)
        return out

    def _hot_cold(self, now: float, w: float, switch_s: Mapping[str, float],
                  load: Mapping[str, int]) -> list[PoolMove]:
        """With a cold pool: a model gets another hot instance (a cold one turns hot) only
        for an instance its demand surely fills, share x N - z sigma >= hot + 1, and when
        that instance's worth of work over W outweighs turning it (load + the other models'
        sessions there recompute elsewhere); a hot instance turns cold when the model's
        demand surely no longer fills it, share x N + z sigma < hot (cold, it keeps serving
        its sessions: no cost)."""
        n = len(self.pins)
        demand = self.demand(now)
        total = sum(demand.values())
        if total <= 0:
            return []
        count = self.counts()
        share = {m: demand[m] / total * n for m in self.models}
        sigma = self._noise(demand, total, n)
        cold = [i for i, m in self.pins.items() if m is None]
        if cold:
            r = max(self.models, key=lambda m: (share[m] - self.z * sigma[m] - count[m], m))
            surplus = share[r] - self.z * sigma[r] - count[r] - 1.0
            if surplus >= 0:
                displaced = self._displaced(cold, keep=r)
                homed = {i: 0 for i in cold}
                for inst_id, model, _ in self._home.values():
                    if model == r and inst_id in homed:
                        homed[inst_id] += 1
                inst = min(cold, key=lambda i: (displaced[i], -homed[i], load.get(i, 0), i))
                cost = displaced[inst] + (0.0 if homed[inst] else switch_s.get(r, 0.0))
                if (surplus + 1.0) * w > cost:
                    return [self._move(inst, r, None, now, f"{r}: share {share[r]:.2f} +- {sigma[r]:.2f} "
                                       f"instances fills {count[r] + 1} hot; gain {(surplus + 1.0) * w:.1f}s > "
                                       f"cost {cost:.1f}s")]
        over = [m for m in self.models if count[m] > self.floor[m] and share[m] + self.z * sigma[m] < count[m]]
        if over:
            d = min(over, key=lambda m: (share[m] + self.z * sigma[m] - count[m], m))
            mine = [i for i, m in self.pins.items() if m == d]
            homed = {i: 0 for i in mine}
            for inst_id, model, _ in self._home.values():
                if inst_id in homed:
                    homed[inst_id] += 1
            inst = min(mine, key=lambda i: (homed[i], load.get(i, 0), i))
            return [self._move(inst, None, d, now, f"{d}: share {share[d]:.2f} +- {sigma[d]:.2f} instances "
                               f"no longer fills {count[d]} hot")]
        return []

    def _move(self, inst: str, model: str | None, previous: str | None, now: float, reason: str) -> PoolMove:
        self.pins[inst] = model
        self._last_move_at = now
        move = PoolMove(inst, model, previous, now, reason)
        self.moves.append(move)
        return move

    # ---- the decision ----------------------------------------------------------------------

    def decide(self, now: float, switch_s: Mapping[str, float], load: Mapping[str, int]) -> list[PoolMove]:
        """At most one move: an instance of the most over-provisioned model to the most
        under-provisioned one, if the imbalance it removes over W outweighs its cost (module
        doc). `switch_s`: seconds to load each model (the agents' advertised open cost);
        `load`: calls in flight per instance (the router's view)."""
        n = len(self.pins)
        w = self.window_s(now)
        if not self._changed or now - self._last_move_at < w / n:
            return []
        self._changed = False
        if self.cold_pool:
            return self._hot_cold(now, w, switch_s, load)
        demand = self.demand(now)
        total = sum(demand.values())
        if total <= 0:
            return []
        count = self.counts()
        x = {m: demand[m] / total * n - count[m] for m in self.models}
        r = max(self.models, key=lambda m: (x[m], m))
        donors = [m for m in self.models if m != r and count[m] > self.floor[m]]
        if not donors:
            return []
        d = min(donors, key=lambda m: (x[m], m))
        imbalance = x[r] - x[d] - 1.0
        if imbalance <= 0:
            return []
        # Noise: a model's demand over W comes in sessions (their calls are correlated), so
        # its share is known to about share / sqrt(sessions seen in W); the move must beat
        # z standard errors of the difference, or it chases sampling noise.
        noise = 0.0
        for m in (r, d):
            k = (sum(1 for _, mm, _ in self._home.values() if mm == m) if self.signal == "live"
                 else len({sid for _, sid in self._seen[m]}))
            share_n = demand[m] / total * n
            noise += (share_n * share_n / k) if k else share_n * share_n
        if not imbalance > self.z * noise ** 0.5:
            return []
        dm = self._m[d]
        pf = dm.prefill_s_per_tok
        per_call = dm.total_prefill / dm.calls if dm.calls else 0.0  # before any engine rate
        # the donor instance: the one of d whose live sessions cost least to move (they
        # recompute their context elsewhere), then the fewest calls in flight
        displaced = {i: 0.0 for i, m in self.pins.items() if m == d}
        for inst_id, model, prompt in self._home.values():
            if model == d and inst_id in displaced:
                displaced[inst_id] += prompt * pf if pf else per_call
        inst = min(displaced, key=lambda i: (displaced[i], load.get(i, 0), i))
        cost = switch_s.get(r, 0.0) + displaced[inst]
        if not imbalance * w > cost:
            return []
        self.pins[inst] = r
        self._last_move_at = now
        move = PoolMove(inst, r, d, now, f"demand share {r} {x[r]:+.2f} / {d} {x[d]:+.2f} instances over "
                                         f"W={w:.0f}s: gain {imbalance * w:.1f}s > cost {cost:.1f}s")
        self.moves.append(move)
        return [move]


def pins_of(moves: Iterable[PoolMove], pins: Mapping[str, str]) -> dict[str, str]:
    """`pins` with `moves` applied in order."""
    out = dict(pins)
    for mv in moves:
        out[mv.instance_id] = mv.model
    return out


def decide_from_state(pools: HotPools, state, now: float) -> list[PoolMove]:
    """`pools.decide` with what the router state knows: each model's open cost as the agents
    advertise it (the largest reported: the cost of loading it anywhere) and the calls in
    flight on each instance (snapshot + routed since)."""
    switch: dict[str, float] = {}
    load: dict[str, int] = {}
    for iid, view in state.instances.items():
        load[iid] = view.queued_calls()
        for name, res in view.models.items():
            cost = res.open_cost_s or res.switch_cost_s
            if cost > switch.get(name, 0.0):
                switch[name] = cost
    return pools.decide(now, switch, load)
