"""Latency profiles the cost model reads, refreshed by EWMA from completions and rounds.

Everything is folded from the router's inputs (`CallCompleted`, `RoundSummary`,
`CallRouted`, snapshots for the engine rates), so a replayed router has the same profiles as
the live one. Rates are seconds per token; 0 means "no observation yet" and the cost model
falls back (costs.py: never to another model's rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from talaria.shared.stats import ewma as _ewma

ALPHA = 0.2  # EWMA weight of a new observation
ARRIVAL_WINDOW_S = 10.0  # time constant of the decayed arrival count (Eq. 2 demand)
GAP_KEEP = 256  # recent tool gaps kept per model for the adaptive lease


def ewma(old: float, sample: float) -> float:
    """`shared/stats.ewma` with 0.0 meaning "no observation yet"."""
    return _ewma(old if old > 0.0 else None, sample, ALPHA)


@dataclass
class ModelProfile:
    prefill_s_per_tok: float = 0.0
    decode_s_per_tok: float = 0.0
    ttft_s: float = 0.0
    arrivals: float = 0.0  # exponentially decayed count of arrivals
    arrivals_at: float = 0.0
    gaps: list[float] = field(default_factory=list)  # recent tool gaps, oldest first
    sessions_seen: int = 0  # sessions whose first call was routed
    calls_seen: int = 0  # calls routed
    gap_max: float = 0.0  # the longest of `gaps`
    version: int = 0  # bumped whenever a completion-derived rate the cost model reads changes
    # What engines running this model report in their snapshots (step tokens / step time,
    # EWMA): the compute rate itself. A completion's prefill_s is the time of every step
    # it shared (batch mates, a host restore), so prefill_s / its own new tokens can
    # overstate the rate many times over for a short suffix; the cost model prefers these.
    engine_prefill_s_per_tok: float = 0.0
    engine_restore_s_per_tok: float = 0.0
    # How prefill slows with context (seconds per token per token attended over), as the
    # engines fit it on their chunks (instance_agent/scheduler/prefill_curve.py); 0: none yet.
    # Until an engine's fit is established, the prior it reports (the architecture's ratio
    # times its linear rate, shared/attention_prior.py), kept apart: a measure replaces it.
    engine_prefill_ctx_s_per_tok2: float = 0.0
    engine_prefill_ctx_prior: float = 0.0

    def __post_init__(self) -> None:
        if self.gaps and not self.gap_max:
            self.gap_max = max(self.gaps)  # a profile stored before gap_max existed

    def observe_completion(self, prompt: int, cached: int, output: int, prefill_s: float,
                           decode_s: float, ttft_s: float) -> None:
        fresh = prompt - cached
        if prefill_s > 0.0 and fresh > 0:
            self.prefill_s_per_tok = ewma(self.prefill_s_per_tok, prefill_s / fresh)
            self.version += 1
        if decode_s > 0.0 and output > 1:
            self.decode_s_per_tok = ewma(self.decode_s_per_tok, decode_s / output)
            self.version += 1
        if ttft_s > 0.0:
            self.ttft_s = ewma(self.ttft_s, ttft_s)

    def observe_engine(self, prefill_tok_s: float, restore_tok_s: float, prefill_ctx_s_per_tok2: float = 0.0,
                       prefill_ctx_measured: bool = True) -> None:
        """Fold the rates a snapshot reports for this model (it is the active one there).
        Read per decision, not memoised, so no version bump."""
        if prefill_ctx_s_per_tok2 > 0.0 and prefill_ctx_measured:
            self.engine_prefill_ctx_s_per_tok2 = ewma(self.engine_prefill_ctx_s_per_tok2, prefill_ctx_s_per_tok2)
        elif prefill_ctx_s_per_tok2 > 0.0:
            self.engine_prefill_ctx_prior = ewma(self.engine_prefill_ctx_prior, prefill_ctx_s_per_tok2)
        if prefill_tok_s > 0.0:
            self.engine_prefill_s_per_tok = ewma(self.engine_prefill_s_per_tok, 1.0 / prefill_tok_s)
        if restore_tok_s > 0.0:
            self.engine_restore_s_per_tok = ewma(self.engine_restore_s_per_tok, 1.0 / restore_tok_s)

    def prefill_ctx_rate(self) -> float:
        """Attention's slope: an engine's established fit, else the prior engines report (0: none)."""
        return self.engine_prefill_ctx_s_per_tok2 or self.engine_prefill_ctx_prior

    def prefill_rate(self) -> float:
        """Seconds per prefilled token: the engines' measure, else the completions' (0: none)."""
        return self.engine_prefill_s_per_tok or self.prefill_s_per_tok

    def observe_arrival(self, at: float) -> None:
        self.arrivals = self.arrivals_at_time(at) + 1.0
        self.arrivals_at = max(at, self.arrivals_at)

    def arrivals_at_time(self, now: float) -> float:
        dt = max(0.0, now - self.arrivals_at)
        return self.arrivals * math.exp(-dt / ARRIVAL_WINDOW_S)

    def arrival_rate(self, now: float) -> float:
        """Calls per second of this model, from decayed routed and rejected arrivals."""
        return self.arrivals_at_time(now) / ARRIVAL_WINDOW_S

    def calls_per_session(self) -> float:
        """Calls routed per session seen so far (at least 1)."""
        return max(1.0, self.calls_seen / self.sessions_seen) if self.sessions_seen else 1.0

    def idle_horizon_s(self) -> float:
        """How long a session of this model may sit in a tool gap and still be coming back:
        the longest recent gap (0 before any was measured: only running sessions count)."""
        return self.gap_max

    def observe_gap(self, gap_s: float) -> bool:
        """Fold one tool gap; True when the longest recent gap changed."""
        before = self.gap_max
        self.gaps.append(gap_s)
        if len(self.gaps) > GAP_KEEP:
            dropped = self.gaps[: len(self.gaps) - GAP_KEEP]
            del self.gaps[: len(self.gaps) - GAP_KEEP]
            if max(dropped) >= self.gap_max:
                self.gap_max = max(self.gaps)
        self.gap_max = max(self.gap_max, gap_s)
        return self.gap_max != before


@dataclass
class InstanceProfile:
    round_wall_s: float = 0.0
    switch_s: float = 0.0
    rounds: int = 0

    def observe_round(self, wall_s: float, switch_s: float) -> None:
        self.round_wall_s = ewma(self.round_wall_s, wall_s)
        if switch_s > 0.0:
            self.switch_s = ewma(self.switch_s, switch_s)
        self.rounds += 1
