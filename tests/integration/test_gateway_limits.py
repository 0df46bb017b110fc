"""Issue 25 items 4 and 7: the gateway's HTTP server under a slowloris flood, slow bodies and
malformed credentials (a real gateway on a real NATS; raw sockets stand in for the attacker)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from talaria.embedded import free_port
from talaria.services.gateway.gateway_service import run as run_gateway
from talaria.shared.settings import Settings
from tests.integration.harness import Services

pytestmark = pytest.mark.integration
KEY = "acme-key-0123456789"
PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "  # a header never finished


@pytest.fixture
async def gateway(nats_url, database_url, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                        api_keys=(f"acme:{KEY}",), http_header_timeout_s=1.0, http_body_timeout_s=1.0,
                        http_max_connections=8, http_max_connections_per_address=4)
    services = Services()
    await services.start("gateway", run_gateway, settings)
    yield settings
    await services.close()


async def raw(settings, data: bytes, source: str = "127.0.0.1"):
    reader, writer = await asyncio.open_connection("127.0.0.1", settings.gateway.http_port, local_addr=(source, 0))
    writer.write(data)
    await writer.drain()
    return reader, writer


async def models(settings, source: str) -> int:
    connector = aiohttp.TCPConnector(local_addr=(source, 0))
    async with aiohttp.ClientSession(connector=connector) as s:
        async with s.get(f"http://127.0.0.1:{settings.gateway.http_port}/v1/models",
                         headers={"Authorization": f"Bearer {KEY}"}) as r:
            return r.status


async def test_a_slowloris_flood_holds_only_its_own_addresss_share_and_times_out(gateway):
    settings = gateway
    slow = [await raw(settings, PARTIAL) for _ in range(4)]
    # Its address is at its limit: the next connection is refused at once, clearly.
    reader, _ = await raw(settings, PARTIAL)
    refused = await asyncio.wait_for(reader.read(), 5)
    assert refused.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in refused, refused
    # Another client is served meanwhile.
    assert await asyncio.wait_for(models(settings, "127.0.0.2"), 5) == 200
    # The unfinished headers are cut off at the header deadline (408, closed).
    for reader, writer in slow:
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        writer.close()
    assert await asyncio.wait_for(models(settings, "127.0.0.1"), 5) == 200  # its share is free again


async def test_the_overall_connection_limit_refuses_with_503(gateway):
    settings = gateway
    held = [await raw(settings, PARTIAL, f"127.0.0.{2 + i // 4}") for i in range(8)]
    reader, _ = await raw(settings, PARTIAL, "127.0.0.9")
    assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 503")
    for _, writer in held:
        writer.close()


async def test_a_body_that_does_not_arrive_in_time_is_a_408(gateway):
    settings = gateway
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"").encode()
    reader, writer = await raw(settings, head)
    answer = await asyncio.wait_for(reader.read(4096), 5)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
    writer.close()


async def test_invalid_utf8_or_a_non_bearer_authorization_is_a_401(gateway):
    settings = gateway
    for auth in (b"Bearer \xff\xfe-not-utf8", b"Basic dXNlcjpwYXNz", b"\xff"):
        reader, writer = await raw(settings, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                             b"Authorization: " + auth + b"\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 401"), (auth, answer[:200])
        writer.close()


async def test_a_large_body_whose_call_outlasts_the_header_deadline_is_answered_not_cut(nats_url, database_url,
                                                                                        tmp_path):
    # The header deadline ends once a request's header is in: body bytes that arrive as its
    # handler starts must not arm it again (they did: a long prompt got a 408 mid-call).
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                           api_keys=(f"acme:{KEY}",), http_header_timeout_s=1.0, call_timeout_s=3.0)
    services = Services()
    await services.start("gateway", run_gateway, settings)  # no router: the call waits for its deadline
    try:
        body = {"model": "qwen3-tiny", "max_tokens": 2,
                "messages": [{"role": "user", "content": "word " * 60_000}]}  # 300 KB: parsed in the worker
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {KEY}"}) as r:
                    answer = await r.json()
                    assert r.status == 504 and answer["error"]["code"] == "timeout", (r.status, answer)
    finally:
        await services.close()
