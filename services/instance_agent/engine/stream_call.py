"""One call on an engine that streams token ids (vLLM, SGLang): the tokens it delivered and
not yet handed to the agent, and the text side decided here exactly as the torch engine's
`Sequence.take` decides it (the model's decoder, stop strings held back, EOS, length), so the
adapters give the torch engine's text for the same tokens.

Filled by the adapter's stream pump (another thread) through `events`; read on the agent's
engine thread.
"""

from __future__ import annotations

import math
import queue
from dataclasses import dataclass, field
from typing import Any

from talaria.services.instance_agent.engine.contract import GenRequest, GenResult, StepToken
from talaria.services.instance_agent.engine.sampling import LOGPROB_FLOOR, StopMatcher
from talaria.shared.messages import TokenLogprob


@dataclass
class StreamedCall:
    req: GenRequest
    model: str
    context_length: int
    t_start: float
    text: Any  # shared/model_text.py: decoder(), eos_ids
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    pending: list = field(default_factory=list)  # (token id, {id: logprob} | None), delivered not taken
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    engine_done: bool = False  # the engine sent its last output (or the call was aborted there)
    cached_tokens: int = 0
    host_tokens: int = 0
    t_first: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def __post_init__(self) -> None:
        self.stop = StopMatcher(tuple(self.req.stop))
        self.decoder = self.text.decoder()
        self.eos = frozenset(self.text.eos_ids)

    @property
    def kv_source(self) -> str:
        if self.host_tokens:
            return "host"
        return "device" if self.cached_tokens else "recompute"

    def take(self, now: float) -> StepToken:
        """The next delivered token, its text, and whether the call ends with it. The caller
        aborts the call in its engine when it ended here first (a stop string)."""
        tok, lp = self.pending.pop(0)
        if self.t_first is None:
            self.t_first = now
        self.generated.append(tok)
        logprob = logprob_of(tok, lp, self.req.top_logprobs) if self.req.logprobs and lp is not None else None
        if logprob is not None:
            self.logprobs.append(logprob)
        text, stopped = self.stop.push(self.decoder.push(tok))
        n = len(self.generated)
        if stopped or tok in self.eos:
            self.finish_reason = "stop"
        elif n >= self.req.max_tokens or len(self.req.prompt_ids) + n >= self.context_length:
            self.finish_reason = "length"
        elif self.engine_done and not self.pending:
            self.finish_reason = "length"  # the engine stopped at its own cap (the context left)
        if self.finish_reason is not None and not stopped:
            text += self.stop.flush(self.decoder.flush())
        return StepToken(self.req.call_id, tok, text, self.finish_reason is not None, self.finish_reason, logprob)

    def result(self) -> GenResult:
        ttft = (self.t_first - self.t_start) if self.t_first is not None else 0.0
        return GenResult(
            call_id=self.req.call_id, token_ids=list(self.generated), text=self.stop.text,
            finish_reason=self.finish_reason or "abort", prompt_tokens=len(self.req.prompt_ids),
            cached_tokens=self.cached_tokens, kv_source=self.kv_source,  # type: ignore[arg-type]
            prefill_s=self.prefill_s, decode_s=self.decode_s, ttft_s=ttft, session_id=self.req.session_id,
            model=self.model, host_restored_tokens=self.host_tokens, stop_sequence=self.stop.matched,
            logprobs=list(self.logprobs) if self.req.logprobs else None)


def logprob_of(tok: int, lp: dict, top: int) -> TokenLogprob:
    """A token's logprob and the `top` most likely alternatives from an engine's
    {token id: logprob} map (values are floats, or objects with `.logprob` and `.rank`)."""
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
