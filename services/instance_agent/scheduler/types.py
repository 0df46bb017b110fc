"""Data the scheduler hands out (actions) and reports (events, view); what it takes in is the
call's record (`calls.AgentCall`).

Everything here is a frozen dataclass: the driver executes an action as it is, and the
audit log records events as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union, get_args

from talaria.shared.wire import KvState

KV_STATES: tuple[str, ...] = get_args(KvState)
Via = Literal["P", "SP", "hot"]


# ---- actions: what the executor does next ---------------------------------------------


@dataclass(frozen=True)
class SwitchModel:
    """Make `to_model` the device model. `staged=False` asks for the host-only (H2D) path."""

    from_model: str | None
    to_model: str
    staged: bool = True


@dataclass(frozen=True)
class Prefill:
    """Prefill (restoring reusable KV first) and emit each call's first token.

    `chunk_tokens` > 0 (chunked prefill): compute at most that many more prompt tokens of
    each call; a call whose prompt is then complete emits its first token, the others
    continue in a later Prefill listing them again (the executor reports which calls got
    their first token). 0: every call's whole prompt.

    `pass_tokens` > 0: at most that many tokens of each call per forward pass, the chunk a
    shared instance would allow (Eq. 4's slack), so a call that arrives while a long chunk
    runs alone waits at most one such pass before the driver ends the chunk. 0: the
    engine's own pass size.
    """

    call_ids: tuple[str, ...]
    session_prefill: bool = False
    model: str = ""
    chunk_tokens: int = 0
    pass_tokens: int = 0


@dataclass(frozen=True)
class Decode:
    """`steps` decode iterations for every listed call: one new token each per step.

    `steps` is 1 unless the driver asked for more (`next_action(now, max_decode_steps=k)`);
    the scheduler then picks steps up to the next boundary it cares about (a call reaching
    max_tokens, the end of protected decode, the slot's time budget, a pending SP retry).
    A driver that learns of a new submission mid-action may stop early and report the
    steps it ran (`on_decode_done(..., steps=j)`).
    """

    call_ids: tuple[str, ...]
    model: str = ""
    steps: int = 1


@dataclass(frozen=True)
class Idle:
    """Nothing to run. Call `next_action` again after the next `submit` (or at `until`)."""

    until: float | None = None


Action = Union[SwitchModel, Prefill, Decode, Idle]


# ---- events: what happened, for telemetry and the audit log ---------------------------


@dataclass(frozen=True)
class CallAdmitted:
    call_id: str
    model: str
    via: Via
    slot_wait_s: float  # from `arrived_at` to the admitting prefill's start
    kv_state: KvState  # as charged (host counts as none when HKVR is off)
    at: float


@dataclass(frozen=True)
class CallParked:
    """An SP-eligible return that did not fit the SP batch (or the slot closed first)."""

    call_id: str
    model: str
    reason: str  # sp_budget | sp_batch | max_batch | kv_budget | slot_closed
    at: float


@dataclass(frozen=True)
class CallFinished:
    call_id: str
    model: str
    tokens: int  # generated tokens, counted by the scheduler
    reason: str  # engine (EOS/stop reported by the executor) | length (max_tokens) | aborted
    at: float


@dataclass(frozen=True)
class DeadlineRisk:
    """The plan cannot meet a target; the work still runs, the shortfall is reported."""

    model: str | None
    reason: str  # round_over_budget | tpot_infeasible | prefill_shortfall | capacity | round_overrun
    predicted_s: float
    budget_s: float
    calls: int = 0  # calls left waiting because of it (prefill_shortfall, capacity)
    at: float = 0.0


@dataclass(frozen=True)
class SlotOpened:
    """The plan a slot starts with (Eq. 3-5); see `budget.plan_slot`."""

    model: str
    round_index: int
    protected_decode: int
    decode_step_s: float
    prefill_budget_s: float
    sp_budget_s: float
    predicted_round_s: float
    at: float


@dataclass(frozen=True)
class RoundEnded:
    round_index: int
    wall_s: float
    active_s: float
    switch_s: float
    slots: tuple[str, ...]
    sp_admitted: int
    sp_parked: int
    deadline_risk: int
    at: float = 0.0


SchedulerEvent = Union[
    CallAdmitted, CallParked, CallFinished, DeadlineRisk, SlotOpened, RoundEnded
]


@dataclass(frozen=True)
class SchedulerView:
    """Telemetry snapshot (maps onto `talaria.shared.snapshots.InstanceSnapshot`)."""

    pool: str
    active_model: str | None
    slot_model: str | None
    phase: str  # idle | switch | P | SP | D1 | D | Dfin
    round_index: int
    round_remaining_s: float
    queued: dict[str, int] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)
    queued_tokens: int = 0
    kv_used_bytes: int = 0
    deadline_risk: int = 0
    sp_admitted: int = 0
    sp_parked: int = 0
    switch_s: float = 0.0  # current estimate of the next switch (EWMA of measured)


# ---- errors: a driver bug or a misrouted call (bad input at the boundary), never an overload
# (overload is reported through deadline-risk events and counters). Each carries its data.

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
