"""Telemetry service: a durable consumer on talaria.evt.> projecting into Postgres.

Each fetched batch is applied in one transaction together with the new stream
offset, and acknowledged after commit: at-least-once delivery, exactly-once effect.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert

from talaria.services.telemetry.projector import project
from talaria.services.telemetry.sessions import SessionSpans
from talaria.shared.nats_auth import sender_of, trusted
from talaria.shared import logs, subjects, tracing
from talaria.shared.health import heartbeat_loop
from talaria.shared.bus import close, connect
from talaria.shared.db.engine import create_engine
from talaria.shared.db.schema import projections
from talaria.shared.messages import EVENT_DECODER
from talaria.shared.settings import Settings

DURABLE = "telemetry"
NAME = "telemetry"
BATCH = 256


def _exporter(settings: Settings):
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    import os

    return tracing.JsonLinesExporter(settings.traces_path / f"telemetry-{os.getpid()}.jsonl")


async def run(settings: Settings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    log = logs.get("telemetry")
    stop = stop or asyncio.Event()
    db = create_engine(settings.database_url)
    nc, js = await connect(settings.nats_url, "talaria-telemetry", **settings.nats_options())
    spans = SessionSpans(_exporter(settings), settings.session_idle_s)
    async with db.connect() as conn:
        row = (await conn.execute(select(projections.c.seq).where(projections.c.name == NAME))).first()
    offset = row.seq if row else 0
    sub = await js.pull_subscribe(
        subjects.EVENTS_WILDCARD, durable=DURABLE, stream=subjects.EVENTS_STREAM,
        config=ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.ALL, deliver_policy=DeliverPolicy.ALL,
                              ack_wait=30, max_ack_pending=10_000),
    )
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
            except Exception as exc:
                log.warning("fetch failed", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            if not msgs:
                continue
            offset = await _apply_until_committed(db, msgs, offset, spans, log, stop)
            if offset is None:
                break  # stopping with the batch uncommitted: it is redelivered on restart
            await msgs[-1].ack()  # AckPolicy.ALL: acknowledges the whole batch
            await _flush_spans(spans, time.time())
    finally:
        await asyncio.get_running_loop().run_in_executor(None, lambda: spans.flush(time.time(), all_sessions=True))
        beat.cancel()
        await close(nc)
        await db.dispose()


async def _flush_spans(spans: SessionSpans, now: float) -> None:
    # Exporting may block on a slow collector: keep it off the event loop.
    await asyncio.get_running_loop().run_in_executor(None, spans.flush, now)


async def _apply_until_committed(db, msgs, offset: int, spans: SessionSpans, log, stop) -> int | None:
    """Apply one batch, retrying the same batch until it commits (Postgres may be down):
    moving on would let a later commit's offset skip these events for good."""
    delay = 0.5
    while True:
        try:
            return await _apply_batch(db, msgs, offset, spans, log)
        except Exception as exc:
            log.error("projection failed; retrying the same batch", error=str(exc), events=len(msgs))
            for msg in msgs:
                try:
                    await msg.in_progress()  # keep the batch ours while we wait
                except Exception:
                    pass
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return None
            except TimeoutError:
                delay = min(delay * 2, 10.0)


async def _apply_batch(db, msgs, offset: int, spans: SessionSpans, log) -> int:
    observed = []
    async with db.begin() as conn:
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if seq <= offset:
                continue  # already projected before a restart
            try:
                event = EVENT_DECODER.decode(msg.data)
            except msgspec.DecodeError as exc:
                log.error("undecodable event skipped", seq=seq, subject=msg.subject, error=str(exc))
                offset = seq
                continue
            if not trusted(msg, event):  # only an event's owning service may write its row
                log.error("event from a service that does not own it skipped", seq=seq, subject=msg.subject,
                          sender=sender_of(msg), event_type=type(event).__name__)
                offset = seq
                continue
            try:
                async with conn.begin_nested():  # a savepoint: one bad event cannot sink the batch
                    await project(conn, event, seq)
            except Exception as exc:
                if not _is_data_error(exc):
                    raise  # connection trouble: retry the whole batch
                log.error("event could not be projected; skipped", seq=seq, subject=msg.subject, error=str(exc))
            observed.append(event)
            offset = seq
        values = dict(name=NAME, seq=offset, saved_at=dt.datetime.now(dt.timezone.utc))
        await conn.execute(insert(projections).values(**values).on_conflict_do_update(
            index_elements=[projections.c.name], set_=values))
    for event in observed:  # only once the batch is committed
        spans.observe(event)
    return offset


def _is_data_error(exc: Exception) -> bool:
    from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError

    return isinstance(exc, (DataError, IntegrityError, ProgrammingError))
