"""Input rules every gateway API applies before a call reaches the bus (issue 15's poison
inputs): bounded sampling parameters and stop strings, printable bounded ids, JSON that
cannot blow the decoder's stack, and a size that fits one NATS message. Each failure is a
permanent 4xx naming the field, never a 5xx or a retryable 503.
"""

from __future__ import annotations

import msgspec

from talaria.services.gateway.error_bodies import validation_error
from talaria.shared import limits
from talaria.shared.events import CallSubmitted
from talaria.shared.messages import CallRequest, ErrorReply
from talaria.shared.wire import MAX_IDEMPOTENCY_KEY_LEN, MAX_NAME_LEN, MAX_TOKEN_LEN, encode


ID_FIELDS = ("call_id", "session_id", "model")  # the `Name`/`Token` fields (shared/wire.py)


class RequestError(Exception):
    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(reply.message)
        self.reply = reply


def bad(message: str, param: str | None = None, code: str = "invalid_request") -> RequestError:
    return RequestError(ErrorReply(400, code, message, param=param))


def decode_bounded(decoder: msgspec.json.Decoder, data: bytes):
    """Decode, turning JSON nested past the decoder's depth into a RequestError (400);
    msgspec's own errors propagate for the API to word them."""
    try:
        return decoder.decode(data)
    except RecursionError:  # msgspec recurses per nesting level, even inside ignored fields
        raise bad("request body is nested too deeply", code="invalid_json") from None


def decode(decoder: msgspec.json.Decoder, data: bytes):
    """Decode a request body; errors become a RequestError (400) naming the field."""
    try:
        return decode_bounded(decoder, data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RequestError(describe(exc)) from None


def describe(exc: msgspec.ValidationError | msgspec.DecodeError) -> ErrorReply:
    reply = validation_error(exc)
    if reply.param == "idempotency_key":
        return ErrorReply(400, "invalid_idempotency_key", "`idempotency_key` must be 1 to "
                          f"{MAX_IDEMPOTENCY_KEY_LEN} printable ASCII characters", param=reply.param)
    if reply.param in ID_FIELDS and ("matching regex" in reply.message or "of length" in reply.message):
        limit = MAX_TOKEN_LEN if reply.param == "call_id" else MAX_NAME_LEN
        what = "; no '.', '*', '>' or spaces" if reply.param == "call_id" else ""
        reply = ErrorReply(400, "invalid_request", f"`{reply.param}` must be 1 to {limit} printable characters "
                           f"without control characters{what}", param=reply.param)
    return reply


def check_request(req: CallRequest, vocab_size: int | None = None) -> None:
    """Sampling parameters, stop strings and logit_bias/logprobs within the API's bounds
    (shared/limits.py); `logit_bias` ids inside `vocab_size`."""
    problem = limits.call_problem(req, vocab_size)
    if problem is not None:
        field, message = problem
        raise bad(message, field)


def check_size(call: CallSubmitted, max_payload: int, data: bytes | None = None) -> ErrorReply | None:
    """A call must fit one bus message (it travels whole to the router and the agent).
    `data`: the call already encoded (then it is not encoded again)."""
    size = len(encode(call) if data is None else data)
    if max_payload and size > max_payload:
        return ErrorReply(413, "request_too_large", f"the call encodes to {size} bytes; the bus carries at most "
                          f"{max_payload} per message (shorten the prompt or `stop`)", call_id=call.call_id)
    return None
