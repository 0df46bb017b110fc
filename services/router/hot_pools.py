"""Hot pools chosen by the system from measured demand (paper §3.1's hot pool; issue 21). Pure.

The router decides how many instances each model keeps resident (a hot instance serves one
model and never switches) and publishes it as a `PoolPinned` event; the agent repins
(RoundScheduler.repin). Demand is each model's expected live sessions over the payback window
W (an M/G/inf forecast from the sessions live now and the rate they start at) times its mean
work per call, measured from completions; a model's share is capped by its live sessions. A
move must beat the share's noise by z standard errors (the one constant left) and pay for
itself over W (the switch plus the context its donor's sessions recompute). The rules are
`HotPools`'s docstring; the measurements behind each are in
docs/decisions/2026-12-02-online-hot-pools.md.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass


# Arrivals are remembered over this many windows W: long enough that the rate is steadier
# than the live count it corrects (which is itself one window's arrivals), short enough that
# a router running for days follows the day. Flat: 3 / 10 / all history gave matrix SCT p95
# geomean 1.0325x / 1.0312x / 1.0305x the best peer (results/matrix_notes.md).
ARRIVAL_MEMORY = 10.0
# Session durations are remembered for this many of the most recent sessions: W and the stay
# share follow today's sessions, and a decision (due() runs after every event the router
# handles) costs the same after a month as after a minute (all history: 0.9 ms per due()
# after 100,000 ended sessions, 0.7 us now; results/matrix_notes.md). More than any matrix
# cell, the scale run or the shipped traces hold, so their runs are unchanged.
SPAN_MEMORY = 1024


@dataclass(frozen=True)
class PoolMove:
    """Pin `instance_id` to `model` (it kept `previous`); None: a cold instance."""

    instance_id: str
    model: str | None
    previous: str | None
    at: float
    reason: str


@dataclass
class _Model:
    calls: int = 0
    total_work: float = 0.0
    total_prefill: float = 0.0
    prefill_s_per_tok: float = 0.0
    decode_s_per_tok: float = 0.0
    arrivals: float = 0.0  # sessions started, decayed over the arrival memory (HotPools._decay_arrivals)

    def work_per_call(self) -> float | None:
        return self.total_work / self.calls if self.calls else None


@dataclass
class _Session:
    instance: str
    model: str
    prompt: int
    started: float
    last: float  # last call routed or completed
    inflight: int = 0


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
    """The router's hot-pool controller: which model each instance keeps resident.

    Demand: E_m = alpha L_m + (1 - alpha) lambda_m W expected live sessions of model m over
    the next W (L_m live now, alpha the share of them still live averaged over the window from
    the measured session durations, lambda_m m's session start rate), times its mean work per
    call, work(call) = (prompt - cached) x prefill s/token + output x decode step time, at the
    rates its engines report. Share: s_m = min(N x demand share, L_m), known to one standard
    error sigma_m = N sqrt(p_m (1 - p_m) / K) over K live sessions.

    - Every instance hot (the swap rule): one instance moves from the most over-provisioned d
      to the most under-provisioned r (x_m = s_m - count_m) when x_r - x_d - 1 > z
      sqrt(sigma_r^2 + sigma_d^2) and (clip(x_r) - clip(1 + x_d)) x W > switch_s(r) + the
      context d's live sessions on the donor recompute elsewhere.
    - A cold pool beside hot pools (the hot+cold rule): a cold instance turns hot for r when
      s_r - z sigma_r >= count_r + 1, its work over W outweighs its cost and the cold
      instances left still carry the other models (`_cold_pool_carries`); a hot instance
      turns cold when s_d + z sigma_d < count_d.

    W is the mean measured session duration; at most one decision per W / N; never below a
    model's floor (one instance, or the operator's `--hot`), never a fixed instance.
    """

    def __init__(self, pins: Mapping[str, str | None] | None = None, floor: Mapping[str, int] | None = None,
                 z: float = 1.0, models: Sequence[str] = (), min_window_s: float = 1.0) -> None:
        self.pins: dict[str, str | None] = dict(pins or {})  # instance -> model kept resident (None: cold)
        self.fixed: set[str] = set()  # instances that serve one model only (never moved)
        # Started with every instance hot: the swap rule; with cold instances (or none yet:
        # live, agents register as they heartbeat), the hot+cold rule.
        self.cold_pool = not self.pins or None in self.pins.values()
        self.floor = {m: max(1, n) for m, n in (floor or {}).items()}
        self.z = z
        self.min_window_s = min_window_s
        self._m: dict[str, _Model] = {}
        for m in {*(p for p in self.pins.values() if p), *self.floor, *models}:
            self._model(m)
        if sum(self.floor.values()) > len(self.pins) and self.pins:
            raise ValueError(f"hot floors {self.floor} need more than {len(self.pins)} instances")
        self._sessions: dict[str, _Session] = {}
        self._calls: dict[str, str] = {}  # call in flight -> its session (a failure ends it too)
        self._spans: deque[float] = deque(maxlen=SPAN_MEMORY)  # the latest session durations
        self._span_total = 0.0  # their sum (W is read after every event)
        self._ended = 0  # sessions ended so far (the stay share is recomputed when one ends)
        self._stay: tuple[int, float] = (0, 1.0)  # (sessions ended when measured, stay share)
        self._first_at: float | None = None
        self._decayed_at = 0.0
        self._exposure = 0.0  # seconds of arrival memory behind the decayed counts
        self._last_move_at = float("-inf")
        self._changed = False  # demand may have moved since the last decision

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(sorted(self._m))

    # ---- checkpoint form (saved with the router state, state.py) -----------------------------

    def to_dict(self) -> dict:
        """Plain JSON-able dict of everything the controller knows; `from_dict` rebuilds an
        equal controller (a restarted router resumes the same pools and the same pace). Tables
        are lists of pairs: Postgres' JSONB keeps no key order, and sums run in table order."""
        return {
            "pins": list(self.pins.items()), "fixed": sorted(self.fixed), "cold_pool": self.cold_pool,
            "floor": dict(self.floor), "z": self.z, "min_window_s": self.min_window_s,
            "models": [[m, vars(v).copy()] for m, v in self._m.items()],
            "sessions": [[s, vars(v).copy()] for s, v in self._sessions.items()],
            "calls": list(self._calls.items()), "spans": list(self._spans), "span_total": self._span_total,
            "ended": self._ended, "stay": list(self._stay), "first_at": self._first_at,
            "decayed_at": self._decayed_at, "exposure": self._exposure,
            "last_move_at": None if self._last_move_at == float("-inf") else self._last_move_at,  # JSON has no -inf
            "changed": self._changed,
        }

    @classmethod
    def from_dict(cls, data: dict) -> HotPools:
        pools = cls(dict(data["pins"]), data["floor"], z=data["z"], min_window_s=data["min_window_s"])
        pools.fixed, pools.cold_pool = set(data["fixed"]), data["cold_pool"]
        pools._m = {m: _Model(**v) for m, v in data["models"]}
        pools._sessions = {s: _Session(**v) for s, v in data["sessions"]}
        pools._calls = dict(data["calls"])
        pools._spans = deque(data["spans"], maxlen=SPAN_MEMORY)
        pools._span_total, pools._ended, pools._stay = data["span_total"], data["ended"], tuple(data["stay"])
        pools._first_at, pools._decayed_at, pools._exposure = data["first_at"], data["decayed_at"], data["exposure"]
        last = data["last_move_at"]
        pools._last_move_at = float("-inf") if last is None else last
        pools._changed = data["changed"]
        return pools

    @classmethod
    def even(cls, instances: Sequence[str], models: Sequence[str], floor: Mapping[str, int] | None = None,
             **kw) -> HotPools:
        """Every instance hot, from an even split (no forecast): the swap rule."""
        count = split({m: 1.0 for m in models}, len(instances), floor)
        names = [m for m in sorted(count) for _ in range(count[m])]
        return cls(dict(zip(instances, names)), floor, models=models, **kw)

    @classmethod
    def spare_cold(cls, instances: Sequence[str], models: Sequence[str], floor: Mapping[str, int] | None = None,
                   **kw) -> HotPools:
        """floor(N / models) hot per model (at least its floor), the remainder cold: the
        hot+cold rule, no forecast."""
        even = max(1, len(instances) // max(1, len(models)))
        fl = {m: max(even, (floor or {}).get(m, 1)) for m in models}
        names: list[str | None] = [m for m in sorted(fl) for _ in range(fl[m])]
        if len(names) > len(instances):
            raise ValueError(f"hot floors {fl} need more than {len(instances)} instances")
        names += [None] * (len(instances) - len(names))
        pools = cls(dict(zip(instances, names)), floor, models=models, **kw)
        pools.cold_pool = True
        return pools

    def _model(self, name: str) -> _Model:
        m = self._m.get(name)
        if m is None:
            m = self._m[name] = _Model()
        return m

    # ---- what the router sees -------------------------------------------------------------

    def instance(self, instance_id: str, pinned: str | None, catalogue: Iterable[str]) -> None:
        """An agent's snapshot: register it (live, agents join as they heartbeat) with what it
        keeps resident now; one whose catalogue is a single model is fixed."""
        models = tuple(catalogue)
        for m in models:
            self._model(m)
        if instance_id not in self.pins:
            self.pins[instance_id] = pinned
            self._changed = True
        if len(models) <= 1:
            self.fixed.add(instance_id)
            if models:
                self.pins[instance_id] = models[0]

    def forget(self, instance_id: str) -> None:
        """The agent behind `instance_id` is gone: it keeps nothing resident (restarted, it
        registers again with its next snapshot). Before, a lost agent stayed pinned for ever:
        its model looked an instance richer than it was, and the pools N instances larger."""
        if self.pins.pop(instance_id, "absent") != "absent":
            self._changed = True
        self.fixed.discard(instance_id)

    def pinned(self, instance_id: str, model: str | None, at: float) -> None:
        """A move was made (a PoolPinned folded: this controller's plan, or another router's):
        the pins and the pace (a move counts against the rate gate)."""
        if instance_id in self.fixed:
            return
        self.pins[instance_id] = model
        self._last_move_at = max(self._last_move_at, at)
        self._changed = True

    def observe_rates(self, model: str, prefill_tok_s: float, decode_tok_s: float) -> None:
        """An engine running `model` reported its rates (a snapshot whose active model it is)."""
        m = self._m.get(model)
        if m is None:
            return
        if prefill_tok_s > 0:
            m.prefill_s_per_tok = 1.0 / prefill_tok_s
        if decode_tok_s > 0:
            m.decode_s_per_tok = 1.0 / decode_tok_s

    def routed(self, session_id: str, model: str, instance_id: str, prompt_tokens: int, now: float,
               call_id: str = "") -> None:
        if self._first_at is None:
            self._first_at = now
        self._model(model)
        s = self._sessions.get(session_id)
        if s is None:
            s = self._sessions[session_id] = _Session(instance_id, model, prompt_tokens, now, now)
            self._decay_arrivals(now)
            self._m[model].arrivals += 1.0
            self._changed = True
        s.instance, s.model, s.prompt, s.last = instance_id, model, prompt_tokens, now
        s.inflight += 1
        if call_id:
            self._calls[call_id] = session_id

    def completed(self, session_id: str, model: str, prompt_tokens: int, cached_tokens: int, output_tokens: int,
                  prefill_s: float, decode_s: float, now: float, call_id: str = "") -> None:
        m = self._model(model)
        fresh = max(0, prompt_tokens - cached_tokens)
        if m.prefill_s_per_tok > 0 and m.decode_s_per_tok > 0:
            pf = fresh * m.prefill_s_per_tok
            work = pf + output_tokens * m.decode_s_per_tok
        else:
            pf, work = prefill_s, prefill_s + decode_s
        m.calls += 1
        m.total_work += work
        m.total_prefill += pf
        self._calls.pop(call_id, None)
        self._call_ended(session_id, now)
        self._changed = True

    def failed(self, call_id: str, now: float) -> None:
        """A routed call failed (timed out, cancelled, its instance lost): it is no longer in
        flight, so its session can end (before, such a session stayed live for ever). A call
        refused before placement was never routed here: nothing to end."""
        session_id = self._calls.pop(call_id, None)
        if session_id is not None:
            self._call_ended(session_id, now)

    def _call_ended(self, session_id: str, now: float) -> None:
        s = self._sessions.get(session_id)
        if s is not None:
            s.inflight = max(0, s.inflight - 1)
            s.last = now

    def expire(self, now: float, horizon: Callable[[str], float]) -> None:
        """Sessions idle (no call running) longer than their model's idle horizon are over:
        the router never hears a session end, only its silence."""
        for sid, s in list(self._sessions.items()):
            if not s.inflight and now - s.last > horizon(s.model):
                del self._sessions[sid]
                self._remember_span(s.last - s.started)
                self._changed = True

    def _remember_span(self, span: float) -> None:
        if len(self._spans) == self._spans.maxlen:
            self._span_total -= self._spans[0]
        self._spans.append(span)
        self._span_total += span
        self._ended += 1

    # ---- measured quantities ---------------------------------------------------------------

    def window_s(self, now: float) -> float:
        """W: the mean measured session duration, else the time since the first call."""
        if self._spans:
            w = self._span_total / len(self._spans)
        elif self._first_at is not None:
            w = now - self._first_at
        else:
            w = 0.0
        return max(self.min_window_s, w)

    def live(self) -> dict[str, int]:
        out = {m: 0 for m in self._m}
        for s in self._sessions.values():
            out[s.model] += 1
        return out

    def _decay_arrivals(self, now: float) -> None:
        """Decay the arrival counts and their exposure to `now`: arrivals are remembered over
        ARRIVAL_MEMORY windows (a long-running router follows a day's drift; the matrix's and
        the traces' runs are shorter than it, so there it is all history)."""
        if self._first_at is None:
            return
        tau = ARRIVAL_MEMORY * self.window_s(now)
        dt = max(0.0, now - max(self._decayed_at, self._first_at))
        keep = math.exp(-dt / tau)
        for m in self._m.values():
            m.arrivals *= keep
        self._exposure = self._exposure * keep + tau * (1.0 - keep)
        self._decayed_at = now

    def stay_share(self, now: float) -> float:
        """alpha: the share of the sessions live now still live, averaged over the next W. A
        session's remaining life is the residual of the measured durations D, so
        alpha = E[int_0^W (D - t)+ dt] / W^2 (1 - 1/e for exponential D; ~0.65 on the WEKA
        traces). 1 before any session has ended."""
        if not self._spans:
            return 1.0
        if self._stay[0] != self._ended:  # W and alpha change only when a session ends
            w = self.window_s(now)
            alpha = sum(min(d, w) * d - min(d, w) ** 2 / 2 for d in self._spans) / (len(self._spans) * w * w)
            self._stay = (self._ended, min(1.0, alpha))
        return self._stay[1]

    def expected_live(self, now: float) -> dict[str, float]:
        """Each model's live sessions averaged over the next W (the window a decision is paid
        back over): alpha of those live now, and the sessions that will start meanwhile at
        the rate seen so far, (1 - alpha) x arrival rate x W (an M/G/inf system's forecast)."""
        live = self.live()
        alpha = self.stay_share(now)
        if alpha >= 1.0:
            return {m: float(n) for m, n in live.items()}
        self._decay_arrivals(now)
        w = self.window_s(now)
        rate = {m: (self._m[m].arrivals / self._exposure if self._exposure > 0 else 0.0) for m in live}
        return {m: alpha * live[m] + (1.0 - alpha) * rate[m] * w for m in live}

    def demand(self, now: float) -> dict[str, float]:
        """The work the open sessions will offer over the next W: expected live sessions x
        the model's work per call."""
        calls = sum(m.calls for m in self._m.values())
        pooled = sum(m.total_work for m in self._m.values()) / calls if calls else 1.0
        live = self.expected_live(now)
        return {name: live[name] * (m.work_per_call() or pooled) for name, m in self._m.items()}

    def counts(self) -> dict[str, int]:
        out = {m: 0 for m in self._m}
        for model in self.pins.values():
            if model is not None:
                out[model] = out.get(model, 0) + 1
        return out

    # ---- the decision ----------------------------------------------------------------------

    def due(self, now: float) -> bool:
        """May a decision be made now: demand changed since the last one, and the last move is
        at least W / N old (each instance may change about once per window)."""
        n = len(self.pins)
        return self._changed and n > 0 and now - self._last_move_at >= self.window_s(now) / n

    def decide(self, now: float, switch_s: Mapping[str, float], load: Mapping[str, int]) -> list[PoolMove]:
        """`plan`, and the moves made at once (`pinned`): for a controller driven alone."""
        moves = self.plan(now, switch_s, load)
        for m in moves:
            self.pinned(m.instance_id, m.model, m.at)
        return moves

    def plan(self, now: float, switch_s: Mapping[str, float], load: Mapping[str, int]) -> list[PoolMove]:
        """At most one move (module doc), not made: the router folds it as a PoolPinned event
        (`pinned`). `switch_s`: seconds to load each model (the agents' advertised open cost);
        `load`: calls in flight per instance (the router's view)."""
        if not self.due(now):
            return []
        n = len(self.pins)
        w = self.window_s(now)
        self._changed = False
        demand = self.demand(now)
        total = sum(demand.values())
        k = len(self._sessions)
        if total <= 0 or k == 0:
            return []
        live = self.live()
        raw = {m: demand[m] / total * n for m in self._m}
        sigma = {m: n * (p * (1.0 - p) / k) ** 0.5 for m, p in ((m, demand[m] / total) for m in self._m)}
        # N x demand share, but no more instances than live sessions: a session's calls run one
        # at a time where its context is, so a model keeps at most that many instances busy.
        # The margin stays the share's standard error: the live count that caps it moves
        # with every arrival and expiry (measured: a margin scaled down with the cap made
        # 304 repins at scale instead of 99, SCT p50 80.0 vs 77.2 s).
        share = {m: min(raw[m], float(live[m])) for m in self._m}
        if self.cold_pool:
            return self._hot_cold(now, w, share, sigma, switch_s, load)
        return self._swap(now, w, share, sigma, switch_s, load)

    def _movable(self, model: str | None) -> list[str]:
        return [i for i, m in self.pins.items() if m == model and i not in self.fixed]

    def _displaced(self, instances: Iterable[str], keep: str | None) -> dict[str, float]:
        """Seconds of context the live sessions homed on each instance would recompute
        elsewhere if it stopped serving their model (all but `keep`'s)."""
        out = {i: 0.0 for i in instances}
        for s in self._sessions.values():
            if s.instance in out and s.model != keep:
                m = self._m[s.model]
                out[s.instance] += s.prompt * m.prefill_s_per_tok if m.prefill_s_per_tok else (
                    m.total_prefill / m.calls if m.calls else 0.0)
        return out

    def _homed(self, instances: Iterable[str], model: str | None = None) -> dict[str, int]:
        out = {i: 0 for i in instances}
        for s in self._sessions.values():
            if s.instance in out and (model is None or s.model == model):
                out[s.instance] += 1
        return out

    def _swap(self, now, w, share, sigma, switch_s, load) -> list[PoolMove]:
        count = self.counts()
        floor = lambda m: self.floor.get(m, 1)  # noqa: E731
        x = {m: share[m] - count[m] for m in self._m}
        r = max(self._m, key=lambda m: (x[m], m))
        donors = [m for m in self._m if m != r and count[m] > floor(m) and self._movable(m)]
        if not donors:
            return []
        d = min(donors, key=lambda m: (x[m], m))
        imbalance = x[r] - x[d] - 1.0
        if not imbalance > self.z * (sigma[r] ** 2 + sigma[d] ** 2) ** 0.5:
            return []
        # The instance-fraction of demand the move serves (r's shortfall, up to the one
        # instance) less what it leaves unserved (d's shortfall once it has one fewer): an
        # instance moved to a model that is not short serves nothing.
        gain = _clip01(x[r]) - _clip01(1.0 + x[d])
        mine = self._movable(d)
        displaced = self._displaced(mine, keep=None)
        inst = min(mine, key=lambda i: (displaced[i], load.get(i, 0), i))
        cost = switch_s.get(r, 0.0) + displaced[inst]
        if not gain * w > cost:
            return []
        return [self._move(inst, r, d, now, f"{r} {x[r]:+.2f} / {d} {x[d]:+.2f} instances vs demand: gain "
                                            f"{gain * w:.1f}s over W={w:.0f}s > cost {cost:.1f}s")]

    def _hot_cold(self, now, w, share, sigma, switch_s, load) -> list[PoolMove]:
        count = self.counts()
        cold = self._movable(None)
        if cold:
            r = max(self._m, key=lambda m: (share[m] - self.z * sigma[m] - count[m], m))
            surplus = share[r] - self.z * sigma[r] - count[r]
            if surplus >= 1.0 and self._cold_pool_carries(share, count, r, len(cold) - 1):
                displaced = self._displaced(cold, keep=r)
                homed = self._homed(cold, r)
                inst = min(cold, key=lambda i: (displaced[i], -homed[i], load.get(i, 0), i))
                cost = displaced[inst] + (0.0 if homed[inst] else switch_s.get(r, 0.0))
                if min(surplus, 1.0) * w > cost:
                    return [self._move(inst, r, None, now, f"{r}: {share[r]:.2f} +- {sigma[r]:.2f} instances "
                                                         f"of demand fill {count[r] + 1} hot; gain over "
                                                         f"W={w:.0f}s > cost {cost:.1f}s")]
        over = [m for m in self._m if count[m] > self.floor.get(m, 1) and self._movable(m)
                and share[m] + self.z * sigma[m] < count[m]]
        if over:
            d = min(over, key=lambda m: (share[m] + self.z * sigma[m] - count[m], m))
            mine = self._movable(d)
            homed = self._homed(mine)
            inst = min(mine, key=lambda i: (homed[i], load.get(i, 0), i))
            return [self._move(inst, None, d, now, f"{d}: {share[d]:.2f} +- {sigma[d]:.2f} instances of demand "
                                                 f"no longer fill {count[d]} hot")]
        return []

    def _cold_pool_carries(self, share, count, r: str, left: int) -> bool:
        """Would `left` cold instances still carry what the other models' hot instances do not,
        once one more is hot for `r`: each model's demand past its hot instances, in instances,
        and at least one cold instance while a model has none hot (else its calls have nowhere
        to run, as with one agent and two models). r's own overflow does not count: the pin
        only adds to what r gets. Measured (bench/hot_cold_sim.py, every agent cold): without
        it the single-instance and one human-turn cell never finished (a model left with no
        instance); counting the others' overflow, not only the last instance, took a 20-model
        cell from 1.97x to 1.22x the all-cold SCT p95 (results/matrix_notes.md)."""
        others = [m for m in self._m if m != r]
        overflow = sum(max(0.0, share[m] - count[m]) for m in others)
        needs_one = any(count[m] == 0 for m in others)
        return left >= overflow and (left >= 1 or not needs_one)

    def _move(self, inst: str, model: str | None, previous: str | None, now: float, reason: str) -> PoolMove:
        return PoolMove(inst, model, previous, now, reason)


def _clip01(v: float) -> float:
    return min(1.0, max(0.0, v))


def decide_from_state(pools: HotPools, state, now: float) -> list[PoolMove]:
    """`pools.plan` with what the router state knows: each model's open cost as the agents
    advertise it (the largest reported: the cost of loading it anywhere) and the calls in
    flight on each instance (snapshot + routed since). Nothing is gathered when no decision
    is due (it runs after every event the router handles)."""
    if not pools.due(now):
        return []
    switch: dict[str, float] = {}
    load: dict[str, int] = {}
    for iid, view in state.instances.items():
        load[iid] = view.queued_calls()
        for name, res in view.models.items():
            cost = res.open_cost_s or res.switch_cost_s
            if cost > switch.get(name, 0.0):
                switch[name] = cost
    return pools.plan(now, switch, load)
