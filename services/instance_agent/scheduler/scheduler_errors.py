"""Errors the scheduler raises. Each carries the data that explains it.

They signal a driver bug or a misrouted call (bad input at the boundary), never an
overload: overload is reported through deadline-risk events and counters.
"""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class of every scheduler error."""


class InvalidWorkError(SchedulerError, ValueError):
    def __init__(self, call_id: str, problem: str) -> None:
        super().__init__(f"call {call_id!r}: {problem}")
        self.call_id = call_id
        self.problem = problem


class ModelNotServedError(SchedulerError, KeyError):
    def __init__(self, model: str, served: tuple[str, ...]) -> None:
        super().__init__(model)
        self.model = model
        self.served = served

    def __str__(self) -> str:
        return f"model {self.model!r} is not served here; served: {', '.join(self.served)}"


class DuplicateCallError(SchedulerError, ValueError):
    def __init__(self, call_id: str) -> None:
        super().__init__(f"call {call_id!r} was already submitted")
        self.call_id = call_id


class UnknownCallError(SchedulerError, KeyError):
    def __init__(self, call_id: str, where: str) -> None:
        super().__init__(call_id)
        self.call_id = call_id
        self.where = where

    def __str__(self) -> str:
        return f"call {self.call_id!r} is not {self.where}"


class ActionMismatchError(SchedulerError, RuntimeError):
    """A completion was reported for an action the scheduler did not hand out (or twice)."""

    def __init__(self, expected: object, got: object) -> None:
        super().__init__(f"expected completion of {expected!r}, got {got!r}")
        self.expected = expected
        self.got = got


class SchedulerBusyError(SchedulerError, RuntimeError):
    """`next_action` was called while the previous action is still executing."""

    def __init__(self, inflight: object) -> None:
        super().__init__(f"action still in flight: {inflight!r}")
        self.inflight = inflight


class ConfigError(SchedulerError, ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"scheduler config {field}: {problem}")
        self.field = field
        self.problem = problem
