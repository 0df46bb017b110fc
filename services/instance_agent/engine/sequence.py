"""One call's running state, on every engine: its tokens, the text side (the model's decoder,
stop strings held back, EOS, length), timings, and what the engine that runs it needs.

The torch engine computes the call: page table, sampler and KV length are its (`take`
samples from the logits it computed). An engine that streams token ids (vLLM, SGLang) is
handed them: its stream pump (another thread) puts what the engine delivered on `events`,
the engine thread moves it to `pending`, and `take_streamed` hands one token out. Both
decide text, stop and length in `_emit`, so every engine gives the same text for the same
tokens.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any

import torch

from talaria.services.instance_agent.engine.contract import GenRequest, GenResult, StepToken
from talaria.services.instance_agent.engine.sampling import (
    StopMatcher, bias_vector, logprob_of, output_mask, sample, token_logprob,
)
from talaria.shared.model_text import BYTE_TEXT


@dataclass
class Sequence:
    """Torch engine invariant while running: tokens[:kv_len] have KV in pages; len(tokens) ==
    kv_len + 1 after the first token is sampled (the last sampled token is fed by the next decode)."""

    req: GenRequest
    context_length: int
    tokens: list[int] = field(default_factory=list)  # the prompt, then each generated token
    pages: list[int] = field(default_factory=list)  # torch: the page table
    cached_tokens: int = 0
    host_tokens: int = 0
    total_pages: int = 0  # torch: pages reserved (prompt + the expected output, capped); grows past it
    t_start: float = 0.0
    gen: torch.Generator | None = None  # torch: the sampler's generator (temperature > 0)
    kv_len: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    t_first: float | None = None
    finish_reason: str | None = None
    generated: list[int] = field(default_factory=list)
    text: object = BYTE_TEXT  # the model's text side (shared/model_text.py): decoder, EOS ids
    decoder: object = None
    stop: StopMatcher | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprob per generated token, when asked
    bias: torch.Tensor | None = None  # torch: req.logit_bias as a [V] addend, built on first use
    # A streaming engine's delivery: (token id, {id: logprob} | None) delivered, not yet taken
    events: queue.SimpleQueue | None = None
    pending: list = field(default_factory=list)
    engine_done: bool = False  # the engine sent its last output (or the call was aborted there)
    stream: Any = None  # SGLang: the call's output stream

    def __post_init__(self) -> None:
        self.stop = StopMatcher(tuple(self.req.stop))
        self.decoder = self.text.decoder()
        self.eos = frozenset(self.text.eos_ids)
        self.kv_len = self.cached_tokens

    @classmethod
    def streamed(cls, req: GenRequest, context_length: int, t_start: float, text: object) -> Sequence:
        """A call an engine computes and streams to us (vLLM, SGLang)."""
        return cls(req, context_length, list(req.prompt_ids), t_start=t_start, text=text,
                   events=queue.SimpleQueue())

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def kv_source(self) -> str:
        if self.host_tokens:
            return "host"
        return "device" if self.cached_tokens else "recompute"

    def pages_to_come(self) -> int:
        return max(0, self.total_pages - len(self.pages))

    def take(self, logits: torch.Tensor, now: float) -> StepToken:
        """Sample from this call's logits, advance, and decide whether it finished."""
        if self.text.allowed_output is not None:
            logits = logits + output_mask(self.text.allowed_output, logits.shape[-1], logits.device)
        if self.req.logit_bias:
            if self.bias is None:
                self.bias = bias_vector(self.req.logit_bias, logits.shape[-1], logits.device)
            logits = logits + self.bias
        tok = sample(logits, self.req.temperature, self.req.top_p, self.gen)
        lp = token_logprob(logits, tok, self.req.top_logprobs) if self.req.logprobs else None
        return self._emit(tok, lp, now)

    def take_streamed(self, now: float) -> StepToken:
        """The next token the engine delivered. The caller aborts the call in its engine when
        it ended here first (a stop string)."""
        tok, lp = self.pending.pop(0)
        logprob = logprob_of(tok, lp, self.req.top_logprobs) if self.req.logprobs and lp is not None else None
        return self._emit(tok, logprob, now)

    def _emit(self, tok: int, logprob, now: float) -> StepToken:
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.t_first is None:
            self.t_first = now
        self.tokens.append(tok)
        self.generated.append(tok)
        text, stopped = self.stop.push(self.decoder.push(tok))
        if stopped or tok in self.eos:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.req.max_tokens or len(self.tokens) >= self.context_length:
            self.finish_reason = "length"
        elif self.engine_done and not self.pending:
            self.finish_reason = "length"  # a streaming engine stopped at its own cap (the context left)
        if self.finished and not stopped:
            text += self.stop.flush(self.decoder.flush())
        return StepToken(self.req.call_id, tok, text, self.finished, self.finish_reason, logprob)

    def end_for_kv(self) -> StepToken:
        """The instance has no KV page left for this call's next token: it finishes with the
        tokens it has, finish reason "length" (its held-back text released)."""
        self.finish_reason = "length"
        text = self.stop.flush(self.decoder.flush())
        return StepToken(self.req.call_id, -1, text, True, "length")

    def result(self, model: str) -> GenResult:
        ttft = (self.t_first - self.t_start) if self.t_first is not None else 0.0
        return GenResult(
            call_id=self.req.call_id, token_ids=list(self.generated), text=self.stop.text,
            finish_reason=self.finish_reason or "abort", prompt_tokens=len(self.req.prompt_ids),
            cached_tokens=self.cached_tokens, kv_source=self.kv_source,  # type: ignore[arg-type]
            prefill_s=self.prefill_s, decode_s=self.decode_s, ttft_s=ttft,
            session_id=self.req.session_id, model=model, host_restored_tokens=self.host_tokens,
            stop_sequence=self.stop.matched, logprobs=list(self.logprobs) if self.req.logprobs else None,
        )
