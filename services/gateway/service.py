"""Gateway service: HTTP + NATS APIs over one Submitter; tracks which models are served."""

from __future__ import annotations

import asyncio
import time

import msgspec
from aiohttp import web

from talaria.services.gateway.auth import KeyStore
from talaria.services.gateway.http_api import HttpApi
from talaria.services.gateway.nats_api import NatsApi
from talaria.services.gateway.submitter import Submitter
from talaria.shared import logs, subjects, tracing
from talaria.shared.bus import close, connect
from talaria.shared.messages import HEARTBEAT_DECODER, SNAPSHOT_DECODER, InstanceSnapshot
from talaria.shared.settings import Settings

STALE_AFTER_S = 3.0


class ServedModels:
    """Which models live instances serve, from their telemetry heartbeats."""

    def __init__(self) -> None:
        self._snapshots: dict[str, tuple[float, InstanceSnapshot]] = {}
        self._services: dict[str, float] = {}

    async def on_heartbeat(self, msg) -> None:
        try:
            beat = HEARTBEAT_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        self._services[beat.service] = time.monotonic()

    def health(self) -> dict[str, object]:
        now = time.monotonic()
        live = sorted(s for s, seen in self._services.items() if now - seen <= STALE_AFTER_S)
        agents = sorted(i for i, (seen, _) in self._snapshots.items() if now - seen <= STALE_AFTER_S)
        return {"services": live, "instances": agents}

    async def on_snapshot(self, msg) -> None:
        try:
            snap = SNAPSHOT_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        self._snapshots[snap.instance_id] = (time.monotonic(), snap)

    def __call__(self) -> list[tuple[str, str]]:
        now = time.monotonic()
        served: dict[str, str] = {}
        for seen, snap in self._snapshots.values():
            if now - seen <= STALE_AFTER_S:
                for m in snap.models:
                    served.setdefault(m.model, "talaria")
        return sorted(served.items())


async def run(settings: Settings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    log = logs.get("gateway")
    provider = tracing.setup("gateway", settings)
    tracer = provider.get_tracer("talaria.gateway")
    nc, js = await connect(settings.nats_url, "talaria-gateway", **settings.nats_options())
    submitter = Submitter(nc, js, tracer, settings.call_timeout_s, log)
    await submitter.start()
    served = ServedModels()
    await nc.subscribe(subjects.TELEMETRY_WILDCARD, cb=served.on_snapshot)
    await nc.subscribe(subjects.HEALTH_WILDCARD, cb=served.on_heartbeat)
    keys = KeyStore.from_settings(settings)
    if not keys.enabled:
        log.warning("no API keys configured: the gateway is open to anyone who can reach it")
    nats_api = NatsApi(nc, submitter, log, keys, settings.prefix_sharing)
    await nats_api.start()
    runner = web.AppRunner(HttpApi(submitter, served, log, keys, settings.prefix_sharing).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.http_host, settings.http_port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else settings.http_port
    log.info("gateway listening", url=f"http://{settings.http_host}:{port}")
    if ready is not None:
        ready.set()
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await submitter.stop()  # first: calls still waiting get a 503 now, not at their timeout
        await nats_api.stop()
        await runner.cleanup()
        await close(nc)
        provider.shutdown()
