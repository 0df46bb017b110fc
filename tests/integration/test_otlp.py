"""With OTEL_EXPORTER_OTLP_ENDPOINT set, spans go over OTLP/HTTP (to a local receiver here)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from talaria.services.gateway.gateway_service import run as run_gateway
from talaria.services.router.router_service import run as run_router
from talaria.shared.settings import Settings
from talaria.embedded import free_port
from tests.integration.harness import Services

pytestmark = pytest.mark.integration


async def test_call_spans_are_exported_over_otlp(nats_url, database_url, tmp_path, monkeypatch):
    received: list[bytes] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        received.append(await request.read())
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        otlp_endpoint=endpoint)
    services = Services()
    try:
        await services.start("router", run_router, settings)
        await services.start("gateway", run_gateway, settings)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/completions",
                              json={"model": "qwen3-tiny", "prompt": "x", "max_tokens": 2},
                              headers={"X-Session-Id": "otlp-session"}) as r:
                assert r.status == 503  # no agents: the span still records the rejected call
    finally:
        await services.close()  # shutting the tracer provider down flushes the batch
        await runner.cleanup()
    body = b"".join(received)
    assert b"otlp-session" in body and b"text_completion qwen3-tiny" in body
    assert not (tmp_path / "traces").exists()  # nothing written locally when OTLP is on
