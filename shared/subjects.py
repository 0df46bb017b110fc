"""NATS subject names: the only coupling between Talaria services.

    talaria.api.call                 request/reply API for agent runtimes (gateway answers)
    talaria.api.cancel               CancelCall from a client, with its API key (gateway answers)
    talaria.cancel                   CancelCall stamped with the key's tenant (gateway -> every agent)
    talaria.dispatch.<instance_id>   core-NATS fast copy of a CallRouted (the durable one is
                                     on the stream; the agent starts from whichever comes first)
    talaria.tokens.<tenant>.<call_id> streamed TokenChunk messages for one call (`_` = no tenant;
                                     a NATS API client may read only its own tenant's)
    talaria.reply.live.<id>.<call>   a call's reply (CallResult / ErrorReply) to gateway <id>; kept
                                     for 2x the call timeout by the stream REPLIES_STREAM, so a
                                     gateway that was cut off from NATS finds it on reconnecting
    talaria.reply.gateway.idem.<t>-<call> the reply of a keyed call (t: its tenant's tag): kept,
                                     with the key's claim on talaria.idem.key.<hash>, by the
                                     JetStream stream IDEMPOTENCY_STREAM (gateway/idempotency.py)
    talaria.idem.waiting.<t>-<call>  core NATS: every gateway request waiting for that keyed call
                                     answers a probe here (no responders: nobody waits for it)
    talaria.telemetry.<instance_id>  InstanceSnapshot heartbeats (last value, not history)
    talaria.health.<service>         service heartbeats (a router's names its id: routers count
                                     their live peers from them, router/ownership.py)
    KV bucket TALARIA_ROUTERS        router partition ownership (`partition.<p>` -> owner id)
    talaria.evt.call.submitted.<slot> a call's submission, on its session's slot (0-63,
                                     shared/session_slots.py): router partitions consume slots
    talaria.evt.<tag>                the event log, captured by the JetStream stream EVENTS_STREAM:
                                     one subject per event, named by its tag, listed with its
                                     owner in the wire table (event_specs.py); the constant of
                                     `call.submitted` is CALL_SUBMITTED, of the per-instance
                                     `call.routed.<instance_id>` CALL_ROUTED_PREFIX

`talaria` is the deployment name (TALARIA_DEPLOYMENT): `configure("blue")` makes every
subject start with `blue.` and the stream `BLUE_EVENTS`, so two deployments can share one
NATS without seeing each other's calls. It is set once per process (runtime.main) before
any service starts; the names below are read at call time (`subjects.X`), never copied.
"""

from __future__ import annotations

from talaria.shared.event_specs import SPECS

DEPLOYMENT = "talaria"
API_QUEUE_GROUP = "gateway"


def stream_name(deployment: str) -> str:
    return f"{deployment.upper().replace('-', '_')}_EVENTS"


def replies_stream_name(deployment: str) -> str:
    return f"{deployment.upper().replace('-', '_')}_REPLIES"


def idempotency_stream_name(deployment: str) -> str:
    return f"{deployment.upper().replace('-', '_')}_IDEMPOTENCY"


def routers_bucket_name(deployment: str) -> str:
    """The JetStream KV bucket of router partition ownership (services/router/claims.py)."""
    return f"{deployment.upper().replace('-', '_')}_ROUTERS"


