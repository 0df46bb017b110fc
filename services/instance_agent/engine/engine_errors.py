"""Engine errors: a small hierarchy whose instances carry the data a caller needs.

The service translates these at its boundary (``raise ErrorReply(...) from err``);
nothing in the engine asserts on user input.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the torch engine raises on purpose."""


class UnknownModel(EngineError, KeyError):
    def __init__(self, model: str, known: list[str]) -> None:
        super().__init__(model)
        self.model, self.known = model, known

    def __str__(self) -> str:
        return f"model {self.model!r} is not served by this engine; known: {', '.join(self.known)}"


class InvalidRequest(EngineError, ValueError):
    def __init__(self, call_id: str, field: str, reason: str) -> None:
        super().__init__(call_id, field, reason)
        self.call_id, self.field, self.reason = call_id, field, reason

    def __str__(self) -> str:
        return f"call {self.call_id!r}: invalid {self.field}: {self.reason}"


class ContextTooLong(EngineError, ValueError):
    def __init__(self, model: str, tokens: int, limit: int) -> None:
        super().__init__(model, tokens, limit)
        self.model, self.tokens, self.limit = model, tokens, limit

    def __str__(self) -> str:
        return f"prompt of {self.tokens} tokens exceeds {self.model!r} context length {self.limit}"


class OutOfKvPages(EngineError, RuntimeError):
    """The device KV pool cannot hold the call even after evicting every cached prefix."""

    def __init__(self, model: str, needed: int, available: int) -> None:
        super().__init__(model, needed, available)
        self.model, self.needed, self.available = model, needed, available

    def __str__(self) -> str:
        return (f"{self.model!r}: call needs {self.needed} KV pages, "
                f"only {self.available} can be made free")


class ModelNotActive(EngineError, RuntimeError):
    def __init__(self, model: str, active: str | None) -> None:
        super().__init__(model, active)
        self.model, self.active = model, active

    def __str__(self) -> str:
        return f"model {self.model!r} is not active (active: {self.active!r}); switch first"


class EngineBusy(EngineError, RuntimeError):
    """A switch was asked for while calls of the active model are still running: `running`
    holds their sequences (sequence.py), so a caller can release those it no longer runs."""

    def __init__(self, running: list) -> None:
        super().__init__(running)
        self.running = running

    def __str__(self) -> str:
        ids = sorted(s.call_id for s in self.running)
        return f"cannot switch model: {len(ids)} call(s) still running: {ids[:5]}"


class UnknownCall(EngineError, KeyError):
    def __init__(self, call_id: str, why: str = "not running") -> None:
        super().__init__(call_id, why)
        self.call_id, self.why = call_id, why

    def __str__(self) -> str:
        return f"call {self.call_id!r}: {self.why}"


class WeightsCorrupt(EngineError, RuntimeError):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path, self.reason = path, reason

    def __str__(self) -> str:
        return f"weights file {self.path}: {self.reason}"


class EngineFailed(EngineError, RuntimeError):
    """An engine we drive (vLLM, SGLang) ended a call without its tokens, or stopped answering."""

    def __init__(self, engine: str, model: str, reason: str) -> None:
        super().__init__(engine, model, reason)
        self.engine, self.model, self.reason = engine, model, reason

    def __str__(self) -> str:
        return f"{self.engine} engine for {self.model!r}: {self.reason}"
