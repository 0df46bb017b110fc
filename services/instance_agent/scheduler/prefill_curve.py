"""How a prefill's cost grows with the context it attends over, measured on the chunks run.

Each token attends over every token before it, so a chunk of n tokens on top of c costs
s0 + n * (a + b * (c + n/2)), s0 the step's fixed cost. b is fitted per model by least
squares on exponentially decayed sums, on chunks of calls prefilled in several and on the
engine's start-up probe (`probed`); chunks of one size cannot tell s0 from a (a absorbs s0,
b stays). The agent reports (`slope`) the fitted b once established (its 95% interval clear
of 0), until then the architecture's prior (shared/attention_prior.py) on the probe's linear
rate; and how far a long prompt's price runs over its chunked prefills (`overstatement`),
past which the router refuses (router/deadlines.py). Pure; the price is shared/prefill_cost.py.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from talaria.shared.prefill_cost import prefill_s
from talaria.shared.stats import quantile

DECAY = 0.98  # per chunk folded: about the last 50 chunks count (a few long prompts)
MEMORY = round(1 / (1 - DECAY))  # the chunked prefills whose price/time ratio the overstatement reads
# b is established when its 95% confidence interval excludes 0: b >= t x its standard error,
# t Student's 0.975 quantile at the fit's residual degrees of freedom (few chunks: a wide t).
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
        12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04}


# The overstatement is the price/time ratio that 9 prefills in 10 stay under: a call is refused
# only when even that generous reading of its time misses the deadline (router/deadlines.py).
OVERSTATEMENT_Q = 0.9


def t975(dof: float) -> float | None:
    """Student's t 0.975 quantile at `dof` (rounded down; the normal's past 30); None below 1."""
    if dof < 1:
        return None
    if dof > 30:
        return 1.96
    return next(t for d, t in sorted(T975.items(), reverse=True) if d <= dof)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """m x = v by Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = max(abs(m[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) <= 1e-12 * scale:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


@dataclass
class _Sums:
    """Decayed normal equations of t = s0 + a*n + b*n*x over features f = (1, n, n*x)."""
    ff: list = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    ft: list = field(default_factory=lambda: [0.0] * 3)
    tt: float = 0.0  # decayed sum of t^2 and of the weights: the residual's variance
    w: float = 0.0
    # Whole chunked prefills, (fresh tokens, context before them, seconds from first chunk to last)
    prefills: deque = field(default_factory=lambda: deque(maxlen=MEMORY))

    def fold(self, f: tuple[float, float, float], t: float) -> None:
        for i in range(3):
            self.ft[i] = self.ft[i] * DECAY + f[i] * t
            for j in range(3):
                self.ff[i][j] = self.ff[i][j] * DECAY + f[i] * f[j]
        self.tt = self.tt * DECAY + t * t
        self.w = self.w * DECAY + 1.0

    def fit(self, cols: tuple[int, ...]) -> list[float] | None:
        return _solve([[self.ff[i][j] for j in cols] for i in cols], [self.ft[i] for i in cols])

    def last_se(self, cols: tuple[int, ...], beta: list[float]) -> tuple[float, float] | None:
        """(standard error of the last coefficient of the fit `beta` over `cols`, the residual
        degrees of freedom): weighted least squares on the decayed sums; None without any."""
        dof = self.w - len(cols)
        if dof <= 0:
            return None
        rss = self.tt - 2 * sum(b * self.ft[i] for b, i in zip(beta, cols)) + sum(
            beta[x] * beta[y] * self.ff[i][j] for x, i in enumerate(cols) for y, j in enumerate(cols))
        unit = self._unit(cols)
        if unit is None:
            return None
        return math.sqrt(max(0.0, rss) / dof * max(0.0, unit)), dof

    def _unit(self, cols: tuple[int, ...]) -> float | None:
        """The last diagonal entry of the inverse of the fit's normal matrix."""
        e = [0.0] * (len(cols) - 1) + [1.0]
        x = _solve([[self.ff[i][j] for j in cols] for i in cols], e)
        return None if x is None else x[-1]


@dataclass
class PrefillCurve:
    """Per model: b, seconds per prompt token per token of context attended over."""

    sums: dict[str, _Sums] = field(default_factory=dict)
    probe_rate: dict[str, float] = field(default_factory=dict)  # s/token of the probe's passes at no context

    def probed(self, model: str, passes) -> None:
        """The engine's start-up probe: passes of (tokens, context, seconds), folded like chunks;
        the fastest at no context is the prior's linear rate."""
        passes = [(n, c, t) for n, c, t in passes if n > 0 and t > 0 and c >= 0]
        for n, c, t in passes:
            self.observe(model, n, c, t)
        shallow = [t / n for n, c, t in passes if c == 0]
        if shallow:
            self.probe_rate[model] = min(shallow)

    def observe(self, model: str, tokens: int, context: int, seconds: float) -> None:
        """A chunk of `tokens` prompt tokens on top of `context` ran in `seconds`."""
        if tokens <= 0 or seconds <= 0 or context < 0:
            return
        x = context + tokens / 2
        self.sums.setdefault(model, _Sums()).fold((1.0, float(tokens), tokens * x), seconds)

    def prefilled(self, model: str, fresh: int, context: int, seconds: float) -> None:
        """A call's prefill of `fresh` tokens on top of `context`, run in several chunks, took
        `seconds` from its first chunk to its last (what a deadline sees: the steps of other
        calls between its chunks included)."""
        if fresh > 0 and seconds > 0 and context >= 0:
            self.sums.setdefault(model, _Sums()).prefills.append((fresh, context, seconds))

    def _fit(self, model: str) -> tuple[tuple[float, float, float], tuple[float, float] | None]:
        """((s0, a, b), (the standard error of b, residual degrees of freedom) or None)."""
        s = self.sums.get(model)
        if s is None:
            return (0.0, 0.0, 0.0), None
        full = s.fit((0, 1, 2))
        if full is not None and min(full) >= 0:
            return (full[0], full[1], full[2]), s.last_se((0, 1, 2), full)
        two = s.fit((1, 2))  # one chunk size (or a negative fixed cost): a absorbs s0
        if two is not None and two[1] > 0:
            return (0.0, max(0.0, two[0]), two[1]), s.last_se((1, 2), two)
        one = s.fit((1,))  # no spread of contexts yet: the linear rate alone
        return (0.0, max(0.0, one[0]) if one is not None else 0.0, 0.0), None

    def fit(self, model: str) -> tuple[float, float, float]:
        """(s0, a, b), each >= 0; b is 0 until chunks at different contexts were measured."""
        return self._fit(model)[0]

    def established(self, model: str | None) -> bool:
        """Does the fitted b's 95% confidence interval exclude 0?"""
        if not model:
            return False
        (_, _, b), err = self._fit(model)
        t = t975(err[1]) if err is not None else None
        return b > 0 and t is not None and b >= t * err[0]

    def ctx_s_per_tok2(self, model: str | None) -> float:
        """b (0: not measured)."""
        return self.fit(model)[2] if model else 0.0

    def slope(self, model: str | None, ratio: float, s_per_tok: float) -> tuple[float, bool]:
        """(b to report, whether it is measured): the fit once established, else the
        architecture's `ratio` (attention_prior.attention_ratio) times the linear rate: the
        probe's where the engine has one (a pass of a few hundred tokens, little fixed cost),
        else `s_per_tok` (the engine's rate over its steps, which carries a step's fixed cost:
        the prior then runs high)."""
        if not model:
            return 0.0, False
        if self.established(model):
            return self.fit(model)[2], True
        return ratio * (self.probe_rate.get(model) or s_per_tok), False

    def overstatement(self, model: str | None, s_per_tok: float, ctx_s_per_tok2: float) -> float:
        """How far a long prompt's price runs over the time of the recent chunked prefills: the
        OVERSTATEMENT_Q quantile of price / time over the last MEMORY of them; 0 when none ran
        or there is no price. The price: the slope this agent reports (`ctx_s_per_tok2`) on the
        probe's linear rate where there is one, else `s_per_tok` (the engine's). Not on the
        engine's rate where the probe measured one: that carries a step's fixed cost, which
        weighs most in the shortest prefills measured and least in the long ones judged, so the
        factor measured on a few thousand tokens would let a 91K-token prompt in
        (docs/decisions/2026-12-05-overstatement-rate.md)."""
        s = self.sums.get(model) if model else None
        rate = (self.probe_rate.get(model) if model else 0.0) or s_per_tok
        if s is None or not s.prefills or rate <= 0:
            return 0.0
        return quantile([prefill_s(rate, ctx_s_per_tok2, n, c) / t for n, c, t in s.prefills], OVERSTATEMENT_Q)
