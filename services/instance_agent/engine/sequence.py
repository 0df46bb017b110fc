"""One call on an engine, from request to result (nano-vllm's `Sequence`).

What the caller asks (identity, prompt, output cap, sampling, KV scope), what the engine
fills in (context, tokens, timings) and what it gives back (ids, text, finish reason, KV
source). A sequence runs once; how engines that compute and engines that stream fill it is
`Sequence`'s docstring.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any

import torch

from talaria.services.instance_agent.engine.sampling import (
    SamplingParams, StopMatcher, bias_vector, logprob_of, output_mask, sample, token_logprob,
)
from talaria.shared.messages import TokenLogprob
from talaria.shared.model_text import BYTE_TEXT
from talaria.shared.wire import KvSource


@dataclass
class StepToken:
    """What one prefill or decode step gave one call."""

    call_id: str
    token_id: int
    text: str  # incremental text released by this token (stop-string hold-back applied)
    finished: bool
    finish_reason: str | None
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


def _engine(default: Any = None, factory: Any = None) -> Any:
    """A field the engine fills in when it admits the call (not the caller's)."""
    if factory is not None:
        return field(default_factory=factory, init=False)
    return field(default=default, init=False)


@dataclass(eq=False)  # one call: compared and hashed by identity (engines keep sets of them)
class Sequence:
    """Torch engine invariant while running: tokens[:kv_len] have KV in pages; len(tokens) ==
    kv_len + 1 after the first token is sampled (the last sampled token is fed by the next decode).

    The caller builds it (`Sequence(call_id, session_id, model, prompt_ids, max_tokens, params)`)
    and hands it to the engine's `prefill`, `decode` and `finish`; an engine admits it once
    (`admit`, or `admit_streamed` for an engine that streams token ids) and gives it back finished. A
    sequence runs once: to run the same request again, build another
    (`dataclasses.replace(seq)` copies the request alone).

    The torch engine computes the call: page table, sampler and KV length are its (`take`
    samples from the logits it computed). An engine that streams token ids (vLLM, SGLang) is
    handed them: its stream pump (another thread) puts what the engine delivered on `events`,
    the engine thread moves it to `pending`, and `take_streamed` hands one token out. Both
    decide text, stop and length in `_emit`, so every engine gives the same text for the same
    tokens.
    """

    # -- the request (the caller's) --
    call_id: str
    session_id: str
    model: str
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    kv_scope: str = ""  # salts the KV block hashes: prefixes are shared only within one scope
    # Output tokens to reserve KV pages for: the router's estimate (CallRouted.kv_output_tokens,
    # <= max_tokens); 0 = max_tokens. A call that outgrows it grows into unreserved pages.
    kv_output_tokens: int = 0
    # Prompt tokens whose pages the caller pulled from another instance into the host
    # registry before submitting (issue 40): a host restore of them is a migration.
    migrated_tokens: int = 0

    # -- the engine's, from admission on --
    context_length: int = _engine(0)  # 0: not admitted yet
    text_side: Any = _engine(BYTE_TEXT)  # the model's text side (shared/model_text.py): decoder, EOS ids
    tokens: list[int] = _engine(factory=list)  # the prompt, then each generated token
    pages: list[int] = _engine(factory=list)  # torch: the page table
    total_pages: int = _engine(0)  # torch: pages reserved (prompt + the expected output, capped); grows past it
    kv_len: int = _engine(0)
    gen: torch.Generator | None = _engine()  # torch: the sampler's generator (temperature > 0)
    bias: torch.Tensor | None = _engine()  # torch: params.logit_bias as a [V] addend, built on first use
    decoder: Any = _engine()
    eos: frozenset = _engine(frozenset())
    stop_matcher: StopMatcher | None = _engine()
    t_start: float = _engine(0.0)
    t_first: float | None = _engine()
    # A streaming engine's delivery: (token id, {id: logprob} | None) delivered, not yet taken
    events: queue.SimpleQueue | None = _engine()
    pending: list = _engine(factory=list)
    engine_done: bool = _engine(False)  # the engine sent its last output (or the call was aborted there)
    stream: Any = _engine()  # SGLang: the call's output stream

    # -- the result --
    token_ids: list[int] = _engine(factory=list)  # the generated tokens
    finish_reason: str | None = _engine()  # stop | length | abort (released unfinished) | None: running
    cached_tokens: int = _engine(0)  # prompt tokens whose KV was reused (device or host)
    host_restored_tokens: int = _engine(0)  # of them, restored from host memory
    prefill_s: float = _engine(0.0)
    decode_s: float = _engine(0.0)
    logprobs: list[TokenLogprob] | None = _engine()  # one per generated token, when the request asked

    # -- admission --

    @property
    def admitted(self) -> bool:
        return self.context_length > 0

    def admit(self, context_length: int, text_side: Any, t_start: float, *, cached_tokens: int = 0,
              host_restored_tokens: int = 0, pages: list[int] | None = None, total_pages: int = 0,
              gen: torch.Generator | None = None) -> Sequence:
        """The engine takes the call: its context, the model's text side, and (torch) the KV
        it reuses and the pages it reserved."""
        self.context_length, self.text_side, self.t_start = context_length, text_side, t_start
        self.tokens = list(self.prompt_ids)
        self.pages, self.total_pages, self.gen = list(pages or ()), total_pages, gen
        self.cached_tokens, self.host_restored_tokens = cached_tokens, host_restored_tokens
        self.kv_len = cached_tokens
        self.stop_matcher = StopMatcher(self.params.stop)
        self.decoder = text_side.decoder()
        self.eos = frozenset(text_side.eos_ids)
        self.logprobs = [] if self.params.logprobs else None
        return self

    def admit_streamed(self, context_length: int, text_side: Any, t_start: float) -> Sequence:
        """Admitted by an engine that computes the call and streams its token ids to us (vLLM, SGLang)."""
        self.admit(context_length, text_side, t_start)
        self.events = queue.SimpleQueue()
        return self

    # -- while running --

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill (0 once it has its first token; a streaming engine
        returns every call with its first token)."""
        return 0 if self.t_first is not None else max(0, len(self.tokens) - self.kv_len)

    def pages_to_come(self) -> int:
        return max(0, self.total_pages - len(self.pages))

    def take(self, logits: torch.Tensor, now: float) -> StepToken:
        """Sample from this call's logits, advance, and decide whether it finished."""
        p = self.params
        if self.text_side.allowed_output is not None:
            logits = logits + output_mask(self.text_side.allowed_output, logits.shape[-1], logits.device)
        if p.logit_bias:
            if self.bias is None:
                self.bias = bias_vector(p.logit_bias, logits.shape[-1], logits.device)
            logits = logits + self.bias
        tok = sample(logits, p.temperature, p.top_p, self.gen)
        lp = token_logprob(logits, tok, p.top_logprobs) if p.logprobs else None
        return self._emit(tok, lp, now)

    def take_streamed(self, now: float) -> StepToken:
        """The next token the engine delivered. The caller aborts the call in its engine when
        it ended here first (a stop string)."""
        tok, lp = self.pending.pop(0)
        p = self.params
        logprob = logprob_of(tok, lp, p.top_logprobs) if p.logprobs and lp is not None else None
        return self._emit(tok, logprob, now)

    def _emit(self, tok: int, logprob, now: float) -> StepToken:
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.t_first is None:
            self.t_first = now
        self.tokens.append(tok)
        self.token_ids.append(tok)
        text, stopped = self.stop_matcher.push(self.decoder.push(tok))
        if stopped or tok in self.eos:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_tokens or len(self.tokens) >= self.context_length:
            self.finish_reason = "length"
        elif self.engine_done and not self.pending:
            self.finish_reason = "length"  # a streaming engine stopped at its own cap (the context left)
        if self.finished and not stopped:
            text += self.stop_matcher.flush(self.decoder.flush())
        return StepToken(self.call_id, tok, text, self.finished, self.finish_reason, logprob)

    def end_for_kv(self) -> StepToken:
        """The instance has no KV page left for this call's next token: it finishes with the
        tokens it has, finish reason "length" (its held-back text released)."""
        self.finish_reason = "length"
        text = self.stop_matcher.flush(self.decoder.flush())
        return StepToken(self.call_id, -1, text, True, "length")

    def released(self) -> Sequence:
        """Its engine let it go (`finish`): one not finished was aborted."""
        if self.finish_reason is None:
            self.finish_reason = "abort"
        return self

    # -- the result --

    @property
    def text(self) -> str:
        """The generated text (a stop string that ended it excluded)."""
        return self.stop_matcher.text if self.stop_matcher is not None else ""

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the call, if one did."""
        return self.stop_matcher.matched if self.stop_matcher is not None else None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def kv_source(self) -> KvSource:
        if self.host_restored_tokens:
            return "migrated" if self.migrated_tokens else "host"
        return "device" if self.cached_tokens else "recompute"

    @property
    def ttft_s(self) -> float:
        """From the engine's start of this call to its first token."""
        return (self.t_first - self.t_start) if self.t_first is not None else 0.0
