"""How a prefill's cost grows with the context it attends over, measured on the chunks run.

A linear rate (seconds per prompt token) prices a long prompt far too low: each token
attends over every token before it, so a chunk of n tokens on top of c costs
s0 + n * (a + b * (c + n/2)), s0 the step's fixed cost. The chunks of one chunked prefill
climb in c, so their times give b; fitted per model by least squares on exponentially
decayed sums, only on chunks of calls prefilled in several (a short call's one step says
nothing of context). Chunks of one size cannot tell s0 from a: then a absorbs s0, which
leaves b as it is. Pure; the formula the router prices with is shared/prefill_cost.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.98  # per chunk folded: about the last 50 chunks count (a few long prompts)


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

    def fold(self, f: tuple[float, float, float], t: float) -> None:
        for i in range(3):
            self.ft[i] = self.ft[i] * DECAY + f[i] * t
            for j in range(3):
                self.ff[i][j] = self.ff[i][j] * DECAY + f[i] * f[j]

    def fit(self, cols: tuple[int, ...]) -> list[float] | None:
        return _solve([[self.ff[i][j] for j in cols] for i in cols], [self.ft[i] for i in cols])


@dataclass
class PrefillCurve:
    """Per model: b, seconds per prompt token per token of context attended over."""

    sums: dict[str, _Sums] = field(default_factory=dict)

    def observe(self, model: str, tokens: int, context: int, seconds: float) -> None:
        """A chunk of `tokens` prompt tokens on top of `context` ran in `seconds`."""
        if tokens <= 0 or seconds <= 0 or context < 0:
            return
        x = context + tokens / 2
        self.sums.setdefault(model, _Sums()).fold((1.0, float(tokens), tokens * x), seconds)

    def fit(self, model: str) -> tuple[float, float, float]:
        """(s0, a, b), each >= 0; b is 0 until chunks at different contexts were measured."""
        s = self.sums.get(model)
        if s is None:
            return 0.0, 0.0, 0.0
        full = s.fit((0, 1, 2))
        if full is not None and min(full) >= 0:
            return full[0], full[1], full[2]
        two = s.fit((1, 2))  # one chunk size (or a negative fixed cost): a absorbs s0
        if two is not None and two[1] > 0:
            return 0.0, max(0.0, two[0]), two[1]
        return 0.0, 0.0, 0.0

    def ctx_s_per_tok2(self, model: str | None) -> float:
        """b (0: not measured)."""
        return self.fit(model)[2] if model else 0.0
