"""Who may publish and subscribe what on NATS, and which service owns each event.

Three defences (docs/security.md): server-side permissions, one NATS user per service, per
instance agent and per tenant's API client (`permissions`); a `Talaria-Sender` header on every
event, reply and token chunk, checked against the event's owners in the wire table
(event_specs.py) and unforgeable where the permissions hold (`trusted`, `sent_by`); and reply
subjects only inside the caller tenant's own inboxes (`reply_allowed`). The detail: `permissions`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from talaria.shared.event_specs import published_by, read_on_core_by, spec_of
from talaria.shared.subjects import (client_inbox_prefix, idempotency_stream_name, replies_stream_name,
                                     routers_bucket_name, stream_name)

SENDER_HEADER = "Talaria-Sender"
SERVICE_INBOX = "_TALARIA_INBOX"  # services' request inboxes (JetStream API, fetches); clients use _INBOX
ADMIN_INBOX = "_TALARIA_ADMIN"  # the admin user's request inboxes (`talaria drain`)
ADMIN_ROLES = frozenset({"admin"})
CLIENT_INBOX = "_INBOX"


def sender_name(role: str, instance_id: str | None = None) -> str:
    """The NATS connection name (and `Talaria-Sender` value) of a service."""
    return f"talaria-agent-{instance_id}" if role == "agent" else f"talaria-{role}"


def parse_sender(sender: str | None) -> tuple[str, str | None]:
    """`talaria-agent-agent-0` -> ("agent", "agent-0"); `talaria-router` -> ("router", None)."""
    if not sender or not sender.startswith("talaria-"):
        return "", None
    rest = sender[len("talaria-"):]
    if rest.startswith("agent-"):
        return "agent", rest[len("agent-"):]
    return rest, None


def sender_of(msg) -> str | None:
    return (msg.headers or {}).get(SENDER_HEADER)


# Who may answer a call (on its reply subject, kept or not) and stream its tokens. A reader drops
# anything else: on a NATS with per-service permissions only these users can publish there at
# all; on an open NATS it still stops a message that does not claim to be from them.
ANSWERING_ROLES = frozenset({"router", "agent"})
STREAMING_ROLES = frozenset({"agent"})


def sender_headers(nc) -> dict[str, str]:
    """Headers naming the publishing service (its connection name), for a reply or a token chunk."""
    return {SENDER_HEADER: nc.options.get("name") or ""}


def sent_by(headers, roles: frozenset[str]) -> bool:
    """Did a message with these headers come from a service in `roles`?"""
    return parse_sender((headers or {}).get(SENDER_HEADER))[0] in roles


def reply_allowed(tenant: str | None, reply: str | None) -> bool:
    """May the gateway answer a NATS API request on `reply`? Only inside the caller's own inbox
    space (`_INBOX.<tenant>.`; `_INBOX.` for a gateway without keys), so a request cannot make
    the gateway write into another tenant's inbox, a kept answer or a token stream."""
    return bool(reply) and reply.startswith(client_inbox_prefix(tenant or None) + ".")


def trusted(msg, event) -> bool:
    """Did `event` come from a service allowed to publish it?"""
    spec = spec_of(event)
    if spec is None:
        return False
    owners = spec.owners
    role, instance = parse_sender(sender_of(msg))
    if role not in owners:
        return False
    if role == "agent":
        claimed = getattr(event, "instance_id", None)
        return claimed in (None, "", instance)
    return True


def owner_sender(event) -> str:
    """The sender name of the service that owns `event` (for tests and tools standing in for it)."""
    owners = spec_of(event).owners
    if "agent" in owners and getattr(event, "instance_id", ""):
        return sender_name("agent", event.instance_id)
    return sender_name(sorted(owners - {"agent"})[0] if owners - {"agent"} else "agent", "unknown")


