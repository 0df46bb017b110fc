"""Idempotency keys, the pure part: the claim record, what a request with a claimed key does
(`decide`), the request's fingerprint and key, and the subjects a keyed call lives on. The
protocol over JetStream and core NATS is in idempotency.py."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from enum import Enum

import msgspec

from talaria.services.gateway.validation import bad
from talaria.shared.subjects import Deployment
from talaria.shared.bus import DUPLICATE_WINDOW_S
from talaria.shared.events import CallSubmitted
from talaria.shared.messages import CallResult, ErrorReply, Reply
from talaria.shared.wire import MAX_IDEMPOTENCY_KEY_LEN

KEY_HEADER = "Idempotency-Key"  # OpenAI's spelling (its SDK's agents endpoints) and the IETF draft's
KEY_PATTERN = re.compile(rf"[\x20-\x7e]{{1,{MAX_IDEMPOTENCY_KEY_LEN}}}")
ANONYMOUS_SESSION = re.compile(r"(?:^|:)anon-[0-9a-f]{32}\Z")  # session_ids.anonymous_id makes these
# A young claim may not have its submission published yet (its gateway died in between):
# an attaching retry re-publishes it under the same message id. That is a no-op only inside
# JetStream's duplicate window; half of it leaves the other half for clock skew between gateways.
REPUBLISH_WITHIN_S = DUPLICATE_WINDOW_S / 2
ORPHANED = "no client waiting for it"  # the reason of the cancel sent for a call nobody waits for


class IdempotencyRecord(msgspec.Struct, frozen=True):
    """The claim on a key: read only by gateways (the stream is theirs)."""

    call_id: str
    fingerprint: str
    deadline_at: float  # the call's own: past it, it can no longer complete
    created_at: float
    attempt: int = 0


class KeyDecision(Enum):
    MISMATCH = "mismatch"  # a different request under the same key: 422
    REPLAY = "replay"  # the call completed: its stored result
    TAKE_OVER = "take_over"  # the attempt failed: run a new one under the key
    ATTACH = "attach"  # running: wait for its outcome
    ATTACH_REPUBLISH = "attach_republish"  # running, or its submission lost with its gateway


def decide(record: IdempotencyRecord, fingerprint: str, outcome: Reply | None, now: float) -> KeyDecision:
    """What a request with a claimed key does. Pure: (claim, this request, stored answer, now)."""
    if record.fingerprint != fingerprint:
        return KeyDecision.MISMATCH
    if isinstance(outcome, CallResult):
        return KeyDecision.REPLAY
    if outcome is not None or now >= record.deadline_at:
        # An error reply, or no answer by the deadline (an agent finishing later records it
        # failed and answers 504): either way that attempt did not and will not complete.
        return KeyDecision.TAKE_OVER
    if now - record.created_at < REPUBLISH_WITHIN_S:
        return KeyDecision.ATTACH_REPUBLISH
    return KeyDecision.ATTACH


def check_key(value: str) -> str:
    if not KEY_PATTERN.fullmatch(value):
        raise bad(f"`{KEY_HEADER}` must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} printable ASCII characters",
                  KEY_HEADER, "invalid_idempotency_key")
    return value


def key_from(headers: Mapping[str, str]) -> str | None:
    """The request's key (a case-insensitive header), checked; None when it sent none."""
    value = headers.get(KEY_HEADER)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == KEY_HEADER.lower()), None)
    return None if value is None else check_key(value)


def fingerprint(call: CallSubmitted) -> str:
    """What the client asked for, not what the gateway stamped: ids, times and the delivery form
    (`stream`) are left out, and so is a session the gateway made up for a call without one."""
    session = "" if ANONYMOUS_SESSION.search(call.session_id) else call.session_id
    asked = (call.api, call.model, session, call.prompt_ids, call.max_tokens, call.temperature, call.top_p,
             call.seed, call.stop, sorted((call.logit_bias or {}).items()), call.logprobs, call.top_logprobs)
    return hashlib.sha256(msgspec.json.encode(asked)).hexdigest()


def key_subject(deployment: Deployment, tenant: str, key: str) -> str:
    digest = hashlib.sha256(f"{tenant}\n{key}".encode()).hexdigest()  # tenant names have no newline
    return f"{deployment.idempotency_keys}.{digest}"


TENANT_TAG = 16  # hex digits of sha256(tenant) before a kept reply's call id: `<tag>-<call_id>`


def _scoped(tenant: str | None, call_id: str) -> str:
    # Clients may choose call ids: one tenant's id must never name another tenant's kept answer.
    return f"{hashlib.sha256((tenant or '').encode()).hexdigest()[:TENANT_TAG]}-{call_id}"


def reply_call_id(subject: str) -> str:
    """The call id a reply subject (a gateway inbox's or a kept one) answers."""
    token = subject.rsplit(".", 1)[-1]
    return token[TENANT_TAG + 1:] if is_outcome_subject(subject) else token


def outcome_subject(deployment: Deployment, tenant: str | None, call_id: str) -> str:
    return f"{deployment.idempotent_replies}.{_scoped(tenant, call_id)}"


def is_outcome_subject(subject: str | None) -> bool:
    """A kept reply's subject, `<deployment>.reply.gateway.idem.<t>-<call>`, of any deployment."""
    return bool(subject) and subject.split(".")[1:4] == Deployment().idempotent_replies.split(".")[1:]


def waiting_subject(deployment: Deployment, tenant: str | None, call_id: str) -> str:
    return f"{deployment.idempotent_waiting}.{_scoped(tenant, call_id)}"


def orphan_cancelled(reply: Reply) -> bool:
    """The agent's answer to a call cancelled because nobody was waiting for it."""
    return isinstance(reply, ErrorReply) and reply.code == "cancelled" and reply.message.endswith(ORPHANED)
