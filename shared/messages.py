"""Wire messages: msgspec Structs, JSON on the wire, one Decoder per subject.

Schema evolution rule (msgspec docs): new fields always get defaults, so older
producers stay decodable. Events are tagged (`"type"` field) so one stream
consumer can decode any of them with `EVENT_DECODER`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta, Struct

# The one definition of each KV vocabulary (the engine, scheduler and router import these).
KvState = Literal["device", "host", "none"]  # where a session's KV sits now
KvSource = Literal["device", "host", "recompute", "none"]  # where a call's prefix came from
# The other closed vocabularies on the wire: a value outside them is a decode error, never a
# string some consumer silently misreads.
LeaseOutcome = Literal["consumed", "discarded", "none"]
DecisionAction = Literal["route", "reject"]
ModelState = Literal["active", "resident", "staged", "absent"]
SwitchPath = Literal["d2d_full", "d2d_partial", "host_only", "cold"]
Pool = Literal["hot", "cold"]

# Ids travel into Postgres rows and NATS subjects: every decoder below refuses ones that
# are empty, unbounded or carry control characters (a NUL once froze the projection).
_CONTROLS = r"\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff"
MAX_NAME_LEN = 256
MAX_TOKEN_LEN = 128
# Session ids, model names: printable text.
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_LEN, pattern=rf"^[^{_CONTROLS}]+\Z")]
# Call and instance ids also name NATS subjects: one subject token each.
Token = Annotated[str, Meta(min_length=1, max_length=MAX_TOKEN_LEN, pattern=rf"^[^{_CONTROLS} .*>]+\Z")]
# A reply subject: tokens joined by dots.
Subject = Annotated[str, Meta(min_length=1, max_length=512, pattern=rf"^[^{_CONTROLS} *>]+\Z")]


class ToolCallMsg(Struct, frozen=True, forbid_unknown_fields=False):
    """An assistant's earlier tool call: `arguments` is a JSON object as text."""

    name: str
    arguments: str = "{}"
    id: str = ""


class ChatMessage(Struct, frozen=True, forbid_unknown_fields=False):
    role: str
    content: str
    tool_calls: list[ToolCallMsg] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns
    name: str | None = None


class ToolSpec(Struct, frozen=True, forbid_unknown_fields=False):
    """A function the model may call; `parameters` is its JSON schema."""

    name: str
    description: str = ""
    parameters: dict = {}


# --------------------------------------------------------------------------------------
# Agent-runtime API on talaria.api.call (request/reply)
# --------------------------------------------------------------------------------------


class CallRequest(Struct, frozen=True):
    """One model call. Exactly one of `messages` (chat) or `prompt` (completion).

    Set `call_id` yourself to stream: tokens arrive on `talaria.tokens.<call_id>`
    and you must subscribe before sending the request.
    """

    model: Name
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    session_id: Name | None = None
    call_id: Token | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stream: bool = False
    tools: list[ToolSpec] | None = None  # rendered by the model's chat template
    tool_choice: str = "auto"  # auto | required | none | tool (stated in the prompt, not enforced)
    forced_tool: str | None = None  # the tool's name when tool_choice is "tool"
    api_key: str | None = None  # required when the gateway has API keys configured
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit (limits.py bounds)
    logprobs: bool = False  # return each generated token's log-probability
    top_logprobs: int = 0  # and that many most likely alternatives (needs `logprobs`)


