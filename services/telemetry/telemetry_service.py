"""Telemetry service: a durable consumer on talaria.evt.> projecting into Postgres.

Exactly-once effect from at-least-once delivery:
- each fetched batch is applied in one transaction, committed with synchronous_commit on
  (durable even when the server runs with it off), and only then is each event acked;
- every projection is idempotent (projector.py), so an event delivered again, in any
  order, after a crash or a lost ack, changes nothing a second time;
- acks are explicit per event: acking one never acknowledges another still in flight;
- an event that cannot be decoded or projected is quarantined (a row in
  `quarantined_events`, an alert in the log) and skipped, so it cannot block the stream.

Projection is off the call path but shares its CPUs: after a batch that did not fill, the
projector waits `projection_interval_s` before the next fetch, so the events of the calls in
between are projected in one transaction instead of one wake-up each (rows lag by about that
interval more; under a backlog batches fill and there is no wait).
"""

from __future__ import annotations

import asyncio
import os
import contextlib
import time

import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from talaria.services.telemetry.session_spans import SessionSpans
from talaria.services.telemetry.store import EventRefused, PoisonEvent, PostgresStore, TelemetryStore
from talaria.shared.nats_auth import sender_of, trusted
from talaria.shared import logs, metrics, tracing
from talaria.shared.metrics import TelemetryMetrics
from talaria.shared.health import heartbeat_loop
from talaria.shared.bus import BUS_ERRORS, ACK_WAIT_S, close, connect
from talaria.shared.db.connection import create_engine
from talaria.shared.events import EVENT_DECODER
from talaria.shared.settings import CommonSettings, Settings, TelemetrySettings
from talaria.shared.subjects import Deployment

DURABLE = "telemetry"
BATCH = 256


def _exporter(common: CommonSettings):
    if common.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    return tracing.JsonLinesExporter(common.traces_path / f"telemetry-{os.getpid()}.jsonl")


