"""The wire's building blocks: closed vocabularies, validated id types, the one encoder.

Every message module (messages.py: the call API; events.py: the stream; snapshots.py:
telemetry) builds on these. Schema evolution rule (msgspec docs): new fields always get
defaults, so older producers stay decodable; JSON on the wire.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

# The one definition of each KV vocabulary (the engine, scheduler and router import these).
KvState = Literal["device", "host", "none"]  # where a session's KV sits now
# where a call's prefix came from; "migrated": pulled from another instance's pages (issue 40)
KvSource = Literal["device", "host", "migrated", "recompute", "none"]
# How a call's session was known: the client named it, or the gateway inferred it from the
# prompt (services/gateway/session_inference.py): "pending" only until the gateway decides.
SessionOrigin = Literal["named", "pending", "new", "continued", "forked"]
# The other closed vocabularies on the wire: a value outside them is a decode error, never a
# string some consumer silently misreads.
LeaseOutcome = Literal["consumed", "discarded", "none"]
DecisionAction = Literal["route", "reject"]
ModelState = Literal["active", "resident", "staged", "absent"]
SwitchPath = Literal["d2d_full", "d2d_partial", "host_only", "cold"]
Pool = Literal["hot", "cold"]

# Ids travel into Postgres rows and NATS subjects: every decoder refuses ones that
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
# A client's idempotency key (services/gateway/idempotency.py): printable ASCII, as an HTTP
# header value can carry it; Stripe's bound. It is hashed before it names anything.
MAX_IDEMPOTENCY_KEY_LEN = 255
IdempotencyKey = Annotated[str, Meta(min_length=1, max_length=MAX_IDEMPOTENCY_KEY_LEN, pattern=r"^[\x20-\x7e]+\Z")]


ENCODER = msgspec.json.Encoder()


def encode(message: Struct) -> bytes:
    return ENCODER.encode(message)


def replace(message: Struct, **changes) -> Struct:
    return msgspec.structs.replace(message, **changes)
