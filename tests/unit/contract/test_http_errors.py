"""An exception no handler caught is answered as JSON (services/gateway/http_errors.py), never
aiohttp's plain-text 500; a full disk's OSError is a 503 with Retry-After."""

from __future__ import annotations

import contextlib
import errno

import aiohttp
from aiohttp import web

from talaria.embedded import free_port
from talaria.services.gateway.http_errors import json_errors


async def answer(exc: BaseException, path: str = "/v1/chat/completions") -> tuple[int, dict, dict]:
    async def handler(request):
        raise exc

    app = web.Application(middlewares=[json_errors])
    app.router.add_post(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}{path}") as r:
            return r.status, dict(r.headers), await r.json()
    finally:
        await runner.cleanup()


async def test_a_full_disk_is_a_json_503_with_retry_after():
    status, headers, body = await answer(OSError(errno.ENOSPC, "No space left on device"))
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "insufficient_storage" and "No space left" in body["error"]["message"]


async def test_any_other_error_is_a_json_500_in_the_paths_shape():
    status, _, body = await answer(ValueError("a bug"))
    assert status == 500 and body["error"]["code"] == "internal_error"
    status, _, body = await answer(KeyError("x"), "/v1/messages")
    assert status == 500 and body["type"] == "error" and body["error"]["type"] == "api_error"


def test_readiness_stays_red_from_an_unanswered_call_until_one_is_answered():
    from talaria.services.gateway.call_flow import CallFlow

    flow = CallFlow()
    assert flow.problem() is None
    flow.stalled("no reply within 30s", now=10.0)
    assert "no reply within 30s" in flow.problem()
    flow.answered(now=9.0)  # a reply from before the stall says nothing of now
    assert flow.problem() is not None
    flow.answered(now=11.0)
    assert flow.problem() is None


def test_a_log_line_that_cannot_be_written_is_dropped_not_raised():
    from talaria.shared.logs import SparingPrintLogger

    full = open("/dev/full", "w")
    before = SparingPrintLogger.dropped
    SparingPrintLogger(full).info("a line")  # ENOSPC on flush
    assert SparingPrintLogger.dropped == before + 1
    with contextlib.suppress(OSError):  # what is still buffered fails once more
        full.close()


async def test_a_client_gone_mid_answer_is_not_answered_as_a_system_error():
    import pytest

    from talaria.services.gateway.http_errors import json_errors as middleware

    async def handler(request):
        raise ConnectionResetError("peer gone")

    with pytest.raises(ConnectionResetError):
        await middleware(type("R", (), {"path": "/v1/chat/completions", "method": "POST"})(), handler)
