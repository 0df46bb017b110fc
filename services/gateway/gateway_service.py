"""Gateway service: HTTP + NATS APIs over one Submitter; tracks which models are served."""

from __future__ import annotations

import asyncio
import time

import msgspec
from aiohttp import web

from talaria.services.gateway import big_bodies
from talaria.services.gateway.admission import Admission, DiskCheck, default_min_free_bytes
from talaria.services.gateway.auth import KeyStore
from talaria.services.gateway.connection_limits import GuardedRunner, HttpLimits
from talaria.services.gateway.http_api import HttpApi, parse_request
from talaria.services.gateway.idempotency import IdempotentCalls
from talaria.services.gateway.nats_api import NatsApi
from talaria.services.gateway.session_inference import SessionIndex
from talaria.services.gateway.session_inferrer import SessionInferrer
from talaria.services.gateway.submitter import Submitter
from talaria.shared import logs, tracing
from talaria.shared.bus import close, connect
from talaria.shared.metrics import FrontendMetrics, handler as metrics_handler, serve as metrics_serve
from talaria.shared.snapshots import HEARTBEAT_DECODER, InstanceSnapshot, SNAPSHOT_DECODER
from talaria.shared.settings import CommonSettings, GatewaySettings, Settings

STALE_AFTER_S = 3.0
# An agent silent this long is forgotten (agents restart under new ids: one stale snapshot per
# restart was kept for the gateway's life; a stale one counts for nothing already).
FORGET_AFTER_S = 10 * STALE_AFTER_S


class ServedModels:
    """Which models live instances serve, from their telemetry heartbeats."""

    def __init__(self, configured: tuple[str, ...] = (), nats_connected=lambda: True,
                 disk_problem=lambda: None, flow_problem=lambda: None, on_rates=lambda model, tok_s, ctx2=0.0, measured=True: None) -> None:
        self._on_rates = on_rates  # a snapshot's measured prefill rate (admission prices work with it)
        self._disk_problem = disk_problem  # why new calls are refused for lack of disk, or None
        self._flow_problem = flow_problem  # why calls are not answered (call_flow.py), or None
        self._snapshots: dict[str, tuple[float, InstanceSnapshot]] = {}
        self._services: dict[str, float] = {}
        self.configured = tuple(configured)  # models the stack is configured to serve
        self._nats_connected = nats_connected

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

    def readiness(self) -> tuple[bool, dict[str, object]]:
        """(ready, report). Ready: NATS connected, the router alive, and at least one live
        instance serving each configured model, room on disk, and no call unanswered since the
        last answered one (call_flow.py). Telemetry is reported, not required: calls
        are served without it and its projection catches up from the stream."""
        health = self.health()
        by_model: dict[str, list[str]] = {m: [] for m in self.configured}
        now = time.monotonic()
        for iid, (seen, snap) in sorted(self._snapshots.items()):
            if now - seen <= STALE_AFTER_S:
                for m in snap.models:
                    by_model.setdefault(m.model, []).append(iid)
        checks = {
            "nats": "ok" if self._nats_connected() else "disconnected",
            "router": "ok" if "router" in health["services"] else "no heartbeat",
            "telemetry": "ok" if "telemetry" in health["services"] else "no heartbeat",
            "disk": self._disk_problem() or "ok",
            "calls": self._flow_problem() or "ok",
            **{f"model:{m}": "ok" if by_model.get(m) else "no instance" for m in self.configured},
        }
        ready = all(v == "ok" for k, v in checks.items() if k != "telemetry")
        return ready, {"status": "ok" if ready else "not_ready", "checks": checks, "models": by_model, **health}

    async def on_snapshot(self, msg) -> None:
        try:
            snap = SNAPSHOT_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        now = time.monotonic()
        self._snapshots[snap.instance_id] = (now, snap)
        self._on_rates(snap.active_model, snap.prefill_tok_s, snap.prefill_ctx_s_per_tok2, snap.prefill_ctx_measured)
        for gone in [i for i, (seen, _) in self._snapshots.items() if now - seen > FORGET_AFTER_S]:
            del self._snapshots[gone]

    def __call__(self) -> list[tuple[str, str]]:
        now = time.monotonic()
        served: dict[str, str] = {}
        for seen, snap in self._snapshots.values():
            if now - seen <= STALE_AFTER_S:
                for m in snap.models:
                    served.setdefault(m.model, "talaria")
        return sorted(served.items())


