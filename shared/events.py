"""Events on talaria.evt.> (JetStream): tagged msgspec Structs (`"type"` field), so one
stream consumer decodes any of them with `EVENT_DECODER`. New fields always get defaults.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from talaria.shared.wire import (
    DecisionAction, KvSource, LeaseOutcome, ModelState, Name, SessionOrigin, Subject, SwitchPath, Token,
)


class CallSubmitted(Struct, frozen=True, tag="call.submitted"):
    call_id: Token
    session_id: Name
    model: Name
    prompt_ids: list[int]
    block_hashes: list[int]
    max_tokens: int
    submitted_at: float
    reply_to: Subject | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stream: bool = False
    api: str = "nats"
    # When the client stops waiting (epoch s; 0 = never): work still queued or running after
    # it is dropped by the agent, recorded as a failed call (nobody would read the answer).
    deadline_at: float = 0.0
    tenant: str = ""  # the API key's tenant; "" when the gateway has no keys
    kv_scope: str = ""  # salt of block_hashes: KV prefixes are reused only within one scope
    # A token count without materialised ids: the simulator's calls, and the stream's copy of a
    # routed call (its ids stay in the CallSubmitted); 0 = use ids.
    prompt_tokens_hint: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    session_origin: SessionOrigin = "named"

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_tokens_hint if self.prompt_tokens_hint > 0 else len(self.prompt_ids)


class DispatchFence(Struct, frozen=True):
    """Which claim a dispatch was decided under: the router, the session's partition, and the
    revision of the ownership bucket at which that router claimed it (its epoch; a later claim
    by anyone has a higher one). An agent refuses a dispatch whose partition another router
    has claimed since: it comes from a router that stalled past its claim (services/router/ownership.py)."""

    router_id: Token
    partition: int
    epoch: int


class CallRouted(Struct, frozen=True, tag="call.routed"):
    call: CallSubmitted
    call_index: int
    instance_id: Token
    policy: str
    routed_at: float
    lease: LeaseOutcome = "none"
    # The agent process the call was placed on (its snapshot's incarnation; "" = any). A
    # restarted agent drops calls placed on its predecessor: the router has failed them.
    incarnation: str = ""
    # On the stream, `call` comes without its prompt ids: they are stored once, in the
    # CallSubmitted at this stream sequence (0: `call` is complete, as on the fast dispatch copy).
    submitted_seq: int = 0
    # Output tokens the agent reserves KV for: the router's online estimate (a high quantile
    # of what the session and model produced, <= max_tokens; services/router/output_estimate.py).
    # 0 = max_tokens (a router that does not estimate).
    kv_output_tokens: int = 0
    fence: DispatchFence | None = None  # None: unfenced (a router without partition claims)
    # The instance holding the session's KV pages, to pull the prefix from before prefill
    # (the router priced migration cheaper than recompute; issue 40). "": none.
    kv_from: str = ""
    kv_from_address: str = ""  # its page server (host:port, its snapshot's page_address)

    def by_reference(self, submitted_seq: int) -> "CallRouted":
        """The stream's copy: the prompt ids stay in the CallSubmitted at `submitted_seq`."""
        call = self.call
        slim = msgspec.structs.replace(call, prompt_ids=[], prompt_tokens_hint=call.prompt_tokens)
        return msgspec.structs.replace(self, call=slim, submitted_seq=submitted_seq)


class DispatchRefused(Struct, frozen=True, tag="dispatch.refused"):
    """An agent did not run a dispatch: its router's claim on the partition was superseded
    (`holder` claimed it at `holder_epoch` > `fence.epoch`). The call is the new owner's."""

    call_id: Token
    session_id: Name
    instance_id: Token
    fence: DispatchFence
    holder: Token
    holder_epoch: int
    at: float


class CallStarted(Struct, frozen=True, tag="call.started"):
    call_id: Token
    session_id: Name
    instance_id: Token
    started_at: float


class CallCompleted(Struct, frozen=True, tag="call.completed"):
    call_id: Token
    session_id: Name
    call_index: int
    model: Name
    instance_id: Token
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    submitted_at: float
    started_at: float
    first_token_at: float
    completed_at: float
    cached_tokens: int = 0
    kv_source: KvSource = "none"
    queue_s: float = 0.0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    slot_wait_s: float = 0.0
    kv_tokens: int = 0
    model_opened: bool = False
    trace_id: str = ""
    migrated_bytes: int = 0  # kv_source "migrated": the page bytes pulled from another instance
    migrate_s: float = 0.0  # ... and the seconds the pull took


class CallFailed(Struct, frozen=True, tag="call.failed"):
    call_id: Token
    session_id: Name
    model: Name
    reason: str
    stage: str  # gateway | router | agent
    at: float
    status: int = 500
    instance_id: Token | None = None
    call_index: int | None = None
    reply_to: str | None = None  # set when whoever folds it owes the client this answer


class LeaseIssued(Struct, frozen=True, tag="lease.issued"):
    session_id: Name
    model: Name
    instance_id: Token
    call_id: Token
    issued_at: float
    expires_at: float
    kv_tokens: int = 0

    def live(self, now: float) -> bool:
        # Expiry is exclusive: a lease issued at t with timeout tau is dead at exactly t + tau.
        return now < self.expires_at


