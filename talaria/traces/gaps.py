"""Gap models: what the closed-loop replayer waits between a completion and the next call.

Three models (recorded, rescaled, paper: `GapModel`), each a small frozen object with
`gap(call) -> seconds` and a `describe()` string that reports print verbatim.

Gap 0 (a session's start offset) is never modified: it is workload placement, not a tool gap.
Without a choice, a trace a stack served (`talaria trace export`) replays its recorded gaps
(what its clients did); any other trace the paper's.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from talaria.traces.format import SERVED_SOURCE, TraceCall

PAPER_GAP_P50_S = 0.39  # calibration.md, workload table
PAPER_GAP_P95_S = 1.32
Z95 = 1.6448536269514722


def lognormal_from_quantiles(p50: float, p95: float) -> tuple[float, float]:
    """(mu, sigma) of a lognormal with the given median and 95th percentile."""
    return math.log(p50), math.log(p95 / p50) / Z95


def _stable_seed(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class GapModel:
    """kind: recorded | rescaled | paper. `cap_s` applies to every kind (None = no cap).

    - ``recorded``: the trace's own gap, capped (the paper caps at 10 s; 20 of its 960 calls).
    - ``rescaled``: the recorded gap times a factor, then capped. WEKA gaps are ~20x the
      paper's (README), so a factor of 0.05 gives reference-like timing while keeping the
      per-session shape.
    - ``paper``: drawn from a lognormal fitted to the paper's tool-gap distribution
      (p50 0.39 s, p95 1.32 s; calibration.md, Fig. 2b). Each draw is seeded by
      (seed, session, call_index) so it does not depend on replay order or configuration.
    """

    kind: str = "recorded"
    cap_s: float | None = 10.0
    factor: float = 1.0
    p50_s: float = PAPER_GAP_P50_S
    p95_s: float = PAPER_GAP_P95_S
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("recorded", "rescaled", "paper"):
            raise ValueError(f"unknown gap model {self.kind!r}; use recorded|rescaled|paper")
        if self.factor < 0 or (self.cap_s is not None and self.cap_s < 0):
            raise ValueError("gap factor and cap must be >= 0")

    def gap(self, call: TraceCall) -> float:
        if call.call_index == 0:
            return call.gap_before_s
        if self.kind == "recorded":
            g = call.gap_before_s
        elif self.kind == "rescaled":
            g = call.gap_before_s * self.factor
        else:
            mu, sigma = lognormal_from_quantiles(self.p50_s, self.p95_s)
            rng = random.Random(_stable_seed(self.seed, call.session, call.call_index))
            g = rng.lognormvariate(mu, sigma)
        return min(g, self.cap_s) if self.cap_s is not None else g

    def describe(self) -> str:
        cap = "no cap" if self.cap_s is None else f"cap {self.cap_s:g} s"
        if self.kind == "recorded":
            return f"recorded gaps, {cap}"
        if self.kind == "rescaled":
            return f"recorded gaps x {self.factor:g}, {cap}"
        mu, sigma = lognormal_from_quantiles(self.p50_s, self.p95_s)
        return (
            f"lognormal(mu={mu:.3f}, sigma={sigma:.3f}) fitted to the paper's p50 "
            f"{self.p50_s} s / p95 {self.p95_s} s, seed {self.seed}, {cap}"
        )


def default_gap_spec(sessions) -> str:
    """`recorded` for a trace every call of which a stack served (exported), else `paper`."""
    calls = [c for s in sessions for c in s.calls]
    return "recorded" if calls and all(c.source.startswith(SERVED_SOURCE) for c in calls) else "paper"


def parse_gap_model(spec: str, seed: int = 0) -> GapModel:
    """'recorded[:cap]', 'rescaled:factor[:cap]', 'paper[:cap]'; cap 'none' disables it."""
    parts = spec.split(":")
    kind = parts[0]

    def cap(text: str) -> float | None:
        return None if text == "none" else float(text)

    if kind == "recorded":
        return GapModel("recorded", cap(parts[1]) if len(parts) > 1 else 10.0, seed=seed)
    if kind == "rescaled":
        if len(parts) < 2:
            raise ValueError("rescaled needs a factor: rescaled:0.05[:cap]")
        return GapModel(
            "rescaled", cap(parts[2]) if len(parts) > 2 else 10.0, float(parts[1]), seed=seed
        )
    if kind == "paper":
        return GapModel("paper", cap(parts[1]) if len(parts) > 1 else 10.0, seed=seed)
    raise ValueError(f"unknown gap model {spec!r}; use recorded|rescaled:F|paper")
