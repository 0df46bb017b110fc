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

from services.telemetry.projector import project
from services.telemetry.sessions import SessionSpans
from shared import logs, subjects, tracing
from shared.health import heartbeat_loop
from shared.bus import close, connect
from shared.db.engine import create_engine
from shared.db.schema import projections
from shared.messages import EVENT_DECODER
from shared.settings import Settings

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
    nc, js = await connect(settings.nats_url, "talaria-telemetry")
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
                spans.flush(time.time())
                continue
            except Exception as exc:
                log.warning("fetch failed", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            if not msgs:
                continue
            try:
                offset = await _apply_batch(db, msgs, offset, spans, log)
            except Exception as exc:  # Postgres unavailable: leave unacked, redelivered later
                log.error("projection failed; will retry", error=str(exc))
                await asyncio.sleep(1.0)
                continue
            await msgs[-1].ack()  # AckPolicy.ALL: acknowledges the whole batch
            spans.flush(time.time())
    finally:
        spans.flush(time.time(), all_sessions=True)
        beat.cancel()
        await close(nc)
        await db.dispose()


async def _apply_batch(db, msgs, offset: int, spans: SessionSpans, log) -> int:
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
            await project(conn, event, seq)
            spans.observe(event)
            offset = seq
        values = dict(name=NAME, seq=offset, saved_at=dt.datetime.now(dt.timezone.utc))
        await conn.execute(insert(projections).values(**values).on_conflict_do_update(
            index_elements=[projections.c.name], set_=values))
    return offset
