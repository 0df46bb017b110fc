"""The fewest instances any scheduler could meet an SCT p95 SLO with on a trace.

Not `experiments.capacity_aware_bound` (which bounds one run's schedule): this bounds every
scheduler on the simulator's cost model (profiles.py), from the trace alone: zero-wait SCTs,
work conserved in every window of session starts, the time each model must be active (one
model per instance at a time), and the model loads device memory forces.
It ignores queueing and the KV running calls hold, so it is loose where those dominate. The
argument is `instances_lower_bound`'s docstring.
"""

from __future__ import annotations

import heapq
import math

from talaria.sim.metrics import call_alone_s, oracle_sct
from talaria.sim.profiles import ServerProfile
from talaria.traces.format import Session
from talaria.traces.gaps import GapModel


def call_work_s(server: ServerProfile, model: str, prompt: int, cached: int, output: int, batch: int) -> float:
    """Least instance-seconds one call costs on `server` (module doc, step 2)."""
    mp = server.model(model)
    steps = max(0, output - 1)  # the first token comes with the prefill (metrics.oracle_sct)
    per_step = mp.decode_d0_s / batch + mp.decode_d1_s
    ctx = steps * (prompt + 1) + steps * (steps - 1) / 2  # context summed over the steps
    return mp.prefill_s(max(1, prompt - cached), cached) + steps * per_step + mp.decode_d2_s * ctx


def session_work_s(session: Session, server: ServerProfile, batch: int) -> float:
    """Least instance-seconds a session costs: its calls' work, each with its reusable prefix
    cached, decoding in batches of at most `batch`."""
    return sum(call_work_s(server, c.model, c.prompt_tokens, c.reusable_prefix_tokens, c.output_tokens, batch)
               for c in session.calls)


def session_active_s(session: Session, server: ServerProfile) -> float:
    """Seconds its model must be active for a session, however its steps are shared: each
    call alone (metrics.call_alone_s), since a decode step takes at least d0 + d1 + d2 x its
    context however many calls share it (its zero-wait SCT less its gaps)."""
    mp = server.model(session.model)
    total = 0.0
    for call in session.calls:
        prefill, decode = call_alone_s(mp, call)
        total += prefill
        total += decode
    return total


class ActiveCover:
    """The least time a model must be active for its sessions, each needing `need` seconds
    of it inside its window [start, start + S] (module doc, step 4).

    Windows of one length come in deadline order, so adding each session's shortfall as late
    as its window allows is optimal: a later point lies in every later window an earlier one
    does (the greedy for covering agreeable intervals). Disjoint active intervals, sorted."""

    __slots__ = ("intervals", "total")

    def __init__(self) -> None:
        self.intervals: list[list[float]] = []
        self.total = 0.0

    def add(self, start: float, end: float, need: float) -> None:
        """Session with window [start, end] (ends non-decreasing over calls) needing `need`."""
        have = 0.0
        for a, b in reversed(self.intervals):
            if b <= start:
                break
            have += min(b, end) - max(a, start)
        short = min(need - have, end - start - have)  # a window cannot hold more than itself
        if short <= 1e-12:
            return
        self.total += short
        t = end  # fill free time backwards from the window's end
        k = len(self.intervals)
        while short > 1e-12:
            prev = self.intervals[k - 1] if k else None
            free_from = max(start, prev[1]) if prev is not None else start
            take = min(short, t - free_from)
            if take > 0:
                self.intervals.insert(k, [t - take, t])
                short -= take
            if prev is None or prev[1] <= start:
                break
            t, k = prev[0], k - 1
        self._merge()

    def _merge(self) -> None:
        merged: list[list[float]] = []
        for a, b in self.intervals:
            if merged and a <= merged[-1][1] + 1e-12:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.intervals = merged


def batch_caps(order: list[Session], start: list[float], slo_p95_s: float, max_batch: int) -> list[int]:
    """Per session (start order), B_s: at most this many sessions that meet the SLO share a
    decode step with it (module doc, step 2)."""
    return [min(max_batch, sum(1 for o, t in zip(order, start) if o.model == s.model and abs(t - t0) <= slo_p95_s))
            for s, t0 in zip(order, start)]


