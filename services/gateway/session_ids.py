"""Which session a call belongs to.

Agents identify sessions in different ways; we accept the common ones, in this order:
our own `X-Session-Id`, the headers coding agents send (Codex CLI sends `session_id`,
Claude Code `X-Claude-Code-Session-Id`; LiteLLM and others use `X-Session-Affinity`
or a conversation id), then the OpenAI body's `user` field. A call without any of
these gets the session it continues, inferred from its prompt (session_inference.py), or
a new one.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

SESSION_HEADERS = (
    "x-session-id",
    "session-id",
    "session_id",
    "x-claude-code-session-id",
    "x-session-affinity",
    "x-conversation-id",
    "conversation_id",
    "x-request-session-id",
)

MAX_SESSION_ID_LEN = 256


class InvalidSessionId(ValueError):
    def __init__(self, value: str, reason: str) -> None:
        super().__init__(f"invalid session id {value[:40]!r}: {reason}")
        self.reason = reason


def session_id_from(headers: Mapping[str, str], user: str | None = None) -> str:
    return named_session_id(headers, user) or anonymous_id()


def named_session_id(headers: Mapping[str, str], user: str | None = None) -> str | None:
    """The session the client named, or None (the gateway then infers it: session_inference.py)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    for name in SESSION_HEADERS:
        value = lowered.get(name)
        if value:
            return check(value.strip())
    if user:
        return check(user.strip())
    return None


def anonymous_id() -> str:
    """A session id of the gateway's own (idempotency_rules.ANONYMOUS_SESSION matches it)."""
    return f"anon-{uuid.uuid4().hex}"


def check(value: str) -> str:
    if not value:
        raise InvalidSessionId(value, "empty")
    if len(value) > MAX_SESSION_ID_LEN:
        raise InvalidSessionId(value, f"longer than {MAX_SESSION_ID_LEN} characters")
    if not value.isprintable():
        raise InvalidSessionId(value, "contains control characters")
    return value
