"""NATS and JetStream plumbing shared by every service: connect, the event stream, publish."""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections.abc import Callable
import shutil
from pathlib import Path

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NoStreamResponseError, ServiceUnavailableError

from talaria.shared.event_specs import EventSpec, spec_of
from talaria.shared.nats_auth import SENDER_HEADER, SERVICE_INBOX
from talaria.shared.subjects import Deployment
from talaria.shared.wire import encode
from talaria.shared.tracing import inject_headers

STREAM_MAX_AGE_S = 7 * 24 * 3600
DUPLICATE_WINDOW_S = 120
RECONNECT_WAIT_S = 0.5  # between reconnect attempts; also a publisher's wait before retrying
PUBLISH_TIMEOUT_S = 10.0  # a JetStream publish (or other API call) waits this long for its ack
# A stream leader's failover on a cluster (nats-server/server/raft.go): a follower waits a
# random 4-9 s election timeout for a lost leader, then campaigns for up to 0.8 s; twice that
# covers one failed round. A replicated publish is answered within a RAFT heartbeat (1 s) when
# its leader lives: one unanswered after two heartbeats is sent again.
FAILOVER_S = 2 * (9.0 + 0.8)
ATTEMPT_S = 2 * 1.0
# A service's durable consumer (router, telemetry): a message fetched and not acked this long is
# delivered again; a restarted service recreates its consumer from the ack floor at once anyway.
ACK_WAIT_S = 30.0
# What a bus call raises when NATS or the connection to it fails: a service catches these at its
# boundary with the bus (logs, retries or answers 503); anything else is a bug and propagates.
BUS_ERRORS = (nats.errors.Error, TimeoutError, ConnectionError, OSError)


def servers(url: str) -> list[str]:
    """The servers of a NATS URL: one, or a cluster's members comma-separated (any one is
    enough to connect; the client learns the others and fails over among them)."""
    return [u.strip() for u in url.split(",") if u.strip()]


@dataclasses.dataclass(frozen=True)
class Link:
    """What a connection was opened for: its deployment's names, the replicas of the streams it
    creates (TALARIA_NATS_REPLICAS: 3 on a 3-node cluster, so a stream survives one node's
    loss; every service of a deployment must agree, `ensure_stream` updates an existing stream
    to its own count) and the data directory whose disk caps them."""

    deployment: Deployment = Deployment()
    replicas: int = 1
    data_dir: Path = Path(".talaria")


# Each connection's Link, kept beside the client object (nats.py's Client has no room for it);
# a context not made by `connect` (a test's, a tool's) gets the default Link.
_LINKS: "weakref.WeakKeyDictionary[NATS, Link]" = weakref.WeakKeyDictionary()


def bind(nc: NATS, link: Link) -> None:
    """Open `nc`'s Link (what `connect` does; a test's stand-in connection may be bound too)."""
    _LINKS[nc] = link


def link(js: JetStreamContext | NATS) -> Link:
    nc = getattr(js, "_nc", js)
    try:
        return _LINKS.get(nc, Link())
    except TypeError:  # not weak-referenceable: not a connection of ours
        return Link()


def deployment_of(js: JetStreamContext | NATS) -> Deployment:
    return link(js).deployment


def replicas(js: JetStreamContext) -> int:
    return link(js).replicas


async def connect(url: str, name: str, deployment: Deployment = Deployment(), replicas: int = 1,
                  data_dir: Path = Path(".talaria"), **auth) -> tuple[NATS, JetStreamContext]:
    """Connects to the first member of `url` that answers, in order. `name` is also the
    `Talaria-Sender` of every event published through this connection
    (nats_auth.sender_name); `auth` are the credentials; `deployment`, `replicas` and `data_dir`
    make its Link (CommonSettings.bus_options() gives them all)."""
    nc = await nats.connect(
        servers(url),
        name=name,
        # The members in the order given (the host's own node first), not shuffled as nats-py
        # does by default: a control host's service held on an agent host's node went deaf with
        # that host's partition (results/multihost.md).
        dont_randomize=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=RECONNECT_WAIT_S,
        connect_timeout=5,
        inbox_prefix=SERVICE_INBOX,  # client users may read _INBOX.>, never services' inboxes
        **auth,
    )
    js = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
    bind(nc, Link(deployment, replicas, Path(data_dir)))
    await ensure_stream(js)
    return nc, js


def retried_api(nc: NATS) -> JetStreamContext:
    """A JetStream context for API calls that their caller retries (making a consumer again,
    reading a stream's last sequence): each waits ATTEMPT_S, not PUBLISH_TIMEOUT_S. On a
    cluster, a call sent while the JetStream meta leader or a stream's leader is being elected
    is never answered; with the long timeout the caller sat out 10 s more after the election
    ended (CI: a node killed under load, the router took its partitions back 17 s later)."""
    return nc.jetstream(timeout=ATTEMPT_S)


