"""What a call may ask of the engine: the gateway refuses the rest with a 400, and the agent
checks again (a call published straight onto the bus fails alone, never the agent).

The sampling bounds are OpenAI's (temperature in [0, 2], top_p in (0, 1], seed an int64);
values inside them that float32 cannot represent (top_p 5e-324, temperature 1e-300) are
the engine's to handle, see engine/sampling.py.
"""

from __future__ import annotations

import math

MAX_TEMPERATURE = 2.0
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 1024  # per stop string; the matcher holds back up to this much text per token
MAX_LOGIT_BIAS = 300  # entries; OpenAI's bound, as are the bias range and top_logprobs'
LOGIT_BIAS_RANGE = 100.0
MAX_TOP_LOGPROBS = 20
# Logprob entries (tokens x (1 + top_logprobs)) one call may return: its CallResult carries them
# all in one bus message, ~16 bytes each, so this keeps it well under NATS's 1 MiB default.
MAX_LOGPROB_ENTRIES = 32768


def sampling_problem(temperature: float, top_p: float, seed: int | None) -> tuple[str, str] | None:
    """(field, what is wrong) for sampling parameters outside the API's bounds, else None."""
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        return "temperature", f"`temperature` must be between 0 and {MAX_TEMPERATURE:g}"
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        return "top_p", "`top_p` must be in (0, 1]"
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        return "seed", "`seed` must be a 64-bit signed integer"
    return None


def stop_problem(stop: list[str]) -> tuple[str, str] | None:
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        return "stop", f"`stop` takes at most {MAX_STOP_STRINGS} non-empty strings"
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        return "stop", f"each `stop` string may have at most {MAX_STOP_CHARS} characters"
    return None


def logprob_problem(logit_bias: dict[int, float] | None, logprobs: bool, top_logprobs: int,
                    max_tokens: int, vocab_size: int | None = None) -> tuple[str, str] | None:
    """`logit_bias` and `logprobs`/`top_logprobs` within OpenAI's bounds and one bus message;
    with `vocab_size`, bias ids inside the model's vocabulary."""
    bias = logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        return "logit_bias", f"`logit_bias` takes at most {MAX_LOGIT_BIAS} entries"
    for tid, b in bias.items():
        if not (math.isfinite(b) and -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE):
            return "logit_bias", f"`logit_bias` values must be between -{LOGIT_BIAS_RANGE:g} and {LOGIT_BIAS_RANGE:g}"
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            upper = f"{vocab_size}" if vocab_size is not None else "the vocabulary size"
            return "logit_bias", f"`logit_bias` token id {tid} is outside the model's vocabulary [0, {upper})"
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        return "top_logprobs", f"`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}"
    if top_logprobs and not logprobs:
        return "top_logprobs", "`top_logprobs` needs `logprobs` set to true"
    if logprobs and max_tokens * (1 + top_logprobs) > MAX_LOGPROB_ENTRIES:
        return "top_logprobs", (f"`max_tokens` x (1 + `top_logprobs`) may be at most {MAX_LOGPROB_ENTRIES} "
                                "with `logprobs` (the answer must fit one message)")
    return None


def call_problem(call, vocab_size: int | None = None) -> tuple[str, str] | None:
    """The checks above for a CallSubmitted (or anything with its sampling fields)."""
    if call.max_tokens < 1:
        return "max_tokens", "`max_tokens` must be at least 1"
    return (sampling_problem(call.temperature, call.top_p, call.seed) or stop_problem(list(call.stop))
            or logprob_problem(call.logit_bias, call.logprobs, call.top_logprobs, call.max_tokens, vocab_size))
