"""NATS and JetStream plumbing shared by every service: connect, the event stream, publish."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from talaria.shared import subjects
from talaria.shared.event_specs import EventSpec, spec_of
from talaria.shared.nats_auth import SENDER_HEADER, SERVICE_INBOX
from talaria.shared.wire import encode
from talaria.shared.tracing import inject_headers

STREAM_MAX_AGE_S = 7 * 24 * 3600
DUPLICATE_WINDOW_S = 120
RECONNECT_WAIT_S = 0.5  # between reconnect attempts; also a publisher's wait before retrying
PUBLISH_TIMEOUT_S = 10.0  # a JetStream publish (or other API call) waits this long for its ack
# A service's durable consumer (router, telemetry): a message fetched and not acked this long is
# delivered again; a restarted service recreates its consumer from the ack floor at once anyway.
ACK_WAIT_S = 30.0


async def connect(url: str, name: str, **auth) -> tuple[NATS, JetStreamContext]:
    """`name` is also the `Talaria-Sender` of every event published through this connection
    (nats_auth.sender_name); `auth` are the credentials (Settings.nats_options())."""
    nc = await nats.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=RECONNECT_WAIT_S,
        connect_timeout=5,
        inbox_prefix=SERVICE_INBOX,  # client users may read _INBOX.>, never services' inboxes
        **auth,
    )
    js = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
    await ensure_stream(js)
    return nc, js


# Share of the data directory's disk each stream may keep (issue 25: nothing bounded storage,
# ~4 KB of JetStream per call): shares of the free space at start. Past it JetStream drops the oldest messages (DiscardPolicy.OLD):
# events long projected, answers long read; a consumer down for days could lose events it has
# not read. With the gateway's free-space
# reserve (gateway/admission.py) the broker never fills the disk on its own.
EVENTS_DISK_SHARE, IDEMPOTENCY_DISK_SHARE, REPLIES_DISK_SHARE = 1 / 8, 1 / 16, 1 / 32  # 22%: three deployments fit one broker


DATA_DIR = Path(".talaria")  # set once per process from its settings (runtime.main), like subjects


def configure_storage(data_dir: Path) -> None:
    global DATA_DIR
    DATA_DIR = Path(data_dir)


def disk_cap(share: float) -> int:
    """`share` of the free space (at start) on the disk holding the data directory: JetStream
    reserves every stream's max_bytes against its store, which it sizes from the free space
    (75% of it by default), so shares of the free space always fit."""
    path = DATA_DIR.resolve()
    while not path.exists():
        path = path.parent
    return int(shutil.disk_usage(path).free * share)


async def ensure_stream(js: JetStreamContext) -> None:
    """Create the event stream if absent. Idempotent; every service calls it at start."""
    config = StreamConfig(
        name=subjects.EVENTS_STREAM,
        subjects=[subjects.EVENTS_WILDCARD],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=STREAM_MAX_AGE_S,
        max_bytes=disk_cap(EVENTS_DISK_SHARE),
        duplicate_window=DUPLICATE_WINDOW_S,
    )
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)


async def publish_event(
    js: JetStreamContext, subject: str, event: msgspec.Struct, *, msg_id: str | None = None,
    sender: str | None = None,
) -> int:
    """Publish one event durably; returns its stream sequence.

    `msg_id` makes retries idempotent: JetStream drops a duplicate within the window.
    The current trace context rides along in the headers.
    """
    ack = await js.publish(subject, encode(event), headers=_headers(js, msg_id, sender))
    return ack.seq


async def written() -> None:
    """Let the NATS client write what was just published before this task goes on.

    A publish only queues its bytes and wakes the client's flusher task; the write happens
    when the publishing task next yields. One loop turn runs the flusher (woken first), so
    a reply leaves before the bookkeeping that follows it, not after."""
    await asyncio.sleep(0)


def _headers(js: JetStreamContext, msg_id: str | None, sender: str | None = None) -> dict[str, str]:
    """Dedupe id, trace context, and the sender (by default the connection's name) for sender
    checks; only tests and tools that stand in for a service pass `sender`."""
    base = {SENDER_HEADER: sender or js._nc.options.get("name") or ""}
    if msg_id:
        base["Nats-Msg-Id"] = msg_id
    return inject_headers(base)


async def publish_fast(js: JetStreamContext, subject: str, event: msgspec.Struct) -> None:
    """Core-NATS copy of an event (no ack, no storage), with the same sender and trace headers."""
    await js._nc.publish(subject, encode(event), headers=_headers(js, None))


def event_subject(event: msgspec.Struct) -> str:
    """The subject an event belongs on (its wire-table row): `<deployment>.evt.<its tag>`; a
    routed call goes to its instance's own subject."""
    return _spec(event).subject_of(subjects.DEPLOYMENT, event)


def event_msg_id(event: msgspec.Struct) -> str | None:
    """A natural dedupe key for events that must be published at most once (the row's `dedupe`)."""
    return _spec(event).msg_id(event)


def _spec(event: msgspec.Struct) -> EventSpec:
    spec = spec_of(event)
    if spec is None:
        raise TypeError(f"{type(event).__name__} is not an event (no row in shared/event_specs.py)")
    return spec


async def emit(js: JetStreamContext, event: msgspec.Struct, sender: str | None = None) -> int:
    return await publish_event(js, event_subject(event), event, msg_id=event_msg_id(event), sender=sender)


async def emit_async(js: JetStreamContext, event: msgspec.Struct, sender: str | None = None) -> asyncio.Future:
    """Like `emit`, without waiting for the ack: returns its future (a PubAck). Events
    published one after another are stored in that order."""
    return await js.publish_async(event_subject(event), encode(event),
                                  headers=_headers(js, event_msg_id(event), sender))


async def emit_new(js: JetStreamContext, event: msgspec.Struct, data: bytes | None = None) -> int | None:
    """Like `emit`, but None when JetStream dropped it as a duplicate of a recent message.
    `data`: the event already encoded (the gateway measured its size with it)."""
    ack = await js.publish(event_subject(event), encode(event) if data is None else data,
                           headers=_headers(js, event_msg_id(event)))
    return None if ack.duplicate else ack.seq


async def close(nc: NATS) -> None:
    """Flush what we published, then close. (`drain()` can stall for its full timeout on
    connections that used pull consumers, which would slow every shutdown by 30 s.)"""
    try:
        await nc.flush(timeout=2)
    except Exception:
        pass
    await nc.close()