# Share of the data directory's disk each stream may keep (issue 25: nothing bounded storage,
# ~4 KB of JetStream per call): shares of the free space at start. Past it JetStream drops the oldest messages (DiscardPolicy.OLD):
# events long projected, answers long read; a consumer down for days could lose events it has
# not read. With the gateway's free-space
# reserve (gateway/admission.py) the broker never fills the disk on its own.
EVENTS_DISK_SHARE, IDEMPOTENCY_DISK_SHARE, REPLIES_DISK_SHARE = 1 / 8, 1 / 16, 1 / 32  # 22%: three deployments fit one broker


def disk_cap(js: JetStreamContext, share: float) -> int:
    """`share` of the free space (at start) on the disk holding the data directory: JetStream
    reserves every stream's max_bytes against its store, which it sizes from the free space
    (75% of it by default), so shares of the free space always fit."""
    path = link(js).data_dir.resolve()
    while not path.exists():
        path = path.parent
    return int(shutil.disk_usage(path).free * share)


async def ensure_stream(js: JetStreamContext) -> None:
    """Create the event stream if absent. Idempotent; every service calls it at start."""
    config = StreamConfig(
        name=deployment_of(js).events_stream,
        subjects=[deployment_of(js).events_wildcard],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=STREAM_MAX_AGE_S,
        max_bytes=disk_cap(js, EVENTS_DISK_SHARE),
        duplicate_window=DUPLICATE_WINDOW_S,
        num_replicas=replicas(js),
    )
    await ensure_stream_config(js, config)


async def ensure_stream_config(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream, or bring an existing one to `config`; through a cluster's election."""
    async def add_or_update() -> None:
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)

    await elected(add_or_update)


async def elected(call, within_s: float = FAILOVER_S):
    """An idempotent JetStream API call, tried again while a cluster has no leader to answer
    it (a service starting as the cluster forms or elects: unanswered, or 503), for up to
    `within_s`; then its error is raised."""
    loop = asyncio.get_running_loop()
    deadline, wait = loop.time() + within_s, 0.1
    while True:
        try:
            return await call()
        except (ServiceUnavailableError, asyncio.TimeoutError, nats.errors.TimeoutError,
                nats.errors.NoRespondersError):
            if loop.time() + wait > deadline:
                raise
            await asyncio.sleep(wait)  # no event says "a leader is elected": retry, backing off
            wait = min(2 * wait, RECONNECT_WAIT_S)


# What each connection's events are also shown to (a service's metrics): what a service
# records and what it counts cannot drift apart, and no emitting code path needs a hook.
_TAPS: "weakref.WeakKeyDictionary[NATS, Callable[[msgspec.Struct], None]]" = weakref.WeakKeyDictionary()


def tap(js: JetStreamContext, observe: Callable[[msgspec.Struct], None]) -> None:
    """Show `observe` every event published through `js`'s connection from now on (before its
    ack: a retried publish is shown again, so `observe` counts by id where that matters)."""
    _TAPS[js._nc] = observe


def _show(js: JetStreamContext, event: msgspec.Struct) -> None:
    observe = _TAPS.get(js._nc)
    if observe is not None:
        try:
            observe(event)
        except Exception:  # a metric must never cost an event
            pass


async def publish_event(
    js: JetStreamContext, subject: str, event: msgspec.Struct, *, msg_id: str | None = None,
    sender: str | None = None,
) -> int:
    """Publish one event durably; returns its stream sequence.

    `msg_id` makes retries idempotent: JetStream drops a duplicate within the window.
    The current trace context rides along in the headers.
    """
    _show(js, event)
    return (await stored(js, subject, encode(event), _headers(js, msg_id, sender))).seq