def instances_lower_bound(sessions: list[Session], server: ServerProfile, slo_p95_s: float, max_batch: int,
                          gaps: GapModel) -> int | None:
    """The fewest instances any scheduler could meet SCT p95 <= `slo_p95_s` with (module
    doc); None where no instance count can (the zero-wait SCTs already miss it).

    Not `experiments.capacity_aware_bound` (which bounds one run's schedule): this bounds every
    scheduler on the simulator's cost model (profiles.py), from the trace alone.

    The argument. Meeting `SCT p95 <= S` (nearest rank) means at least q = ceil(0.95 n) of the n
    sessions finish within S of their start, so at most k = n - q may miss.

    1. Zero wait. A session cannot finish sooner than its zero-wait SCT (metrics.oracle_sct:
       its gaps plus each call alone, its reusable prefix on device, no queue, no switch,
       decoding at batch 1). If fewer than q sessions have a zero-wait SCT <= S, no number of
       instances meets the SLO: the bound is None.
    2. Work conserved. A call costs an instance at least `call_work_s`: the prefill of its new
       tokens on top of its reusable prefix (prefills run one after another on an instance), and
       per output token its share of a decode step, d0 / B + d1 + d2 x its context
       (profiles.SimModelProfile.decode_step_s). A step batches one model's calls only, and a
       session that meets the SLO and is alive beside one that meets it started within S of it:
       with B_s = min(max_batch, its model's sessions started within S of s), the meeting
       sessions' shares of one step sum to at most d0 (each B_s >= the meeting sessions in that
       step; sessions that miss may share the step too, which only lowers what is charged to
       the ones that meet). Take the
       sessions started in [t_i, t_j] (start order); each that meets the SLO does all its work
       inside [t_i, t_j + S]. Dropping the k costliest of them (the misses, chosen in the
       scheduler's favour), N instances must supply the rest in t_j + S - t_i seconds.
    3. Memory and loads. An instance holds at most r = floor(device bytes / smallest model's
       weights) models at once, so at t_i at most N r models are resident; every other model
       with work in the window (less the k that may be dropped) is activated at least once
       inside it, and an activation costs its instance at least a fully staged switch
       (profiles.ServerProfile.switch with every byte staged: the fixed phases and the D2D copy).

    4. One model per instance. An instance runs one model's step at a time, so the time model
       m is active on some instance is at most the instance-time it takes. A session that meets
       the SLO needs its model active for `session_active_s` (its zero-wait SCT less its gaps)
       inside [start, start + S], and sessions of one model may share all of it. The least
       active time that covers a model's sessions is `ActiveCover` (exact for windows of one
       length); dropping a session lowers it by at most that session's need, so the window's
       models' covers, less the k largest needs (sessions whose zero-wait SCT exceeds S are
       among the k, and count against it), are instance-time too, on top of the loads of 3.
       This is what binds when many models each have one session alive: they cannot share
       steps, which step 2 credits only through the batch caps.

    N is the least instance count that satisfies every window (i <= j). Each step only drops
    costs, so the result is a lower bound; it ignores queueing and the KV each running call
    holds, so it is loose where those dominate (an overloaded tail), tight where work does.
    """
    n = len(sessions)
    if n == 0:
        return 0
    q = math.ceil(0.95 * n)
    k = n - q
    order = sorted(sessions, key=lambda s: s.calls[0].gap_before_s)
    zero_wait = [oracle_sct(s, server, gaps) for s in order]
    if sorted(zero_wait)[q - 1] > slo_p95_s:
        return None
    start = [s.calls[0].gap_before_s for s in order]
    work = [session_work_s(s, server, b) for s, b in zip(order, batch_caps(order, start, slo_p95_s, max_batch))]
    per_instance = math.floor(server.hbm_bytes / min(m.weight_bytes for m in server.models.values()))
    load_s = min(server.switch(m, server.model(m).weight_bytes)[1] for m in server.models)
    active = [session_active_s(s, server) for s in order]
    # step 4: a session that cannot meet S misses whatever happens, using one of the k
    meetable = [z <= slo_p95_s for z in zero_wait]
    k_active = k - meetable.count(False)  # >= 0: step 1 passed
    windows = []  # (seconds, instance-time that must fit, models with work less k)
    for i in range(n):
        total, top, models = 0.0, [], set()  # top: min-heap of the k costliest sessions so far
        covers: dict[str, ActiveCover] = {}
        covered, top_active = 0.0, []  # the covers' sum; min-heap of the k_active largest needs
        for j in range(i, n):
            total += work[j]
            models.add(order[j].model)
            if k:
                heapq.heappush(top, work[j])
                if len(top) > k:
                    heapq.heappop(top)
            if meetable[j]:
                cover = covers.setdefault(order[j].model, ActiveCover())
                before = cover.total
                cover.add(start[j], start[j] + slo_p95_s, active[j])
                covered += cover.total - before
                if k_active:
                    heapq.heappush(top_active, active[j])
                    if len(top_active) > k_active:
                        heapq.heappop(top_active)
            must = max(total - sum(top), covered - sum(top_active))
            windows.append((start[j] + slo_p95_s - start[i], must, max(0, len(models) - k)))
    need = max(1, max(math.ceil(w / span - 1e-9) for span, w, _ in windows))
    while any(need * span < w + load_s * max(0, m - need * per_instance) - 1e-9 for span, w, m in windows):
        need += 1
    return need
