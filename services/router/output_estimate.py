"""How many tokens a call will generate, estimated online from completed calls. Pure.

A live router never knows a call's output length: `max_tokens` is the client's cap (the
OpenAI default of our gateway is 256, Claude Code asks 32,000, an OpenAI SDK client that
sends none gets the model's whole context), and most calls stop far below it. Pricing a call
by its cap prices a 40-token tool call as 32,000 tokens of decode and reserves KV it never
uses. So the router estimates, from what it has seen finish (`CallCompleted.output_tokens`), a
mean for the decode work it prices and a quantile for the KV it admits (`OutputEstimator`).

With no completion of the model yet there is nothing to estimate from: both are the cap
(the only bound a live router has; the first completions replace it).

Folded only from `CallCompleted` (router state.py), so a replayed router, the simulator and
the live service estimate the same numbers from the same inputs.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from talaria.shared.stats import quantile

MODEL_KEEP = 256  # recent outputs kept per model (as the router keeps tool gaps, profiles.GAP_KEEP)
SESSION_KEEP = 16  # recent outputs kept per session (as state.SESSION_GAPS_KEPT)
SESSIONS_KEPT = 100_000  # sessions remembered (oldest forgotten first, as state.ROUTED_KEPT)
# The KV a call is admitted for covers 95 % of the model's recent calls: the quantile the
# paper reports tails at; the remaining 5 % grow into free and idle KV on the instance.
KV_QUANTILE = 0.95


@dataclass
class _History:
    outputs: list[int] = field(default_factory=list)  # oldest first
    total: int = 0  # sum of `outputs`
    _sorted: list[int] | None = field(default=None, repr=False, compare=False)  # cache

    def add(self, n: int, keep: int) -> None:
        self.outputs.append(n)
        self.total += n
        if len(self.outputs) > keep:
            self.total -= self.outputs.pop(0)
        self._sorted = None

    def mean(self) -> float:
        return self.total / len(self.outputs)

    def quantile(self, q: float) -> float:
        if self._sorted is None:
            self._sorted = sorted(self.outputs)
        return quantile(self._sorted, q)


@dataclass
class OutputEstimator:
    """The two estimates, from completed calls:

        expected(s, m, cap)  the decode work the cost terms price (decode seconds, round-sharing
                             stretch): a mean, because work adds up. The session's own recent
                             outputs, with the model's mean as one more observation (its prior);
                             before the session finished any call, the model's mean; capped by cap.
        kv_tokens(s, m, cap) the KV a call is admitted for (router KV fit, the agent's page
                             reservation): a quantile (KV_QUANTILE) of the model's recent outputs,
                             raised to the session's largest recent one, capped by cap. A call
                             that outgrows it is not refused: the agent grows it into free and
                             idle KV (engine/admission.py).
    """

    models: dict[str, _History] = field(default_factory=dict)
    sessions: OrderedDict[tuple[str, str], _History] = field(default_factory=OrderedDict)
    kept: int = SESSIONS_KEPT  # the router's session-table bound (state.rows_for), not saved

    def observe(self, session_id: str, model: str, output_tokens: int) -> None:
        """Fold one completed call's output length."""
        if output_tokens < 1:
            return  # a call that produced nothing (aborted) says nothing about lengths
        self.models.setdefault(model, _History()).add(output_tokens, MODEL_KEEP)
        key = (session_id, model)
        hist = self.sessions.pop(key, None) or _History()
        hist.add(output_tokens, SESSION_KEEP)
        self.sessions[key] = hist  # most recently used last
        while len(self.sessions) > self.kept:
            self.sessions.popitem(last=False)

    def expected(self, session_id: str, model: str, cap: int) -> float:
        """Mean output tokens to price decode work with (>= 1, <= cap)."""
        prior = self.models.get(model)
        if prior is None:
            return float(max(1, cap))
        own = self.sessions.get((session_id, model))
        mean = prior.mean() if own is None else (own.total + prior.mean()) / (len(own.outputs) + 1)
        return float(min(max(1.0, mean), max(1, cap)))

    def kv_tokens(self, session_id: str, model: str, cap: int) -> int:
        """Output tokens to admit a call's KV for (>= 1, <= cap)."""
        prior = self.models.get(model)
        if prior is None:
            return max(1, cap)
        q = prior.quantile(KV_QUANTILE)
        own = self.sessions.get((session_id, model))
        if own is not None:
            q = max(q, max(own.outputs))
        return int(min(max(1, math.ceil(q)), max(1, cap)))

    # ---- projection form (router state.to_dict) ------------------------------------------

    def to_dict(self) -> dict:
        return {"models": {m: list(h.outputs) for m, h in self.models.items()},
                "sessions": [[s, m, list(h.outputs)] for (s, m), h in self.sessions.items()]}

    @classmethod
    def from_dict(cls, data: dict) -> OutputEstimator:
        est = cls()
        for m, outs in data.get("models", {}).items():
            est.models[m] = _History(list(outs), sum(outs))
        for s, m, outs in data.get("sessions", []):
            est.sessions[(s, m)] = _History(list(outs), sum(outs))
        return est