async def stored(js: JetStreamContext, subject: str, data: bytes, headers: dict[str, str]):
    """`js.publish`, tried again through a stream leader's failover, for up to FAILOVER_S.

    On a cluster, a stream whose leader died answers nobody until its replicas elect another:
    a publish then gets "no responders" or a 503 API error at once (nothing was stored), or,
    sent to the old leader just before it died, no answer at all (it may or may not be
    stored). Either way it is sent again: after a refusal always; after no answer only with a
    message id, which makes a second copy a no-op (a copy of our own earlier attempt that
    JetStream reports as a duplicate is our publish, stored); an event without one gets a single
    PUBLISH_TIMEOUT_S attempt, as before. Without this the gateway would refuse every call of
    an election with a 503, and a lost answer would hold a publisher for PUBLISH_TIMEOUT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(PUBLISH_TIMEOUT_S, FAILOVER_S)
    resend = "Nats-Msg-Id" in headers
    wait, unanswered = 0.05, False
    while True:
        attempt = ATTEMPT_S if resend else PUBLISH_TIMEOUT_S
        try:
            ack = await js.publish(subject, data, timeout=min(attempt, max(0.0, deadline - loop.time())),
                                   headers=headers)
            return dataclasses.replace(ack, duplicate=False) if unanswered and ack.duplicate else ack
        except (NoStreamResponseError, ServiceUnavailableError, asyncio.TimeoutError,
                nats.errors.TimeoutError) as exc:
            refused = isinstance(exc, (NoStreamResponseError, ServiceUnavailableError))  # nothing stored
            if loop.time() + wait > deadline or not (resend or refused):
                raise
            unanswered = unanswered or not refused  # may be stored
            await asyncio.sleep(wait)  # no event says "a leader is elected": retry, backing off
            wait = min(2 * wait, RECONNECT_WAIT_S)


async def written() -> None:
    """Let the NATS client write what was just published before this task goes on.

    A publish only queues its bytes and wakes the client's flusher task; the write happens
    when the publishing task next yields. One loop turn runs the flusher (woken first), so
    a reply leaves before the bookkeeping that follows it, not after."""
    await asyncio.sleep(0)


# The process that published an event, for a service with replicas that reads the stream back
# (a router skips its own outputs, folded already): set once per connection by `set_origin`.
ORIGIN_HEADER = "Talaria-Origin"
_ORIGINS: "weakref.WeakKeyDictionary[NATS, str]" = weakref.WeakKeyDictionary()


def set_origin(nc: NATS, origin: str) -> None:
    _ORIGINS[nc] = origin


def origin_of(msg) -> str | None:
    return (msg.headers or {}).get(ORIGIN_HEADER)


def _headers(js: JetStreamContext, msg_id: str | None, sender: str | None = None) -> dict[str, str]:
    """Dedupe id, trace context, and the sender (by default the connection's name) for sender
    checks; only tests and tools that stand in for a service pass `sender`."""
    base = {SENDER_HEADER: sender or js._nc.options.get("name") or ""}
    origin = _ORIGINS.get(js._nc)
    if origin:
        base[ORIGIN_HEADER] = origin
    if msg_id:
        base["Nats-Msg-Id"] = msg_id
    return inject_headers(base)


async def publish_fast(js: JetStreamContext, subject: str, event: msgspec.Struct) -> None:
    """Core-NATS copy of an event (no ack, no storage), with the same sender and trace headers."""
    await js._nc.publish(subject, encode(event), headers=_headers(js, None))


def event_subject(deployment: Deployment, event: msgspec.Struct) -> str:
    """The subject an event belongs on (its wire-table row): `<deployment>.evt.<its tag>`; a
    routed call goes to its instance's own subject."""
    return _spec(event).subject_of(deployment.name, event)


def event_msg_id(event: msgspec.Struct) -> str | None:
    """A natural dedupe key for events that must be published at most once (the row's `dedupe`)."""
    return _spec(event).msg_id(event)


def _spec(event: msgspec.Struct) -> EventSpec:
    spec = spec_of(event)
    if spec is None:
        raise TypeError(f"{type(event).__name__} is not an event (no row in shared/event_specs.py)")
    return spec


async def emit(js: JetStreamContext, event: msgspec.Struct, sender: str | None = None) -> int:
    return await publish_event(js, event_subject(deployment_of(js), event), event, msg_id=event_msg_id(event), sender=sender)


async def emit_async(js: JetStreamContext, event: msgspec.Struct, sender: str | None = None) -> asyncio.Future:
    """Like `emit`, without waiting for the ack: returns its future (a PubAck). Events
    published one after another are stored in that order."""
    _show(js, event)
    return await js.publish_async(event_subject(deployment_of(js), event), encode(event),
                                  headers=_headers(js, event_msg_id(event), sender))


async def emit_new(js: JetStreamContext, event: msgspec.Struct, data: bytes | None = None) -> int | None:
    """Like `emit`, but None when JetStream dropped it as a duplicate of a recent message.
    `data`: the event already encoded (the gateway measured its size with it)."""
    _show(js, event)
    ack = await stored(js, event_subject(deployment_of(js), event), encode(event) if data is None else data,
                       _headers(js, event_msg_id(event)))
    return None if ack.duplicate else ack.seq


async def close(nc: NATS) -> None:
    """Flush what we published, then close. (`drain()` can stall for its full timeout on
    connections that used pull consumers, which would slow every shutdown by 30 s.)"""
    try:
        await nc.flush(timeout=2)
    except Exception:
        pass
    await nc.close()
