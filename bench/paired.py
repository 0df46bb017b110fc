"""Is a configuration established slower than its baseline on the same sessions? A paired
bootstrap of a percentile ratio, shared by bench/migration_sim.py and bench/migration_capacity.py.

Both configurations ran the same sessions (same seed, same trace), so each session gives a pair
(SCT with, SCT without). `paired_ratio` pools the pairs of every run (stratum: one seed) and
compares the nearest-rank percentile (shared/stats.quantile) of the first over the second;
its 95 % interval is a percentile bootstrap that draws sessions with replacement within each
stratum and takes *both* SCTs of a drawn session, so the comparison stays paired: a session
that is slow in both runs moves both percentiles, not their ratio. A stratum equal to an earlier
one (a seed that changed nothing, e.g. recorded gaps) is the same run again and counts once:
copies would narrow the interval without adding a session. `verdict` calls a ratio
"slower" only if its whole interval lies above 1, "faster" only if below.

What the interval does not cover: sessions of one run share instances, so they are not
independent draws (`run_ratio` resamples whole runs instead, a coarser check that does not
assume it); and one interval per cell and percentile, over many cells, lets a few lie
off 1 by chance (about 1 in 40 above 1 at 95 % when nothing changed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

RESAMPLES = 4000
LEVEL = 0.95
VERDICT = "**Verdict:"  # how the benches' verdict line starts (the end of their generated part)


def _rank(n: int, q: float) -> int:
    """0-based index of the nearest-rank q-quantile of n sorted values (shared/stats.quantile)."""
    return max(1, math.ceil(q * n - 1e-12)) - 1


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b with inf / inf (a session incomplete in both) as 1."""
    with np.errstate(invalid="ignore", divide="ignore"):
        r = a / b
    return np.where(np.isinf(a) & np.isinf(b), 1.0, r)


def _distinct(strata: Sequence[Sequence[tuple[float, float]]]) -> list[Sequence[tuple[float, float]]]:
    unique: list[Sequence[tuple[float, float]]] = []
    for s in strata:
        if s and not any(list(s) == list(u) for u in unique):
            unique.append(s)
    return unique


def paired_ratio(strata: Sequence[Sequence[tuple[float, float]]], q: float, resamples: int = RESAMPLES,
                 level: float = LEVEL, seed: int = 0) -> tuple[float, float, float]:
    """(ratio, lo, hi): quantile q of the first values over quantile q of the second, all pairs
    pooled, and its `level` paired-bootstrap interval (module doc). Deterministic for a `seed`."""
    strata = _distinct(strata)
    pairs = [p for s in strata for p in s]
    if not pairs:
        return math.nan, math.nan, math.nan
    on = np.array([p[0] for p in pairs], dtype=float)
    off = np.array([p[1] for p in pairs], dtype=float)
    k = _rank(len(pairs), q)
    point = float(_ratio(np.sort(on)[k:k + 1], np.sort(off)[k:k + 1])[0])
    rng = np.random.default_rng(seed)
    idx, start = [], 0
    for s in strata:  # each stratum keeps its size: a seed's run is resampled from itself
        n = len(s)
        if n:
            idx.append(start + rng.integers(0, n, size=(resamples, n)))
        start += n
    draw = np.concatenate(idx, axis=1)
    boot = _ratio(np.sort(on[draw], axis=1)[:, k], np.sort(off[draw], axis=1)[:, k])
    boot.sort()
    tail = (1 - level) / 2
    return point, float(boot[_rank(resamples, tail)]), float(boot[_rank(resamples, 1 - tail)])


def run_ratio(strata: Sequence[Sequence[tuple[float, float]]], q: float, resamples: int = RESAMPLES,
              level: float = LEVEL, seed: int = 0) -> tuple[float, float, float]:
    """As `paired_ratio`, but the bootstrap draws whole runs (strata) with replacement, each with
    all its sessions: sessions that shared a run's instances stay together, so their dependence
    widens the interval instead of being taken for independent evidence. Coarse with few runs
    with few runs; with one distinct run there is nothing to draw, and the interval is NaN."""
    strata = _distinct(strata)
    if not strata:
        return math.nan, math.nan, math.nan
    runs = [(np.array([p[0] for p in s], dtype=float), np.array([p[1] for p in s], dtype=float)) for s in strata]

    def ratio(chosen) -> float:
        on = np.concatenate([runs[i][0] for i in chosen])
        off = np.concatenate([runs[i][1] for i in chosen])
        k = _rank(len(on), q)
        return float(_ratio(np.partition(on, k)[k:k + 1], np.partition(off, k)[k:k + 1])[0])

    point = ratio(range(len(runs)))
    if len(runs) < 2:
        return point, math.nan, math.nan
    rng = np.random.default_rng(seed)
    boot = np.sort([ratio(rng.integers(0, len(runs), size=len(runs))) for _ in range(resamples)])
    tail = (1 - level) / 2
    return point, float(boot[_rank(resamples, tail)]), float(boot[_rank(resamples, 1 - tail)])


def verdict(lo: float, hi: float) -> str:
    """'slower' if the interval lies above 1, 'faster' if below, otherwise 'not established'."""
    if lo > 1.0:
        return "slower"
    if hi < 1.0:
        return "faster"
    return "not established"


def cell(lo: float, point: float, hi: float) -> str:
    """A table cell: the ratio and its interval, bold when the interval lies above 1."""
    text = f"{point:.3f} [{lo:.3f}, {hi:.3f}]"
    return f"**{text}**" if lo > 1.0 else text
