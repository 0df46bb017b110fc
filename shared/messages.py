"""The agent-runtime call API on talaria.api.call (request/reply), its token stream on
talaria.tokens.<call_id> and cancellation on talaria.api.cancel: what a client sends and
receives (msgspec Structs, JSON; one decoder per subject).

The stream's events are in events.py, instance telemetry in snapshots.py, the id types,
vocabularies and `encode` in wire.py.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from talaria.shared.wire import IdempotencyKey, KvSource, Name, Token


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
    # Send the same key with every retry of one call: a retry attaches to the original (its
    # stored answer, or its outcome when it finishes) instead of running it again.
    idempotency_key: IdempotencyKey | None = None


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


CALL_REQUEST_DECODER = msgspec.json.Decoder(CallRequest)
REPLY_DECODER = msgspec.json.Decoder(Reply)
TOKEN_DECODER = msgspec.json.Decoder(TokenChunk)
CANCEL_DECODER = msgspec.json.Decoder(CancelCall)


class DrainRequest(Struct, frozen=True):
    """`talaria drain`: take an instance out of service (admin user only, docs/operating.md)."""

    instance_id: Token


class DrainStatus(Struct, frozen=True):
    instance_id: str
    drained: bool = False  # nothing runs, is queued or was placed there, no session's KV is left to move
    calls: int = 0  # calls still running, queued or placed there
    sessions: int = 0  # sessions whose KV is still to move off it (a push asked for or not yet)
    moved: int = 0  # sessions whose KV a push moved to another instance
    lost: int = 0  # sessions whose KV no push could move whole (their next call recomputes what did not arrive)
    why_lost: str = ""  # the first reason one was lost
    error: str = ""  # the request was refused (one line)


DRAIN_DECODER = msgspec.json.Decoder(DrainRequest)
DRAIN_STATUS_DECODER = msgspec.json.Decoder(DrainStatus)
