"""The call record (`AgentCall`) and the agent's one table of them (`CallTable`): every call
by id, and the scheduler's queued and running calls by model as ordered sets of the same
records (insertion order: iterating `queued` is FCFS by submission, `running` admission
order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from talaria.services.instance_agent.scheduler.types import (
    DuplicateCallError,
    InvalidWorkError,
    ModelNotServedError,
    UnknownCallError,
)
from talaria.services.instance_agent.scheduler.types import KV_STATES, KvState

if TYPE_CHECKING:  # the live executor's part; the scheduler never reads it (the simulator leaves it None)
    from talaria.services.instance_agent.call_transport import CallTransport


class Phase(Enum):
    QUEUED = "queued"  # accepted, its prefill not issued yet
    RUNNING = "running"  # its prefill was issued (chunks, then decodes)
    CLOSING = "closing"  # its outcome is being published: a copy arriving now is attached to it
    FINISHED = "finished"  # its outcome is stored: a late copy is acked, never run
    CANCELLED = "cancelled"  # cancelled before it arrived: refused when it does


LIVE = (Phase.QUEUED, Phase.RUNNING)


@dataclass(slots=True, eq=False)
class AgentCall:
    """One call on this instance, from acceptance (or an early cancel) to its stored outcome:
    the one record of it, in the agent's table (`AgentCore.calls`, a `CallTable`). It is what
    the scheduler is submitted. Three owners, one section each: what was routed here (set at
    accept), the core's phase and timeline (agent_core.py), the scheduler's state of it; what
    the executor owns (message, span, engine handle, the watchdog's progress) is its
    `transport`, a `CallTransport` (call_transport.py) the core and scheduler never read. A
    record is its identity (eq=False): two calls are never equal, and records can be set members."""

    call_id: str
    session_id: str
    model: str
    call_index: int = 0  # 0: a session's first call; later ones are continuations (SP may admit them)
    submitted_at: float = 0.0  # the caller's submission: queue and TTFT count from here
    # -- what was routed here (checked by `check_routed` when submitted) ----------------------
    # `reusable_tokens` is the prefix of `prompt_tokens` whose KV this instance can reuse
    # (device-resident or host-restorable per `kv_state`).
    prompt_tokens: int = 0
    reusable_tokens: int = 0
    kv_state: KvState = "none"
    max_tokens: int = 1
    # Output tokens its KV is admitted for: the router's estimate (CallRouted.kv_output_tokens,
    # <= max_tokens, a cap); 0 = max_tokens.
    kv_output_tokens: int = 0
    # When the scheduler's slot wait starts (`CallAdmitted.slot_wait_s`), on the driver's clock.
    arrived_at: float = 0.0
    tenant: str = ""  # whose call it is: only that tenant's cancel stops it
    # -- the core's (agent_core.py) -------------------------------------------------------------
    phase: Phase = Phase.QUEUED
    started_at: float | None = None  # its prefill was issued
    first_token_at: float | None = None
    slot_wait_s: float = 0.0
    opened_model: bool = False  # its slot began with a switch to its model
    cancel_reason: str = ""  # CANCELLED: why (the refusal names it when the call arrives)
    # -- the executor's: the live runner's (None in the simulator) ------------------------------
    transport: CallTransport | None = None
    # -- the scheduler's (set by CallTable; 0 / None for a call it never held) ---------------
    seq: int = 0  # submission order; a call with seq > a slot's P mark arrived after P
    generated: int = 0  # tokens produced so far (the prefill's first token counts)
    via: str | None = None  # P | SP | hot, once admitted
    parked: bool = False  # already counted once as an SP-parked return
    prefill_left: int = 0  # chunked prefill: prompt tokens still to compute (an estimate)
    first_chunk_at: float | None = None  # when its first prefill chunk was issued
    # (when, prompt tokens left then) its prefill's pace is measured from (call_drops.py):
    # the end of the last chunk it waited through behind another call's; None: its first chunk
    paced_from: tuple[float, int] | None = None
    cost_memo: tuple | None = field(default=None, repr=False)  # WorkPricing.cost cache (until its KV changes)

    @property
    def live(self) -> bool:
        return self.phase in LIVE

    @property
    def continuation(self) -> bool:
        """A returning call of a session seen before: only these may enter a slot through SP."""
        return self.call_index > 0

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def prefilling(self) -> bool:
        """Admitted, but its prompt is not computed yet (chunked prefill in progress)."""
        return self.via is not None and self.generated == 0

    @property
    def done_by_length(self) -> bool:
        return self.generated >= self.max_tokens


def check_routed(call: AgentCall) -> None:
    """Refuse a call whose routed work the scheduler cannot price."""
    if call.prompt_tokens < 1:
        raise InvalidWorkError(call.call_id, f"prompt_tokens={call.prompt_tokens} < 1")
    _check_kv(call.call_id, call.kv_state, call.reusable_tokens, call.prompt_tokens)
    if call.max_tokens < 1:
        raise InvalidWorkError(call.call_id, f"max_tokens={call.max_tokens} < 1")


def _check_kv(call_id: str, kv_state: KvState, reusable_tokens: int, prompt_tokens: int) -> None:
    if not 0 <= reusable_tokens <= prompt_tokens:
        raise InvalidWorkError(call_id, f"reusable_tokens={reusable_tokens} not in [0, prompt_tokens]")
    if kv_state not in KV_STATES:
        raise InvalidWorkError(call_id, f"kv_state={kv_state!r} not in {KV_STATES}")


OrderedCalls = dict[AgentCall, None]  # an ordered set of records (a record hashes by identity)


class CallTable(dict[str, AgentCall]):
    """The agent's one table of calls: every call by its id (`AgentCore.calls`, any phase),
    and, for the scheduler, the calls it holds by model in two ordered sets over the same
    records, `queued` (FCFS by submission) and `running` (admission order).

    Invariant: a call the scheduler holds is in exactly one of `queued[model]` or
    `running[model]` until it finishes or is aborted; its record stays in the table for
    whoever owns the table to end (the agent core) or keep (a scheduler driven on its own)."""

    def __init__(self, models: tuple[str, ...]) -> None:
        super().__init__()
        self.models = models
        self.queued: dict[str, OrderedCalls] = {m: {} for m in models}
        self.running: dict[str, OrderedCalls] = {m: {} for m in models}
        self._seq = 0
        self._live: dict[str, int] = {m: 0 for m in models}  # queued + running, per model
        self._n_active = 0  # models with a queued or running call

    @property
    def seq(self) -> int:
        """Sequence number of the latest submission."""
        return self._seq

    def holding(self, call_id: str) -> AgentCall | None:
        """The call's record if the scheduler holds it (queued or running), else None."""
        call = self.get(call_id)
        if call is None:
            return None
        queued = self.queued.get(call.model)
        return call if queued is not None and (call in queued or call in self.running[call.model]) else None

    def held(self, call_id: str) -> AgentCall:
        call = self.holding(call_id)
        if call is None:
            raise UnknownCallError(call_id, "known to the scheduler")
        return call

    def add(self, call: AgentCall) -> None:
        """Queue a call: its record joins the table (replacing an ended one of the same id)."""
        model = call.model
        if model not in self.queued:
            raise ModelNotServedError(model, self.models)
        if self.holding(call.call_id) is not None:
            raise DuplicateCallError(call.call_id)
        self._seq += 1
        call.seq = self._seq
        self[call.call_id] = call
        self.queued[model][call] = None
        live = self._live[model]
        self._live[model] = live + 1
        if not live:
            self._n_active += 1

    def start(self, call: AgentCall, via: str) -> None:
        """Move a queued call to running (its prefill has been issued)."""
        queued = self.queued[call.model]
        if call not in queued:
            raise UnknownCallError(call.call_id, "queued")
        del queued[call]
        self.running[call.model][call] = None
        call.via = via

    def remove(self, call: AgentCall) -> None:
        """The scheduler lets go of a call it holds (finished or aborted)."""
        model = call.model
        self.queued[model].pop(call, None)
        self.running[model].pop(call, None)
        live = self._live[model] - 1
        self._live[model] = live
        if not live:
            self._n_active -= 1

    def active(self, model: str) -> bool:
        return bool(self.queued[model]) or bool(self.running[model])

    def any_active_except(self, model: str) -> bool:
        """Whether a model other than `model` has a queued or running call (O(1))."""
        n = self._n_active
        return n > 1 or (n == 1 and not self._live[model])

    def any_active(self) -> bool:
        return self._n_active > 0

    def live(self, model: str) -> int:
        """Queued + running calls of `model`."""
        return self._live[model]

    def queued_any(self) -> bool:
        return any(self.queued.values())

    def running_ids(self, model: str) -> tuple[str, ...]:
        return tuple(call.call_id for call in self.running[model])

    def update_kv(self, session_id: str, model: str, kv_state: KvState, reusable_tokens: int | None) -> int:
        """Re-state the KV of a session's queued calls for `model`; returns how many changed."""
        changed = 0
        for call in self.queued.get(model, {}):
            if call.session_id != session_id:
                continue
            reuse = call.reusable_tokens if reusable_tokens is None else reusable_tokens
            reuse = 0 if kv_state == "none" else min(reuse, call.prompt_tokens)
            _check_kv(call.call_id, kv_state, reuse, call.prompt_tokens)
            call.kv_state, call.reusable_tokens = kv_state, reuse
            call.cost_memo = None  # priced anew
            changed += 1
        return changed