class LeaseConsumed(Struct, frozen=True, tag="lease.consumed"):
    session_id: Name
    model: Name
    instance_id: Token
    call_id: Token
    at: float


class LeaseDiscarded(Struct, frozen=True, tag="lease.discarded"):
    session_id: Name
    model: Name
    instance_id: Token
    call_id: Token
    reason: str
    at: float


class LeaseExpired(Struct, frozen=True, tag="lease.expired"):
    session_id: Name
    model: Name
    instance_id: Token
    at: float


class CandidateCost(Struct, frozen=True):
    """One instance the policy considered, with its cost terms in seconds."""

    instance_id: Token
    total_s: float
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    kv_recovery_s: float = 0.0
    activation_s: float = 0.0
    placement_s: float = 0.0  # the session-placement term (ours): what its later calls pay here
    kv_state: KvSource = "none"
    model_state: ModelState = "absent"
    feasible: bool = True
    reason: str = ""
    # Soft reservations: live leases of other sessions here, each charged as a return's work.
    # Kept apart from queue_s (the work queued now) so an audit compares queue_s with the
    # queue the call met; total_s counts both.
    reserved_s: float = 0.0
    kv_from: str = ""  # kv_state "migrated": the instance whose pages the prefix is pulled from


DEADLINE_UNREACHABLE = 413  # a call that cannot finish by its deadline even on an idle instance


class RoutingDecision(Struct, frozen=True, tag="decision"):
    call_id: Token
    session_id: Name
    call_index: int
    model: Name
    policy: str
    action: DecisionAction
    decided_at: float
    chosen: Token | None = None
    lease_outcome: LeaseOutcome = "none"
    lease_instance: Token | None = None
    discard_reason: str | None = None
    candidates: list[CandidateCost] = []
    retry_after_s: float | None = None
    model_opened: bool = False
    avoidable_cold_open: bool = False
    expected_kv: KvSource = "none"  # where the router expects the chosen instance to find r's prefix
    decision_us: float = 0.0
    reason: Annotated[str, Meta(max_length=2048)] = ""  # why: a rejection names the bound it hit
    # A rejection's HTTP status: 503 (retry later) unless retrying cannot help, e.g. 413 for
    # a call whose own work, on an idle instance, ends past its deadline.
    status: int = 503


class InstanceLost(Struct, frozen=True, tag="instance.lost"):
    """The router declared an agent process gone (heartbeats stopped, or a new incarnation
    replaced it). Its in-flight `calls` were failed with a retryable 503 in the same step."""

    instance_id: str
    incarnation: str
    reason: str
    at: float
    calls: list[str] = []


class SwitchDone(Struct, frozen=True, tag="switch.done"):
    instance_id: Token
    from_model: Name | None
    to_model: Name
    path: SwitchPath
    total_s: float
    at: float
    phases: dict[str, float] = {}
    bytes_staged: int = 0
    bytes_uncovered: int = 0


class RoundSummary(Struct, frozen=True, tag="round.summary"):
    instance_id: Token
    round_index: int
    wall_s: float
    active_s: float
    switch_s: float
    at: float
    slots: list[str] = []
    sp_admitted: int = 0
    sp_parked: int = 0
    deadline_risk: int = 0


class PoolPinned(Struct, frozen=True, tag="pool.pinned"):
    """The router's hot-pool decision (services/router/hot_pools.py): `instance_id` keeps
    `model` resident from now on, a hot instance of it (None: a cold instance, it time-shares
    its catalogue). Its agent repins (RoundScheduler.repin: it finishes the calls it holds
    first) and reports `pinned_model` in its snapshots."""

    instance_id: str
    model: str | None
    previous: str | None
    at: float
    reason: str = ""


class KvPushRequested(Struct, frozen=True, tag="kv.push"):
    """A drain moves a session's KV ahead of its next call (issue 40, router_core.RouterCore.drain):
    the agent `instance_id` (where the session's next call would land) pulls the session's
    host pages for `model` from `holder` (the drained instance, its page server at
    `holder_address`) into its own host registry, then reports `KvPushed`."""

    instance_id: Token
    session_id: Token
    model: Name
    holder: Token
    holder_address: str
    at: float
    attempt: int = 1


class KvPushed(Struct, frozen=True, tag="kv.pushed"):
    """The agent `instance_id` pulled a session's pages as a drain asked: `pages` of the
    `listed` pages the holder had (all listed arrived: moved; fewer: its context is lost
    in part, `why` says why; none listed: nothing to move, unless `why` says the listing
    failed, e.g. the holder died: lost)."""

    instance_id: Token
    session_id: Token
    model: Name
    holder: Token
    at: float
    listed: int = 0
    pages: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    transport: str = "tcp"
    why: str = ""


Event = Union[
    CallSubmitted,
    CallRouted,
    CallStarted,
    CallCompleted,
    CallFailed,
    LeaseIssued,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    RoutingDecision,
    SwitchDone,
    RoundSummary,
    PoolPinned,
    InstanceLost,
    DispatchRefused,
    KvPushRequested,
    KvPushed,
]


EVENT_DECODER = msgspec.json.Decoder(Event)
SUBMITTED_DECODER = msgspec.json.Decoder(CallSubmitted)
ROUTED_DECODER = msgspec.json.Decoder(CallRouted)