def configure(deployment: str) -> None:
    """Name every subject and the stream after `deployment` (the default: `talaria`)."""
    g = globals()
    g["DEPLOYMENT"] = deployment
    g["EVENTS_STREAM"] = stream_name(deployment)
    g["EVENTS_WILDCARD"] = f"{deployment}.evt.>"
    g["API_CALL"] = f"{deployment}.api.call"
    g["API_CANCEL"] = f"{deployment}.api.cancel"  # clients -> gateway (checks the key)
    g["CALL_CANCEL"] = f"{deployment}.cancel"  # gateway -> agents (tenant stamped)
    g["DISPATCH_PREFIX"] = f"{deployment}.dispatch"
    g["IDEMPOTENCY_STREAM"] = idempotency_stream_name(deployment)
    g["IDEMPOTENCY_KEYS"] = f"{deployment}.idem.key"
    g["IDEMPOTENT_REPLIES"] = f"{deployment}.reply.gateway.idem"  # never a gateway inbox id (uuid hex)
    g["IDEMPOTENT_WAITING"] = f"{deployment}.idem.waiting"  # gateways answer for a keyed call's waiters
    g["REPLIES_STREAM"] = replies_stream_name(deployment)
    g["ROUTERS_BUCKET"] = routers_bucket_name(deployment)
    g["LIVE_REPLIES"] = f"{deployment}.reply.live"  # gateways' reply inboxes (not under .gateway: the
    # kept replies' stream captures talaria.reply.gateway.idem.*, and two streams may not overlap)
    g.update({event_constant(spec.tag, spec.per_instance): spec.subject(deployment) for spec in SPECS})
    g.update(
        TELEMETRY_PREFIX=f"{deployment}.telemetry", TELEMETRY_WILDCARD=f"{deployment}.telemetry.*",
        TOKENS_PREFIX=f"{deployment}.tokens", REPLY_PREFIX=f"{deployment}.reply",
        HEALTH_PREFIX=f"{deployment}.health", HEALTH_WILDCARD=f"{deployment}.health.*",
    )


def event_constant(tag: str, per_instance: bool = False) -> str:
    """The module constant of an event's subject: `call.submitted` -> CALL_SUBMITTED."""
    return tag.upper().replace(".", "_").replace("-", "_") + ("_PREFIX" if per_instance else "")


EVENTS_STREAM = EVENTS_WILDCARD = API_CALL = API_CANCEL = CALL_CANCEL = DISPATCH_PREFIX = ""
# Each event's subject (set from the wire table by `configure`; named here for readers and linters).
CALL_SUBMITTED = CALL_ROUTED_PREFIX = CALL_STARTED = CALL_COMPLETED = CALL_FAILED = ""
LEASE_ISSUED = LEASE_CONSUMED = LEASE_DISCARDED = LEASE_EXPIRED = DECISION = ""
SWITCH_DONE = ROUND_SUMMARY = INSTANCE_LOST = POOL_PINNED = TELEMETRY_PREFIX = TELEMETRY_WILDCARD = TOKENS_PREFIX = ""
REPLY_PREFIX = HEALTH_PREFIX = HEALTH_WILDCARD = ""  # a call's reply to the gateway: never a client inbox
IDEMPOTENCY_STREAM = IDEMPOTENCY_KEYS = IDEMPOTENT_REPLIES = IDEMPOTENT_WAITING = REPLIES_STREAM = LIVE_REPLIES = ""
ROUTERS_BUCKET = ""
configure(DEPLOYMENT)


def call_submitted(slot: int | str) -> str:
    """The submissions of one session slot (`*`: every slot)."""
    return f"{CALL_SUBMITTED}.{slot}"


def call_routed(instance_id: str) -> str:
    return f"{CALL_ROUTED_PREFIX}.{instance_id}"


def dispatch(instance_id: str) -> str:
    return f"{DISPATCH_PREFIX}.{instance_id}"


def telemetry(instance_id: str) -> str:
    return f"{TELEMETRY_PREFIX}.{instance_id}"


OPEN_TENANT = "_"  # the tenant token of a gateway without API keys (tenant names are never empty)


def tokens(tenant: str, call_id: str) -> str:
    """One call's token stream, under its tenant so NATS permissions can fence tenants apart."""
    return f"{TOKENS_PREFIX}.{tenant or OPEN_TENANT}.{call_id}"


def client_inbox_prefix(tenant: str | None) -> str:
    """The reply inbox prefix a NATS API client of `tenant` must connect with (`inbox_prefix=`):
    its user may subscribe to no other inbox, so it cannot read other tenants' replies."""
    return f"_INBOX.{tenant}" if tenant else "_INBOX"


def reply_inbox(service: str, instance: str) -> str:
    return f"{REPLY_PREFIX}.{service}.{instance}"


def health(service: str) -> str:
    return f"{HEALTH_PREFIX}.{service}"


def valid_token(value: str) -> bool:
    """A subject token must not contain separators or wildcards."""
    return bool(value) and not any(c in value for c in ".*> \t\r\n")