def permissions(role: str, prefix: str = "talaria", instance_id: str | None = None,
                tenant: str | None = None) -> dict:
    """NATS publish/subscribe permissions of one service user (nats-server config format).
    The events a service may publish, and those it reads on core NATS, come from the wire table.

    The layers of defence these permissions are one of (docs/security.md):
    - **server-side permissions**: the embedded NATS runs with one user per service (and per
      instance agent) plus a `client` user for the NATS API; `permissions()` lists what each may
      publish and subscribe. A client may publish only `talaria.api.call` / `talaria.api.cancel`
      and read only its own inboxes and streamed tokens: it cannot read `talaria.evt.>` (prompts),
      use the JetStream API, or publish events, routed calls or replies. With API keys there is one
      client user per tenant, fenced to `_INBOX.<tenant>.>` and `talaria.tokens.<tenant>.>`, so one
      tenant cannot read another's replies or streamed tokens.
    - **sender checks**: every event carries a `Talaria-Sender` header (the publishing service);
      an agent runs only `CallRouted` sent by the router and the projector records only events
      from their owning service (`owners` in the wire table, event_specs.py). On a NATS with
      per-service permissions the header cannot be forged; on an open NATS it still stops
      anything that does not set it.
      Replies and token chunks carry it too: the gateway takes a call's answer (live or kept) only
      from the router or an agent, and its tokens only from an agent.
    - **reply subjects**: the gateway publishes only into inbox spaces (no `allow_responses`) and
      answers a NATS API request only inside its caller tenant's own inboxes (`reply_allowed`).
    """
    stream = stream_name(prefix)
    events = [spec.publish_pattern(prefix) for spec in published_by(role)]
    heard = [spec.subject(prefix) for spec in read_on_core_by(role)]
    # JetStream API on this deployment's stream only: create/inspect it and its consumers,
    # fetch and ack; no other stream, and no STREAM.DELETE / PURGE.
    js = ["$JS.API.INFO", *(f"$JS.API.STREAM.{op}.{stream}" for op in ("INFO", "CREATE", "UPDATE")),
          f"$JS.API.CONSUMER.*.{stream}", f"$JS.API.CONSUMER.*.{stream}.>", f"$JS.API.CONSUMER.*.*.{stream}.>",
          f"$JS.ACK.{stream}.>"]
    inbox = [f"{SERVICE_INBOX}.>"]
    watch = [f"{prefix}.telemetry.*", f"{prefix}.health.*"]
    if role == "gateway":
        # Its idempotency stream too (gateway/idempotency.py): claims on keys, kept replies.
        idem, replies = idempotency_stream_name(prefix), replies_stream_name(prefix)
        idem_js = [f"$JS.API.STREAM.{op}.{name}" for op in ("INFO", "CREATE", "UPDATE", "MSG.GET")
                   for name in (idem, replies)]
        # No `allow_responses`: it would let a request name any subject (another tenant's kept
        # answer, a token stream) as its reply. The gateway answers only in inbox spaces: clients'
        # (nats_api checks each is the caller tenant's own) and services' (probes).
        pub = [*events, f"{prefix}.health.gateway", f"{prefix}.cancel",
               f"{prefix}.idem.key.*", f"{prefix}.idem.waiting.*", f"{CLIENT_INBOX}.>", f"{SERVICE_INBOX}.>",
               *js, *idem_js]
        sub = [f"{prefix}.api.call", f"{prefix}.api.cancel", f"{prefix}.reply.gateway.>", f"{prefix}.reply.live.>",
               f"{prefix}.tokens.>", f"{prefix}.idem.waiting.*", *watch, *inbox, *heard]
        return {"publish": {"allow": pub}, "subscribe": {"allow": sub}}
    if role == "router":
        # Its partition-ownership KV bucket (router/claims.py): create it, read and CAS-write keys.
        bucket = routers_bucket_name(prefix)
        kv = [*(f"$JS.API.STREAM.{op}.KV_{bucket}" for op in ("INFO", "CREATE", "UPDATE", "MSG.GET")),
              f"$JS.API.DIRECT.GET.KV_{bucket}.>", f"$KV.{bucket}.>"]
        pub = [*events, f"{prefix}.reply.>", f"{prefix}.health.router", f"{prefix}.dispatch.*", f"{ADMIN_INBOX}.>",
               *js, *kv]
        return {"publish": {"allow": pub}, "subscribe": {"allow": [*watch, *inbox, *heard, f"{prefix}.admin.drain"]}}
    if role == "telemetry":
        return {"publish": {"allow": [*events, f"{prefix}.health.telemetry", *js]},
                "subscribe": {"allow": [*watch, *inbox, *heard]}}
    if role == "agent":
        if not instance_id:
            raise ValueError("an agent user needs its instance id")
        # Read-only on the routers' ownership bucket: a dispatch's partition claim (fencing.py).
        bucket = routers_bucket_name(prefix)
        claims = [*(f"$JS.API.STREAM.{op}.KV_{bucket}" for op in ("INFO", "MSG.GET")),
                  f"$JS.API.DIRECT.GET.KV_{bucket}.>"]
        pub = [*events, f"{prefix}.tokens.>", f"{prefix}.reply.>",
               f"{prefix}.telemetry.{instance_id}", f"{prefix}.health.agent-{instance_id}",
               f"$JS.API.STREAM.MSG.GET.{stream}", *js, *claims]  # a routed call's prompt, read by reference
        sub = [*watch, *inbox, f"{prefix}.cancel", f"{prefix}.dispatch.{instance_id}", *heard]
        return {"publish": {"allow": pub}, "subscribe": {"allow": sub}}
    if role == "client":
        # A client's cancel goes to the gateway, which checks its key: only its own tenant's calls stop.
        # A tenant's user reads only its own inboxes and token streams; the tenant-less user (a
        # gateway without API keys, where every call is the one open tenant's) reads all of them.
        reads = ([f"{client_inbox_prefix(tenant)}.>", f"{prefix}.tokens.{tenant}.>"] if tenant
                 else [f"{CLIENT_INBOX}.>", f"{prefix}.tokens.>"])
        return {"publish": {"allow": [f"{prefix}.api.call", f"{prefix}.api.cancel"]},
                "subscribe": {"allow": [*reads, f"{prefix}.health.*"]},
                "allow_responses": False}
    if role == "admin":  # an operator's commands to the routers (`talaria drain`), answered in its inbox
        return {"publish": {"allow": [f"{prefix}.admin.drain"]}, "subscribe": {"allow": [f"{ADMIN_INBOX}.>"]},
                "allow_responses": False}
    raise ValueError(f"unknown NATS role {role!r}")