async def run(settings: Settings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    await serve(settings.common, settings.telemetry, ready, stop or asyncio.Event())


async def serve(common: CommonSettings, settings: TelemetrySettings, ready: asyncio.Event | None,
                stop: asyncio.Event) -> None:
    log = logs.get("telemetry")
    deployment = common.deployment
    store = PostgresStore(create_engine(common.database_url))
    nc, js = await connect(common.nats_url, "talaria-telemetry", **common.bus_options())
    spans = SessionSpans(_exporter(common), settings.session_idle_s)
    meter = TelemetryMetrics()
    metrics_runner = await metrics.serve(meter, "telemetry", common, log)
    offset = await store.offset()
    await _ensure_consumer(js, deployment, log)
    sub = await js.pull_subscribe(deployment.events_wildcard, durable=DURABLE, stream=deployment.events_stream)
    beat = asyncio.create_task(heartbeat_loop(nc, "telemetry", stop))
    log.info("telemetry ready", offset=offset)
    if ready is not None:
        ready.set()
    try:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(BATCH, timeout=0.5)
            except asyncio.TimeoutError:
                await _flush_spans(spans, time.time())
                continue
            except BUS_ERRORS as exc:
                log.warning("fetch failed", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            if not msgs:
                continue
            offset = await _apply_until_committed(store, msgs, offset, spans, log, stop)
            if offset is None:
                break  # stopping with the batch uncommitted: it is redelivered on restart
            meter.committed(msgs)
            for msg in msgs:  # only now that the batch is durable
                await msg.ack()
            await _flush_spans(spans, time.time())
            if len(msgs) < BATCH and settings.projection_interval_s > 0:
                with contextlib.suppress(TimeoutError):  # let the next batch gather
                    await asyncio.wait_for(stop.wait(), settings.projection_interval_s)
    finally:
        await asyncio.get_running_loop().run_in_executor(None, lambda: spans.flush(time.time(), all_sessions=True))
        beat.cancel()
        await close(nc)
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await store.close()


async def _flush_spans(spans: SessionSpans, now: float) -> None:
    # Exporting may block on a slow collector: keep it off the event loop.
    await asyncio.get_running_loop().run_in_executor(None, spans.flush, now)


async def _apply_until_committed(store: TelemetryStore, msgs, offset: int, spans: SessionSpans, log, stop) -> int | None:
    """Apply one batch, retrying the same batch until it commits (Postgres may be down):
    moving on would let a later commit's offset skip these events for good."""
    delay = 0.5
    while True:
        try:
            return await _apply_batch(store, msgs, offset, spans, log)
        except Exception as exc:
            log.error("projection failed; retrying the same batch", error=str(exc), events=len(msgs))
            for msg in msgs:
                try:
                    await msg.in_progress()  # keep the batch ours while we wait
                except BUS_ERRORS:
                    pass
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return None
            except TimeoutError:
                delay = min(delay * 2, 10.0)


async def _ensure_consumer(js, deployment: Deployment, log) -> None:
    """The durable consumer, with explicit acks, resuming right after its ack floor.

    Events a killed predecessor had fetched but not acked would come back only after
    `ack_wait`; recreating the consumer from its ack floor delivers them at once (those
    acked above the floor come again too, which idempotent projections absorb). A consumer
    left by an older version with AckPolicy.ALL (acking a later event silently acknowledged
    earlier ones still in flight, losing them after a crash) is replaced the same way."""
    config = ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                            ack_wait=ACK_WAIT_S, max_ack_pending=10_000, filter_subject=deployment.events_wildcard)
    try:
        info = await js.consumer_info(deployment.events_stream, DURABLE)
    except NotFoundError:
        info = None
    if info is not None and info.config.ack_policy == AckPolicy.EXPLICIT and not info.num_ack_pending:
        return
    if info is not None:
        start = info.ack_floor.stream_seq + 1
        log.warning("resuming the telemetry consumer after its ack floor", resume_at=start,
                    unacked=info.num_ack_pending, ack_policy=str(info.config.ack_policy))
        await js.delete_consumer(deployment.events_stream, DURABLE)
        config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, start
    await js.add_consumer(deployment.events_stream, config=config)


async def _apply_batch(store: TelemetryStore, msgs, offset: int, spans: SessionSpans, log) -> int:
    """Project every event of the batch (redelivered ones too: projections are idempotent)
    in one durable unit; returns the highest stream sequence seen. The batch is first applied
    without isolating each event (cheap); only if an event fails is it applied again, each
    event on its own savepoint, so the culprit is quarantined and the rest commit."""
    try:
        return await _project_batch(store, msgs, offset, spans, log, isolate=False)
    except EventRefused as exc:
        log.warning("an event of the batch failed; applying it again event by event", error=str(exc)[:300])
        return await _project_batch(store, msgs, offset, spans, log, isolate=True)


async def _project_batch(store: TelemetryStore, msgs, offset: int, spans: SessionSpans, log, isolate: bool) -> int:
    observed = []
    async with store.batch(isolate) as batch:
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            offset = max(offset, seq)
            try:
                event = EVENT_DECODER.decode(msg.data)
            except msgspec.DecodeError as exc:
                await _quarantine(batch, log, msg, seq, f"undecodable: {exc}")
                continue
            if not trusted(msg, event):  # only an event's owning service may write its row
                log.error("event from a service that does not own it skipped", seq=seq, subject=msg.subject,
                          sender=sender_of(msg), event_type=type(event).__name__)
                batch.cover(seq)
                continue
            try:
                new = await batch.project(event, seq)
            except PoisonEvent as exc:
                await _quarantine(batch, log, msg, seq, str(exc))
                continue
            if new:
                observed.append(event)
    for event in observed:  # only once the batch is committed
        spans.observe(event)
    return offset


async def _quarantine(batch, log, msg, seq: int, error: str) -> None:
    """Record a poison event and move past it; an operator replays or drops it."""
    log.error("ALERT: poison event quarantined", alert=True, seq=seq, subject=msg.subject,
              error=error.replace("\x00", "\\x00")[:300])
    await batch.quarantine(seq, msg.subject, error, bytes(msg.data))