class TokenLogprob(Struct, frozen=True, array_like=True):
    """One generated token's log-probability and its `top_logprobs` alternatives (ids and
    logprobs, most likely first). Array-like and rounded: a call carries one per token."""

    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Usage(Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0


class Timings(Struct, frozen=True):
    queue_s: float = 0.0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    slot_wait_s: float = 0.0
    total_s: float = 0.0


class CallResult(Struct, frozen=True, tag="result"):
    call_id: Token
    session_id: Name
    call_index: int
    model: Name
    instance_id: Token
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    kv_source: KvSource = "none"
    stop_sequence: str | None = None  # which of the call's `stop` strings ended it
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the call asked


class ErrorReply(Struct, frozen=True, tag="error"):
    """Error answer, shaped so the gateway can map it 1:1 onto an HTTP status."""

    status: int
    code: str
    message: str
    param: str | None = None
    retry_after_s: float | None = None
    call_id: Token | None = None


Reply = Union[CallResult, ErrorReply]

# A call's client went away or asked to stop (nginx's "client closed request"). A CallFailed
# with this status is recorded with outcome `cancelled`, not `failed`.
CANCELLED_STATUS = 499


class CancelCall(Struct, frozen=True):
    """Abort `call_id` wherever it is: its agent stops it, frees its slot and KV, and
    records it as cancelled. A cancel for a call not yet delivered is remembered.

    Clients send it (with their `api_key`) on `talaria.api.cancel` to the gateway, which
    stamps the key's `tenant` and forwards it to the agents on `talaria.cancel`; an agent
    cancels only a call of that tenant, so knowing a call id is not enough."""

    call_id: Token
    reason: Annotated[str, Meta(max_length=1024)] = "cancelled by the client"
    api_key: str | None = None
    tenant: str = ""


class TokenChunk(Struct, frozen=True):
    call_id: Token
    index: int
    text: str
    done: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # the tokens generated since the last chunk, when asked


# --------------------------------------------------------------------------------------
# Events on talaria.evt.> (JetStream)
# --------------------------------------------------------------------------------------


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

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_tokens_hint if self.prompt_tokens_hint > 0 else len(self.prompt_ids)


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

    def by_reference(self, submitted_seq: int) -> "CallRouted":
        """The stream's copy: the prompt ids stay in the CallSubmitted at `submitted_seq`."""
        call = self.call
        slim = msgspec.structs.replace(call, prompt_ids=[], prompt_tokens_hint=call.prompt_tokens)
        return msgspec.structs.replace(self, call=slim, submitted_seq=submitted_seq)


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
    placement_s: float = 0.0  # first call of a session only: the session-placement term (ours)
    kv_state: KvSource = "none"
    model_state: ModelState = "absent"
    feasible: bool = True
    reason: str = ""
    # Soft reservations: live leases of other sessions here, each charged as a return's work.
    # Kept apart from queue_s (the work queued now) so an audit compares queue_s with the
    # queue the call met; total_s counts both.
    reserved_s: float = 0.0


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
    InstanceLost,
]


# --------------------------------------------------------------------------------------
# Instance telemetry snapshots on talaria.telemetry.<instance_id>
# --------------------------------------------------------------------------------------


class ModelResidency(Struct, frozen=True):
    model: Name
    state: ModelState
    switch_cost_s: float = 0.0
    open_cost_s: float = 0.0
    weight_bytes: int = 0
    context_length: int = 0


class SessionKv(Struct, frozen=True):
    session_id: Name
    model: Name
    state: KvState
    kv_tokens: int = 0


class InstanceSnapshot(Struct, frozen=True):
    instance_id: Token
    version: int
    at: float
    pool: Pool = "cold"
    models: list[ModelResidency] = []
    active_model: Name | None = None
    sessions: list[SessionKv] = []
    queued: dict[Name, int] = {}
    queued_tokens: int = 0
    running: int = 0
    round_remaining_s: float = 0.0
    deadline_risk: int = 0
    kv_capacity_tokens: int = 0
    kv_used_tokens: int = 0
    # Of kv_used_tokens, what running calls hold or reserved; the rest is idle sessions' KV,
    # which the agent evicts (to the host registry) on demand. -1: not reported.
    kv_pinned_tokens: int = -1
    staging_free_bytes: int = 0
    hbm_bytes: int = 0
    hbm_used_bytes: int = 0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    restore_tok_s: float = 0.0
    switch_s: float = 0.0
    heartbeat_s: float = 0.5
    # Random per agent process: a new one means a restart, whose snapshots replace the old
    # view at once whatever their `version` (which restarts at 1).
    incarnation: str = ""
    # False while the agent's watchdog sees an engine step stuck: the router stops choosing it.
    healthy: bool = True
    unhealthy_reason: str = ""


# --------------------------------------------------------------------------------------
# Codecs: one encoder, one decoder per subject
# --------------------------------------------------------------------------------------

ENCODER = msgspec.json.Encoder()
CALL_REQUEST_DECODER = msgspec.json.Decoder(CallRequest)
REPLY_DECODER = msgspec.json.Decoder(Reply)
TOKEN_DECODER = msgspec.json.Decoder(TokenChunk)
EVENT_DECODER = msgspec.json.Decoder(Event)
SUBMITTED_DECODER = msgspec.json.Decoder(CallSubmitted)
ROUTED_DECODER = msgspec.json.Decoder(CallRouted)
SNAPSHOT_DECODER = msgspec.json.Decoder(InstanceSnapshot)
CANCEL_DECODER = msgspec.json.Decoder(CancelCall)


def encode(message: Struct) -> bytes:
    return ENCODER.encode(message)


def replace(message: Struct, **changes) -> Struct:
    return msgspec.structs.replace(message, **changes)



class ServiceHeartbeat(Struct, frozen=True):
    """Liveness of router and telemetry on talaria.health.<service> (agents send snapshots)."""

    service: Name
    at: float
    detail: dict[str, str] = {}


HEARTBEAT_DECODER = msgspec.json.Decoder(ServiceHeartbeat)
