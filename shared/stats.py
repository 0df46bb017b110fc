"""The two statistics every service and the simulator share: an EWMA and a nearest-rank quantile.

One definition each, so a rate the agent measures, a profile the router folds and a
percentile the simulator reports are computed the same way everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def ewma(old: float | None, sample: float, alpha: float) -> float:
    """Exponentially weighted mean; `old` None means no observation yet (the sample is taken)."""
    return sample if old is None else (1.0 - alpha) * old + alpha * sample


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (calibration.md, paper App. A): for N sorted observations, the
    one at 1-based rank ceil(q * N); q in (0, 1]; NaN for no observations. The 1e-12 keeps
    a float product such as 0.9 * 70 = 63.00000000000001 from moving one rank up."""
    if not 0 < q <= 1:
        raise ValueError(f"quantile {q} not in (0, 1]")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered) - 1e-12))
    return ordered[rank - 1]