async def run(settings: Settings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    await serve(settings.common, settings.gateway, ready, stop or asyncio.Event())


async def serve(common: CommonSettings, settings: GatewaySettings, ready: asyncio.Event | None,
                stop: asyncio.Event) -> None:
    log = logs.get("gateway")
    catalogue = common.catalogue()  # the models requests may name; the parser worker gets it with each body
    provider = tracing.setup("gateway", common)
    tracer = provider.get_tracer("talaria.gateway")
    recovering: list[Submitter] = []

    async def reconnected() -> None:  # replies published while we were cut off are kept: look them up
        for sub in recovering:
            asyncio.ensure_future(sub.recover())

    nc, js = await connect(common.nats_url, "talaria-gateway", reconnected_cb=reconnected, **common.bus_options())
    common.data_dir.mkdir(parents=True, exist_ok=True)
    disk = DiskCheck(common.data_dir, settings.min_free_disk_mb << 20 or default_min_free_bytes(common.data_dir))
    admission = Admission(settings.admission_target_queue_s) if settings.admission_target_queue_s > 0 else None
    metrics = FrontendMetrics()
    sessions = None  # TALARIA_SESSION_INFERENCE_HORIZON_S=0: a call naming no session is its own
    if settings.session_inference_horizon_s > 0:
        sessions = SessionInferrer(catalogue, settings.prefix_sharing, metrics,
                                   SessionIndex(horizon_s=settings.session_inference_horizon_s))
    submitter = Submitter(nc, js, tracer, settings.call_timeout_s, log, admission, disk, metrics=metrics,
                          sessions=sessions)
    recovering.append(submitter)
    await submitter.start()
    idempotency = IdempotentCalls(submitter, settings.idempotency_window_s, settings.idempotent_orphan_s)
    await idempotency.start()
    served = ServedModels(common.models, lambda: nc.is_connected, disk.problem, submitter.flow.problem,
                          admission.rates.observe_engine if admission is not None
                          else lambda model, tok_s, ctx2=0.0, measured=True: None)
    if admission is not None:  # work-fair shares are shares of the live instances
        admission.instances = lambda: max(1, len(served.health()["instances"]))
    await nc.subscribe(common.deployment.telemetry_wildcard, cb=served.on_snapshot)
    await nc.subscribe(common.deployment.health_wildcard, cb=served.on_heartbeat)
    keys = KeyStore.from_settings(settings)
    if not keys.enabled:
        log.warning("no API keys configured: the gateway is open to anyone who can reach it")
    nats_api = NatsApi(nc, submitter, catalogue, log, keys, settings.prefix_sharing, idempotency)
    await nats_api.start()
    # handler_cancellation: a client that disconnects cancels its handler, which cancels the call.
    # One worker process parses large bodies: they queue among themselves, not on the loop.
    parser_pool = big_bodies.parser_pool()
    await asyncio.get_running_loop().run_in_executor(parser_pool, int)  # start it now, not on a call
    # ... and have it import the parser and load each model's tokenizer (~1 s here) before the
    # first big body, whose refusal must come within 1 s (issue 37); not awaited.
    for model in common.models:
        body = msgspec.json.encode({"model": model, "messages": [{"role": "user", "content": "warm"}]})
        parser_pool.submit(parse_request, catalogue, body, True, {}, "", settings.prefix_sharing)
    limits = HttpLimits.from_settings(settings)
    api = HttpApi(submitter, served, catalogue, log, keys, settings.prefix_sharing, parser_pool, idempotency,
                  body_timeout_s=limits.body_timeout_s)
    app = api.app()
    app.middlewares.insert(0, metrics.http_middleware())  # outermost: 401s and 4xx counted too
    app.router.add_get("/metrics", metrics_handler(metrics))  # on the API port: behind a key (auth.py)
    metrics_runner = await metrics_serve(metrics, "gateway", common, log)  # open, on its own listener
    # Connections counted per client address and overall, headers held to a deadline.
    runner = GuardedRunner(app, limits, log, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, settings.http_host, settings.http_port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else settings.http_port
    log.info("gateway listening", url=f"http://{settings.http_host}:{port}")
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await submitter.stop()  # first: calls still waiting get a 503 now, not at their timeout
        await nats_api.stop()
        await runner.cleanup()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await idempotency.stop()  # after the handlers: the keyed calls they were waiting for run on
        parser_pool.shutdown(wait=False, cancel_futures=True)
        await close(nc)
        provider.shutdown()