@dataclass(frozen=True)
class NatsUser:
    name: str  # NATS user name = the service's sender name
    password: str
    role: str
    instance_id: str | None = None
    tenant: str | None = None  # a NATS API client user's tenant

    def env(self) -> dict[str, str]:
        return {"TALARIA_NATS_USER": self.name, "TALARIA_NATS_PASSWORD": self.password}

    def options(self) -> dict[str, str]:
        """`nats.connect` keyword arguments; a tenant's client must use its own inbox prefix."""
        extra = {"inbox_prefix": client_inbox_prefix(self.tenant)} if self.tenant else {}
        return {"user": self.name, "password": self.password, **extra}


def client_options(url: str) -> dict[str, str]:
    """`nats.connect` options for a NATS API client connecting with `url`: a tenant's client
    user (`talaria-client-<tenant>` in the URL) may read only its tenant's inbox prefix."""
    user = urlsplit(url).username or ""
    prefix = sender_name("client") + "-"
    return {"inbox_prefix": client_inbox_prefix(user[len(prefix):])} if user.startswith(prefix) else {}


def client_user_key(tenant: str) -> str:
    """Where `generate_users` files a tenant's NATS API client user."""
    return f"client-{tenant}"


def generate_users(agent_ids: list[str] | tuple[str, ...], tenants: list[str] | tuple[str, ...] = ()
                   ) -> dict[str, NatsUser]:
    """Fresh random credentials: one user per service and per agent, and for NATS API clients
    one per tenant (`client-<tenant>`) or, with no tenants, one shared `client`."""
    users = {}
    for role in ("gateway", "router", "telemetry", "admin"):
        users[role] = NatsUser(sender_name(role), secrets.token_urlsafe(24), role)
    for tenant in dict.fromkeys(tenants):
        users[client_user_key(tenant)] = NatsUser(f"talaria-client-{tenant}", secrets.token_urlsafe(24),
                                                  "client", tenant=tenant)
    if not tenants:
        users["client"] = NatsUser(sender_name("client"), secrets.token_urlsafe(24), "client")
    for agent in agent_ids:
        users[f"agent-{agent}"] = NatsUser(sender_name("agent", agent), secrets.token_urlsafe(24), "agent", agent)
    return users


def authorization_block(users: dict[str, NatsUser], prefix: str = "talaria") -> dict:
    """The `authorization` section of a nats-server config (JSON is valid nats-server config)."""
    return {"users": [{"user": u.name, "password": u.password,
                       "permissions": permissions(u.role, prefix, u.instance_id, u.tenant)} for u in users.values()]}


def cluster_route_urls(members: list[str], user: str, password: str) -> list[str]:
    """A cluster's route URLs (`host:port` each) with the route user and password every member
    must present (nats-server applies no user permissions to routes)."""
    return [f"nats://{user}:{password}@{m.removeprefix('nats://')}" for m in members]
