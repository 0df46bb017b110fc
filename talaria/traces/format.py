"""The normalised session-trace format: one JSON object per line, one line per model call.

Every simulator input (converted WEKA traces, users' own traces, test fixtures) uses it; the
fields and their bounds: `TraceCall`. Unknown fields are an error, so typos do not pass.

Lines of one session must be contiguous and in call order. Blank lines and lines starting
with ``#`` are skipped. ``load_trace`` validates every line and raises ``TraceFormatError``
naming the file, line number and field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

REQUIRED = (
    "session",
    "call_index",
    "model",
    "prompt_tokens",
    "reusable_prefix_tokens",
    "output_tokens",
    "gap_before_s",
)
OPTIONAL = ("kind", "source", "max_tokens")
SERVED_SOURCE = "calls:"  # `source` prefix of an exported call: `calls:<call_id>`
KINDS = ("start", "tool", "user")


class TraceFormatError(ValueError):
    """A trace line is malformed. Carries where: `path`, `line` (1-based) and `field`."""

    def __init__(self, path: str, line: int, field: str | None, message: str) -> None:
        self.path, self.line, self.field, self.message = path, line, field, message
        where = f"{path}:{line}" + (f" field {field!r}" if field else "")
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class TraceCall:
    """One model call of one session.

    Required fields, per line:

    =======================  =====  ==========================================================
    field                    type   meaning
    =======================  =====  ==========================================================
    session                  str    session id (non-empty); calls of a session share it
    call_index               int    0, 1, 2, ... in call order within the session, no gaps
    model                    str    model the call targets (non-empty)
    prompt_tokens            int    prompt length in tokens, > 0
    reusable_prefix_tokens   int    longest common prefix with (previous prompt + its output),
                                    0 <= r <= prompt_tokens; 0 on call_index 0
    output_tokens            int    completion tokens, >= 1
    gap_before_s             float  call 0: the session's start offset from the replay start;
                                    later calls: tool/think gap between the previous call's
                                    completion and this call's release, >= 0
    =======================  =====  ==========================================================

    Optional fields: ``kind`` ("tool" continuation, "user" turn, "start"), ``source`` (free
    text, e.g. the original trace id; ``calls:<call_id>`` for a call a stack served, written by
    ``talaria trace export``), ``max_tokens`` (the client's cap on the output, >=
    output_tokens; absent: a documented mix of API defaults, traces/caps.py). Unknown fields are
    an error, so typos do not pass.
    """

    session: str
    call_index: int
    model: str
    prompt_tokens: int
    reusable_prefix_tokens: int
    output_tokens: int
    gap_before_s: float
    kind: str = "tool"
    source: str = ""
    max_tokens: int = 0  # the client's cap; 0 = not recorded (traces/caps.py supplies one)

    @property
    def new_tokens(self) -> int:
        """Tokens that must be prefilled even when the reusable prefix is on device."""
        return self.prompt_tokens - self.reusable_prefix_tokens


@dataclass(frozen=True, slots=True)
class Session:
    """A session's calls in order. `model` is the model of its calls (one per session)."""

    id: str
    calls: tuple[TraceCall, ...]

    @property
    def model(self) -> str:
        return self.calls[0].model


def _check_int(path, lineno, obj, name, minimum):
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(path, lineno, name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise TraceFormatError(path, lineno, name, f"must be >= {minimum}, got {value}")
    return value


def parse_line(obj: object, path: str = "<trace>", lineno: int = 0) -> TraceCall:
    """Validate one decoded JSON object and build a `TraceCall`."""
    if not isinstance(obj, dict):
        raise TraceFormatError(path, lineno, None, "a line must be a JSON object")
    for name in REQUIRED:
        if name not in obj:
            raise TraceFormatError(path, lineno, name, "required field is missing")
    unknown = sorted(set(obj) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise TraceFormatError(path, lineno, unknown[0], "unknown field")
    for name in ("session", "model"):
        if not isinstance(obj[name], str) or not obj[name]:
            raise TraceFormatError(path, lineno, name, "must be a non-empty string")
    call_index = _check_int(path, lineno, obj, "call_index", 0)
    prompt = _check_int(path, lineno, obj, "prompt_tokens", 1)
    reusable = _check_int(path, lineno, obj, "reusable_prefix_tokens", 0)
    output = _check_int(path, lineno, obj, "output_tokens", 1)
    if reusable > prompt:
        raise TraceFormatError(
            path, lineno, "reusable_prefix_tokens", f"{reusable} exceeds prompt_tokens {prompt}"
        )
    if call_index == 0 and reusable:
        raise TraceFormatError(path, lineno, "reusable_prefix_tokens", "must be 0 on call 0")
    gap = obj["gap_before_s"]
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not gap >= 0:
        raise TraceFormatError(path, lineno, "gap_before_s", f"must be a number >= 0, got {gap!r}")
    kind = obj.get("kind", "start" if call_index == 0 else "tool")
    if kind not in KINDS:
        raise TraceFormatError(path, lineno, "kind", f"must be one of {KINDS}, got {kind!r}")
    source = obj.get("source", "")
    if not isinstance(source, str):
        raise TraceFormatError(path, lineno, "source", "must be a string")
    cap = _check_int(path, lineno, obj, "max_tokens", output) if "max_tokens" in obj else 0
    return TraceCall(
        obj["session"], call_index, obj["model"], prompt, reusable, output, float(gap), kind, source, cap
    )


def iter_numbered(stream: IO[str], path: str = "<trace>") -> Iterator[tuple[int, TraceCall]]:
    """Parse and validate lines one by one (streaming); yields (physical line, call)."""
    for lineno, raw in enumerate(stream, start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(path, lineno, None, f"invalid JSON: {exc.msg}") from exc
        yield lineno, parse_line(obj, path, lineno)


def group_sessions(
    numbered: Iterable[tuple[int, TraceCall]], path: str = "<trace>"
) -> list[Session]:
    """Group (line, call) pairs into sessions, checking contiguity, order and one model."""
    sessions: list[Session] = []
    seen: set[str] = set()
    current: list[TraceCall] = []
    for lineno, call in numbered:
        if current and call.session != current[0].session:
            sessions.append(Session(current[0].session, tuple(current)))
            current = []
        if not current:
            if call.session in seen:
                raise TraceFormatError(path, lineno, "session", f"{call.session!r} is not contiguous")
            seen.add(call.session)
        if call.call_index != len(current):
            raise TraceFormatError(
                path, lineno, "call_index", f"expected {len(current)}, got {call.call_index}"
            )
        if current and call.model != current[0].model:
            raise TraceFormatError(path, lineno, "model", "a session must keep one model")
        current.append(call)
    if current:
        sessions.append(Session(current[0].session, tuple(current)))
    return sessions


def sessions_from_calls(calls: Iterable[TraceCall]) -> list[Session]:
    """Group in-memory calls (e.g. from a workload builder) into validated sessions."""
    return group_sessions(enumerate(calls, start=1), "<memory>")


def dump_calls(calls: Iterable[TraceCall], stream: IO[str]) -> int:
    """Write calls as normalised JSONL; returns the number of lines written."""
    n = 0
    for call in calls:
        record = asdict(call)
        if not record["source"]:
            del record["source"]
        if not record["max_tokens"]:
            del record["max_tokens"]
        stream.write(json.dumps(record, separators=(",", ":")) + "\n")
        n += 1
    return n


def save_sessions(sessions: Iterable[Session], path: str | Path) -> int:
    with Path(path).open("w", encoding="utf-8") as stream:
        return dump_calls((c for s in sessions for c in s.calls), stream)
