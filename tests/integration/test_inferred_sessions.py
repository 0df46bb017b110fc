"""Sessions without a session id, live: two interleaved conversations through the official
`openai` SDK, no session header, one shared system prompt, each call appending to its
conversation, then a fork of one; over real NATS, Postgres, the talaria router and a
torch-engine agent."""

from __future__ import annotations

import asyncio

import aiohttp
import nats
import openai
import pytest

from talaria.embedded import free_port
from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from tests.integration.harness import Services, wait_rows

pytestmark = pytest.mark.integration

SYSTEM = ("You are a software engineering agent. Read the task, run one shell command per turn, "
          "and explain what you saw before the next command. ") * 15  # ~600 tokens


@pytest.fixture
async def gateway(nats_url, database_url, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                           http_port=free_port(), session_idle_s=3600, call_timeout_s=60)
    services = Services()
    await services.start_control_plane(settings)
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0", models=("qwen3-tiny",)))
    nc = await nats.connect(nats_url)
    await wait_for_router(nc, instances=1)
    await nc.close()
    yield f"http://127.0.0.1:{settings.gateway.http_port}"
    await services.close()


async def test_two_conversations_without_ids_are_two_sessions_served_from_kv(gateway, db):
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    conversations = {name: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
                     for name, task in (("a", "Fix the failing test in parser.py"),
                                        ("b", "Add a --verbose flag to the cli"))}
    ids: dict[str, list[str]] = {"a": [], "b": []}
    for step in range(3):
        for name, messages in conversations.items():
            reply = await client.chat.completions.create(model="qwen3-tiny", messages=messages, max_tokens=24,
                                                         temperature=0)
            ids[name].append(reply.id.removeprefix("chatcmpl-"))
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"$ command {step} of {name}\nexit 0"}]
    # A fork: conversation a's last turn extended twice at once, with two tool results.
    fork = [*conversations["a"][:-1], {"role": "user", "content": "$ another command\nexit 1"}]
    replies = await asyncio.gather(*(client.chat.completions.create(model="qwen3-tiny", messages=m, max_tokens=24,
                                                                    temperature=0)
                                     for m in (conversations["a"], fork)))
    branches = [r.id.removeprefix("chatcmpl-") for r in replies]
    rows = await wait_rows(db, "SELECT call_id, session_id, kv_source, cached_tokens, prompt_tokens FROM calls "
                               "WHERE outcome = 'completed' ORDER BY submitted_at", 8)
    by_call = {r["call_id"]: r for r in rows}
    sessions = {name: {by_call[c]["session_id"] for c in calls} for name, calls in ids.items()}
    assert all(len(s) == 1 for s in sessions.values()), sessions  # 2 sessions of 3 calls
    assert sessions["a"] != sessions["b"] and next(iter(sessions["a"])).startswith("anon-")
    for name, calls in ids.items():
        for before, c in zip(calls, calls[1:]):  # every continuation found its session's KV
            assert by_call[c]["kv_source"] in ("device", "host"), (name, dict(by_call[c]))
            assert by_call[c]["cached_tokens"] >= by_call[before]["prompt_tokens"] // 16 * 16
    # one branch continues a, the other is a session of its own that still found a's KV
    [kept] = [c for c in branches if by_call[c]["session_id"] in sessions["a"]]
    [fork_id] = [c for c in branches if c != kept]
    assert by_call[fork_id]["session_id"] not in sessions["a"] | sessions["b"]
    assert by_call[fork_id]["kv_source"] in ("device", "host")
    assert by_call[fork_id]["cached_tokens"] >= by_call[ids["a"][-1]]["prompt_tokens"] // 16 * 16
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{gateway}/metrics") as r:
            metrics = await r.text()
    assert 'talaria_frontend_inferred_sessions_total{outcome="new"} 2.0' in metrics
    assert 'talaria_frontend_inferred_sessions_total{outcome="continued"} 5.0' in metrics
    assert 'talaria_frontend_inferred_sessions_total{outcome="forked"} 1.0' in metrics


@pytest.fixture
async def toolbot(nats_url, database_url, tmp_path):
    """A served checkpoint whose every answer is one `read_file` tool call (hf_checkpoints.py)."""
    pytest.importorskip("transformers")
    from tests.unit.engine.hf_checkpoints import make_tool_caller

    path = make_tool_caller(tmp_path / "toolbot")
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                           http_port=free_port(), session_idle_s=3600, call_timeout_s=60, models=(f"toolbot={path}",))
    services = Services()
    await services.start_control_plane(settings)
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0"))
    nc = await nats.connect(nats_url)
    await wait_for_router(nc, instances=1)
    await nc.close()
    yield f"http://127.0.0.1:{settings.gateway.http_port}"
    await services.close()


async def test_a_tool_loop_without_ids_through_a_real_chat_template_is_one_session(toolbot, db):
    """The answer is a tool call the client sends back as `tool_calls`, which the checkpoint's
    own (Qwen3) template renders again: the continuation still repeats it."""
    client = openai.AsyncOpenAI(base_url=f"{toolbot}/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the failing test"}]
    sessions = []
    for turn in range(3):
        r = await client.chat.completions.create(model="toolbot", messages=messages, max_tokens=16, temperature=0,
                                                 tools=tools)
        [call] = r.choices[0].message.tool_calls
        sessions.append(r.id.removeprefix("chatcmpl-"))
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": f"contents {turn}"}]
    rows = await wait_rows(db, "SELECT call_id, session_id FROM calls WHERE outcome = 'completed'", 3)
    assert len({r["session_id"] for r in rows}) == 1, [dict(r) for r in rows]
