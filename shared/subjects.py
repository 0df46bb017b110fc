"""NATS subject names: the only coupling between Talaria services (the full map: `Deployment`).

`talaria` is the deployment name (TALARIA_DEPLOYMENT): `Deployment("blue")` names every subject
`blue.…` and the streams `BLUE_…`, so two deployments can share one NATS without seeing each
other's calls. A `Deployment` is a value: each service is handed its own (settings.common) and
the bus connection keeps the one it was opened with; nothing here is configured globally.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from talaria.shared.event_specs import SPECS

API_QUEUE_GROUP = "gateway"
OPEN_TENANT = "_"  # the tenant token of a gateway without API keys (tenant names are never empty)
DEPLOYMENT_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_EVENT_TAGS = frozenset(spec.tag for spec in SPECS)


def stream_name(deployment: str) -> str:
    return f"{deployment.upper().replace('-', '_')}_EVENTS"


def replies_stream_name(deployment: str) -> str:
    return f"{deployment.upper().replace('-', '_')}_REPLIES"


def idempotency_stream_name(deployment: str) -> str:
    return f"{deployment.upper().replace('-', '_')}_IDEMPOTENCY"


def routers_bucket_name(deployment: str) -> str:
    """The JetStream KV bucket of router partition ownership (services/router/claims.py)."""
    return f"{deployment.upper().replace('-', '_')}_ROUTERS"


@dataclass(frozen=True)
class Deployment:
    """One deployment's NATS names, all derived from its name.

    Subjects (here under the default name `talaria`):

        talaria.api.call                 request/reply API for agent runtimes (gateway answers)
        talaria.api.cancel               CancelCall from a client, with its API key (gateway answers)
        talaria.cancel                   CancelCall stamped with the key's tenant (gateway -> every agent)
        talaria.dispatch.<instance_id>   core-NATS fast copy of a CallRouted (the durable one is
                                         on the stream; the agent starts from whichever comes first)
        talaria.tokens.<tenant>.<call_id> streamed TokenChunk messages for one call (`_` = no tenant;
                                         a NATS API client may read only its own tenant's)
        talaria.reply.live.<id>.<call>   a call's reply (CallResult / ErrorReply) to gateway <id>; kept
                                         for 2x the call timeout by the stream `replies_stream`, so a
                                         gateway that was cut off from NATS finds it on reconnecting
        talaria.reply.gateway.idem.<t>-<call> the reply of a keyed call (t: its tenant's tag): kept,
                                         with the key's claim on talaria.idem.key.<hash>, by the
                                         JetStream stream `idempotency_stream` (gateway/idempotency.py)
        talaria.idem.waiting.<t>-<call>  core NATS: every gateway request waiting for that keyed call
                                         answers a probe here (no responders: nobody waits for it)
        talaria.telemetry.<instance_id>  InstanceSnapshot heartbeats (last value, not history)
        talaria.health.<service>         service heartbeats (a router's names its id: routers count
                                         their live peers from them, router/ownership.py)
        KV bucket TALARIA_ROUTERS        router partition ownership (`partition.<p>` -> owner id)
        talaria.evt.call.submitted.<slot> a call's submission, on its session's slot (0-63,
                                         shared/session_slots.py): router partitions consume slots
        talaria.evt.<tag>                the event log, captured by the JetStream stream `events_stream`:
                                         one subject per event, named by its tag, listed with its
                                         owner in the wire table (event_specs.py): `event("call.submitted")`;
                                         the per-instance `call.routed.<instance_id>`: `call_routed(id)`
    """

    name: str = "talaria"

    def __post_init__(self) -> None:
        if not DEPLOYMENT_NAME.fullmatch(self.name):
            raise ValueError(f"deployment {self.name!r}: expected 1-32 lowercase letters, digits, "
                             "'_' or '-', starting with a letter")

    # -- streams ----------------------------------------------------------------------------
    events_stream = property(lambda self: stream_name(self.name))
    replies_stream = property(lambda self: replies_stream_name(self.name))
    idempotency_stream = property(lambda self: idempotency_stream_name(self.name))
    routers_bucket = property(lambda self: routers_bucket_name(self.name))
    events_wildcard = property(lambda self: f"{self.name}.evt.>")

    # -- the client API and cancels ---------------------------------------------------------
    api_call = property(lambda self: f"{self.name}.api.call")
    api_cancel = property(lambda self: f"{self.name}.api.cancel")  # clients -> gateway (checks the key)
    call_cancel = property(lambda self: f"{self.name}.cancel")  # gateway -> agents (tenant stamped)
    admin_drain = property(lambda self: f"{self.name}.admin.drain")  # the admin user -> routers (`talaria drain`)

    # -- replies (a call's reply to the gateway: never a client inbox) ------------------------
    reply_prefix = property(lambda self: f"{self.name}.reply")
    # gateways' reply inboxes (not under .gateway: the kept replies' stream captures
    # talaria.reply.gateway.idem.*, and two streams may not overlap)
    live_replies = property(lambda self: f"{self.name}.reply.live")
    idempotency_keys = property(lambda self: f"{self.name}.idem.key")
    idempotent_replies = property(lambda self: f"{self.name}.reply.gateway.idem")  # never a gateway inbox id
    idempotent_waiting = property(lambda self: f"{self.name}.idem.waiting")  # gateways answer for a keyed call's waiters

    # -- per-instance and per-service subjects ---------------------------------------------
    dispatch_prefix = property(lambda self: f"{self.name}.dispatch")
    telemetry_prefix = property(lambda self: f"{self.name}.telemetry")
    telemetry_wildcard = property(lambda self: f"{self.name}.telemetry.*")
    tokens_prefix = property(lambda self: f"{self.name}.tokens")
    health_prefix = property(lambda self: f"{self.name}.health")
    health_wildcard = property(lambda self: f"{self.name}.health.*")
    call_routed_prefix = property(lambda self: self.event("call.routed"))

    def event(self, tag: str) -> str:
        """An event's subject, by its tag (the wire table's row; per-instance: the prefix)."""
        if tag not in _EVENT_TAGS:
            raise KeyError(f"no event tagged {tag!r} (shared/event_specs.py)")
        return f"{self.name}.evt.{tag}"

    def call_submitted(self, slot: int | str) -> str:
        """The submissions of one session slot (`*`: every slot)."""
        return f"{self.event('call.submitted')}.{slot}"

    def call_routed(self, instance_id: str) -> str:
        return f"{self.call_routed_prefix}.{instance_id}"

    def dispatch(self, instance_id: str) -> str:
        return f"{self.dispatch_prefix}.{instance_id}"

    def telemetry(self, instance_id: str) -> str:
        return f"{self.telemetry_prefix}.{instance_id}"

    def tokens(self, tenant: str, call_id: str) -> str:
        """One call's token stream, under its tenant so NATS permissions can fence tenants apart."""
        return f"{self.tokens_prefix}.{tenant or OPEN_TENANT}.{call_id}"

    def reply_inbox(self, service: str, instance: str) -> str:
        return f"{self.reply_prefix}.{service}.{instance}"

    def health(self, service: str) -> str:
        return f"{self.health_prefix}.{service}"


def client_inbox_prefix(tenant: str | None) -> str:
    """The reply inbox prefix a NATS API client of `tenant` must connect with (`inbox_prefix=`):
    its user may subscribe to no other inbox, so it cannot read other tenants' replies."""
    return f"_INBOX.{tenant}" if tenant else "_INBOX"


def valid_token(value: str) -> bool:
    """A subject token must not contain separators or wildcards."""
    return bool(value) and not any(c in value for c in ".*> \t\r\n")
