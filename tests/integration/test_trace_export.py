"""End to end: a live agent session's `calls` rows export as a trace that the simulator
replays with the same number of calls (talaria trace export -> talaria sim run --trace)."""

from __future__ import annotations

import json

import aiohttp
import nats
import pytest

from talaria.embedded import free_port
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from talaria.sim.cli import main as sim_main
from talaria.trace_export import fetch_rows, rows_to_sessions
from talaria.traces.format import save_sessions
from talaria.traces.load import load_trace
from tests.integration.harness import Services, wait_rows

pytestmark = pytest.mark.integration


async def test_a_live_session_exports_and_replays_with_the_same_call_count(nats_url, database_url, db, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                        http_port=free_port(), session_idle_s=3600, call_timeout_s=60)
    services = Services()
    try:
        await services.start_control_plane(settings)
        await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0", models=("qwen3-tiny",)))
        nc = await nats.connect(nats_url)
        await wait_for_router(nc, instances=1)
        await nc.close()
        messages = [{"role": "user", "content": "list the files in this repository and explain each one"}]
        async with aiohttp.ClientSession() as http:
            for turn in range(3):  # an agent loop: each call repeats the context and adds a tool result
                body = {"model": "qwen3-tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
                async with http.post(f"http://127.0.0.1:{settings.gateway.http_port}/v1/chat/completions", json=body,
                                     headers={"X-Session-Id": "agent-export"}) as r:
                    assert r.status == 200, await r.text()
                    answer = (await r.json())["choices"][0]["message"]["content"]
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": f"tool result {turn}: " + "x" * 40}]
        await wait_rows(db, "SELECT * FROM calls WHERE session_id='agent-export' AND outcome='completed'", 3)
    finally:
        await services.close()

    sessions = rows_to_sessions(await fetch_rows(database_url))
    out = tmp_path / "served.jsonl"
    save_sessions(sessions, out)
    [session] = load_trace(out)  # the file is a valid normalised trace
    assert [c.call_index for c in session.calls] == [0, 1, 2]
    assert all(c.reusable_prefix_tokens > 0 for c in session.calls[1:])  # the context was repeated
    summary = tmp_path / "sim.json"
    assert sim_main(["run", "--trace", str(out), "--profile", "local-torch", "--policy", "session-sticky",
                     "--json", str(summary)]) == 0
    replayed = json.loads(summary.read_text())
    assert replayed["calls"] == 3 and replayed["complete"]
    assert replayed["gap_model"].startswith("recorded gaps")  # an exported trace keeps its clients' gaps
