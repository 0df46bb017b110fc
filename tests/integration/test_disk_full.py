"""A full disk under load (a real gateway, router and agent on real NATS and Postgres): the
log file's disk refusing writes never turns a call into aiohttp's plain-text 500; the data
disk filling (a 4 MiB tmpfs where we may mount one) refuses new calls with a JSON 503 and
Retry-After; and readiness stays red after an unanswered call until a call is answered."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time

import aiohttp
import nats
import pytest
import structlog

from talaria.embedded import free_port
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.services.router.router_service import run as run_router
from talaria.shared.health import wait_for_router
from talaria.shared import logs
from talaria.shared.settings import Settings
from tests.integration.harness import Services, wait_until

pytestmark = pytest.mark.integration
MODEL = "qwen3-tiny"


@contextlib.contextmanager
def logs_to(path: str):
    """Every log line of every service in this process goes to `path` (as `talaria up` sends a
    service's output to its log file), restored after."""
    sink, old = open(path, "w"), structlog.get_config()
    logs.configure("test", file=sink)  # as each service's __main__ configures its logs
    try:
        yield
    finally:
        structlog.configure(**old)
        with contextlib.suppress(OSError):  # what is still buffered fails once more
            sink.close()


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A tiny filesystem of its own at `path`; skips the test where mounting is not allowed."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


TOOK: dict[str, float] = {}  # the longest call of each test, printed for results/faults.md


async def chat(s: aiohttp.ClientSession, base: str, session: str, timeout: float = 60.0):
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello {session}"}], "max_tokens": 4,
            "temperature": 0}
    start = time.monotonic()
    async with s.post(f"{base}/v1/chat/completions", json=body, headers={"X-Session-Id": session},
                      timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        answer = r.status, r.headers.get("Content-Type", ""), r.headers.get("Retry-After"), await r.text()
    TOOK["longest"] = max(TOOK.get("longest", 0.0), time.monotonic() - start)
    return answer


async def ready(s: aiohttp.ClientSession, base: str) -> dict:
    async with s.get(f"{base}/readyz") as r:
        return {**(await r.json()), "http": r.status}


async def stack(settings: Settings, gateway_data=None) -> Services:
    """Telemetry, router, gateway (its data directory `gateway_data` if given) and one agent."""
    from talaria.services.gateway.gateway_service import run as run_gateway
    from talaria.services.telemetry.telemetry_service import run as run_telemetry

    services = Services()
    await services.start("telemetry", run_telemetry, settings)
    await services.start("router", run_router, settings)
    await services.start("gateway", run_gateway, settings.with_(data_dir=gateway_data or settings.common.data_dir))
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0"))
    nc = await nats.connect(settings.common.nats_url)
    await wait_for_router(nc, instances=1)
    await nc.close()
    return services


async def test_a_full_log_disk_under_load_never_gives_a_plain_text_500(nats_url, database_url, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                           call_timeout_s=60, models=(MODEL,), projection_interval_s=0.0)
    base = f"http://127.0.0.1:{settings.gateway.http_port}"
    with logs_to("/dev/full"):  # every write: ENOSPC, as on a full disk; services bind their loggers at start
        services = await stack(settings)
        try:
            async with aiohttp.ClientSession() as s:
                answers = await asyncio.gather(*(chat(s, base, f"full-{i}") for i in range(12)))
        finally:
            await services.close()
    print(f"\nlog disk full: {sum(a[0] == 200 for a in answers)}/{len(answers)} answered, "
          f"longest call {TOOK.pop('longest'):.2f} s")
    for status, ctype, _, text in answers:
        assert status == 200 and ctype.startswith("application/json"), (status, text[:200])


async def test_a_full_data_disk_refuses_with_json_503_and_readiness_follows(nats_url, database_url, tmp_path):
    with tmpfs(tmp_path / "small", "4m") as data:  # the gateway's data disk; the agent's weights stay apart
        settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                               call_timeout_s=60, models=(MODEL,), projection_interval_s=0.0)
        services = await stack(settings, gateway_data=data)
        base = f"http://127.0.0.1:{settings.gateway.http_port}"
        filler = data / "filler"
        try:
            async with aiohttp.ClientSession() as s:
                assert (await chat(s, base, "before"))[0] == 200
                with open(filler, "wb") as f, contextlib.suppress(OSError):
                    while True:  # until the disk itself says ENOSPC
                        f.write(b"\0" * 65536)
                        f.flush()
                TOOK.pop("longest", None)
                refused = await asyncio.gather(*(chat(s, base, f"full-{i}") for i in range(8)))
                print(f"\ndata disk full: {sum(r[0] == 503 for r in refused)}/{len(refused)} refused 503, "
                      f"longest {TOOK['longest']:.2f} s")
                for status, ctype, retry, text in refused:
                    assert status == 503 and ctype.startswith("application/json") and retry, (status, text)
                    assert "insufficient_storage" in text
                report = await ready(s, base)
                assert report["http"] == 503 and report["checks"]["disk"] != "ok", report
                filler.unlink()
                # Space is back, but no call has been answered since the refusals: still red.
                report = await ready(s, base)
                assert report["http"] == 503 and report["checks"]["disk"] == "ok", report
                assert report["checks"]["calls"] != "ok", report
                assert (await chat(s, base, "after"))[0] == 200
                assert (await ready(s, base))["http"] == 200
        finally:
            await services.close()


async def test_readiness_stays_red_after_an_unanswered_call_until_one_is_answered(nats_url, database_url,
                                                                                  tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, http_port=free_port(),
                           call_timeout_s=3, models=(MODEL,), projection_interval_s=0.0)
    services = await stack(settings)
    base = f"http://127.0.0.1:{settings.gateway.http_port}"
    try:
        async with aiohttp.ClientSession() as s:
            assert (await chat(s, base, "first"))[0] == 200
            router = next(r for r in services.running if r.name == "router")
            await router.close()  # nothing places calls: they go unanswered
            services.running.remove(router)
            started = time.monotonic()
            status, ctype, _, text = await chat(s, base, "lost")
            assert status == 504 and ctype.startswith("application/json"), text
            assert time.monotonic() - started < 3 + 1.0  # no call outlives its deadline
            await services.start("router", run_router, settings)
            nc = await nats.connect(settings.common.nats_url)
            await wait_for_router(nc, instances=1)  # every dependency's heartbeat is back...
            await nc.close()
            report = await ready(s, base)  # ...yet no call was answered since the lost one
            assert report["http"] == 503 and report["checks"]["calls"] != "ok", report

            async def flowing():
                return (await chat(s, base, "again"))[0] == 200
            await wait_until(flowing, "a call answered after the router's restart", timeout=30)
            assert (await ready(s, base))["http"] == 200
    finally:
        await services.close()
