"""Token sampling (greedy, temperature + top-p with a per-call generator) and stop strings,
and a call's knobs for them (`SamplingParams`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from talaria.shared.messages import TokenLogprob


@dataclass(frozen=True)
class SamplingParams:
    """How a call's tokens are chosen and reported: parameters, not a call (no identity), as
    vLLM's `SamplingParams`. The routed call's fields of the same names."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    logprobs: bool = False  # report each generated token's logprob ...
    top_logprobs: int = 0  # ... and this many most likely alternatives

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))  # a list (the wire's) is accepted


_masks: dict[tuple[int, int, str], torch.Tensor] = {}


def output_mask(allowed: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """-inf for every id outside `allowed` (the built-in models' printable-only output:
    shared/model_text.py says why)."""
    key = (id(allowed), vocab, str(device))
    mask = _masks.get(key)
    if mask is None:
        mask = torch.full((vocab,), float("-inf"), device=device)
        mask[[t for t in allowed if t < vocab]] = 0.0
        _masks[key] = mask
    return mask


def bias_vector(bias: dict[int, float], vocab: int, device: torch.device) -> torch.Tensor:
    """OpenAI's `logit_bias` as a dense [V] addend (ids were checked against the vocabulary)."""
    vec = torch.zeros(vocab, device=device)
    ids = [t for t in bias if 0 <= t < vocab]
    vec[ids] = torch.tensor([float(bias[t]) for t in ids], device=device)
    return vec


LOGPROB_FLOOR = -9999.0  # what OpenAI reports for an impossible token (JSON has no -inf)


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under `logits` [V] and the `top` most likely ids. The caller
    passes the logits after masking and `logit_bias`, before temperature and top-p: the
    model's distribution as the request reshaped it, whatever the sampler then drew."""
    logp = torch.log_softmax(logits.float(), dim=-1)

    def r(x: float) -> float:
        return round(max(x, LOGPROB_FLOOR), 5)  # rounded: a call carries one per token

    if top > 0:
        vals, ids = torch.topk(logp, min(top, logp.shape[-1]))
        return TokenLogprob(token, r(float(logp[token])), ids.tolist(), [r(v) for v in vals.tolist()])
    return TokenLogprob(token, r(float(logp[token])))


def logprob_of(tok: int, lp: dict, top: int) -> TokenLogprob:
    """A token's logprob and the `top` most likely alternatives from an engine's
    {token id: logprob} map (vLLM, SGLang) (values are floats, or objects with `.logprob` and `.rank`)."""
    def value(v) -> float:
        x = getattr(v, "logprob", v)
        return round(max(x, LOGPROB_FLOOR), 5) if math.isfinite(x) else LOGPROB_FLOOR

    own = lp.get(tok)
    mine = value(own) if own is not None else LOGPROB_FLOOR
    if top <= 0:
        return TokenLogprob(tok, mine)
    ranked = sorted(lp.items(), key=lambda kv: -getattr(kv[1], "logprob", kv[1]))
    rank = {t: getattr(v, "rank", None) for t, v in lp.items()}
    if all(r is not None for r in rank.values()):  # vLLM: ranks given (the sampled token may be outside the top)
        ranked = sorted(((t, v) for t, v in lp.items() if rank[t] <= top), key=lambda kv: rank[kv[0]])
    ranked = ranked[:top]
    return TokenLogprob(tok, mine, [t for t, _ in ranked], [value(v) for _, v in ranked])


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()  # non-deterministic on purpose: the caller gave no seed
    else:
        gen.manual_seed(seed % 2**64)  # any int: torch takes only [0, 2**64)
    return gen


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """One token from logits [V]. temperature 0 is greedy (argmax, ties to the lowest id).

    Any temperature > 0 and top_p > 0 yields a token: a temperature so small that the
    scaled logits overflow (1e-300) is its limit, greedy; a top_p below the top token's
    probability (5e-324) keeps that token alone."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return int(torch.argmax(logits))
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p  # smallest set reaching top_p
        keep[0] = True  # the top token always (top_p may round to 0 in float32)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen))


class StopMatcher:
    """Releases generated text incrementally, holding back what could still become a stop string.

    The stop string itself is never released: `push` returns (text to emit, stopped).
    """

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # final text (stop excluded once stopped)
        self._emitted = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.text += piece
        if not self.stops:
            return self._release(len(self.text)), False
        window = max(len(s) for s in self.stops) + len(piece)
        start = max(0, len(self.text) - window)
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stops) if i >= 0]
        if hits:
            cut, self.matched = min(hits)
            self.text = self.text[:cut]
            self.stopped = True
            return self._release(cut), True
        return self._release(len(self.text) - self._held_back()), False

    def flush(self, tail: str = "") -> str:
        """End of generation without a stop: release everything still held."""
        if self.stopped:
            return ""
        self.text += tail
        return self._release(len(self.text))

    def _held_back(self) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out
