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


def call_problem(call) -> tuple[str, str] | None:
    """The checks above for a CallSubmitted (or anything with its sampling fields)."""
    if call.max_tokens < 1:
        return "max_tokens", "`max_tokens` must be at least 1"
    return sampling_problem(call.temperature, call.top_p, call.seed) or stop_problem(list(call.stop))
