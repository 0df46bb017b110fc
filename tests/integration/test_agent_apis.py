"""Tool-using agent sessions through the official `anthropic` and `openai` SDKs, over real NATS,
Postgres and a torch-engine agent: Anthropic messages (plain and streamed), tool history in the
prompt, KV reuse reported as cached input, stop sequences, count_tokens and error shapes."""

from __future__ import annotations

import anthropic
import nats
import openai
import pytest

from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from talaria.embedded import free_port
from tests.integration.harness import Services

pytestmark = pytest.mark.integration

TOOL = {"name": "read_file", "description": "Read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


@pytest.fixture
async def served(nats_url, database_url, tmp_path):
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


async def test_a_claude_code_style_tool_session(served):
    client = anthropic.AsyncAnthropic(base_url=served, api_key="unused", max_retries=0)
    headers = {"X-Claude-Code-Session-Id": "cc-session-1"}
    messages = [{"role": "user", "content": "Fix the failing test in parser.py"}]
    # Greedy, so plain and streamed answers can be compared (newer SDKs dropped `temperature`).
    kw = dict(model="qwen3-tiny", max_tokens=12, extra_body={"temperature": 0}, system=[{"type": "text", "text": "You are a coder."}],
              tools=[TOOL], extra_headers=headers)
    first = await client.messages.create(messages=messages, **kw)
    assert first.type == "message" and first.role == "assistant" and first.model == "qwen3-tiny"
    assert first.stop_reason in ("end_turn", "max_tokens") and first.content[0].type == "text"
    counted = await client.messages.count_tokens(model="qwen3-tiny", messages=messages, system=kw["system"],
                                                 tools=[TOOL])
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == counted.input_tokens

    # The agent ran the tool: the history now holds a tool_use and its tool_result.
    messages += [
        {"role": "assistant", "content": [{"type": "text", "text": first.content[0].text},
                                          {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                           "input": {"path": "parser.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "def parse(s): return s.split(',')"}]},
    ]
    second = await client.messages.create(messages=messages, **kw)
    assert second.usage.cache_read_input_tokens >= 16  # the session's first prompt stayed in KV

    # Streaming gives the same answer, with Anthropic's event sequence.
    async with client.messages.stream(messages=messages, **{**kw, "extra_headers": {"X-Claude-Code-Session-Id":
                                                                                    "cc-session-2"}}) as stream:
        events = [e.type async for e in stream]
        streamed = await stream.get_final_message()
    assert streamed.content[0].text == second.content[0].text and streamed.stop_reason == second.stop_reason
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    assert streamed.usage.output_tokens == second.usage.output_tokens

    # A stop sequence taken from the greedy answer ends the same call early and is named.
    text = second.content[0].text
    if len(text) >= 4:  # greedy output of this seed is 12 characters; an early EOS would skip this
        stop = text[2:4]
        cut = await client.messages.create(messages=messages, stop_sequences=[stop],
                                           **{**kw, "extra_headers": {"X-Claude-Code-Session-Id": "cc-3"}})
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert cut.content[0].text == text[: text.index(stop)]


async def test_anthropic_errors_are_anthropic_shaped(served):
    client = anthropic.AsyncAnthropic(base_url=served, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as info:
        await client.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model="qwen3-tiny", max_tokens=4, extra_body={"top_k": 3},
                                     messages=[{"role": "user", "content": "x"}])
    assert "top_k" in info.value.body["error"]["message"]


async def test_an_openai_agent_session_keeps_tool_calls_in_the_prompt(served):
    client = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                               "parameters": TOOL["input_schema"]}}]
    messages = [{"role": "user", "content": "Fix the failing test in parser.py"}]
    kw = dict(model="qwen3-tiny", max_tokens=12, temperature=0, tools=tools, extra_headers={"session_id": "codex-1"})
    first = await client.chat.completions.create(messages=messages, **kw)
    messages += [{"role": "assistant", "content": first.choices[0].message.content, "tool_calls": [
                     {"id": "call_1", "type": "function",
                      "function": {"name": "read_file", "arguments": '{"path": "parser.py"}'}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "def parse(s): ..."}]
    second = await client.chat.completions.create(messages=messages, **kw)
    chunks = [c async for c in await client.chat.completions.create(
        messages=messages, stream=True, **{**kw, "extra_headers": {"session_id": "codex-2"}})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 40  # the call and its result are in the prompt
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(messages=messages, logit_bias={"99999999": 5}, **kw)
    assert info.value.body["param"] == "logit_bias"


@pytest.fixture
async def toolbot(nats_url, database_url, tmp_path):
    """A Hugging Face checkpoint served from its directory (TALARIA_MODELS=toolbot=/path) whose
    greedy output is forced to a `read_file` tool call (tests/unit/engine/hf_checkpoints.py)."""
    pytest.importorskip("transformers")
    from tests.unit.engine.hf_checkpoints import make_tool_caller

    path = make_tool_caller(tmp_path / "toolbot")
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                        http_port=free_port(), session_idle_s=3600, call_timeout_s=60, models=(f"toolbot={path}",))
    assert settings.common.models == ("toolbot",) and settings.common.models_env() == f"toolbot={path}"
    services = Services()
    await services.start_control_plane(settings)
    await services.start("agent-0", run_agent, settings.with_(instance_id="agent-0"))
    nc = await nats.connect(nats_url)
    await wait_for_router(nc, instances=1)
    await nc.close()
    yield f"http://127.0.0.1:{settings.gateway.http_port}"
    await services.close()


async def test_tool_calls_parsed_from_a_served_checkpoint_through_both_apis(toolbot):
    oa = openai.AsyncOpenAI(base_url=f"{toolbot}/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                               "parameters": TOOL["input_schema"]}}]
    messages = [{"role": "user", "content": "Fix the failing test in parser.py"}]
    kw = dict(model="toolbot", max_tokens=16, temperature=0, tools=tools, extra_headers={"X-Session-Id": "tb-oa"})
    for turn in range(2):  # a multi-turn tool session: call, result, call again
        r = await oa.chat.completions.create(messages=messages, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "read_file" and call.function.arguments == '{"path": "parser.py"}'
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": f"contents {turn}"}]
    assert r.usage.prompt_tokens_details.cached_tokens >= 16
    chunks = [c async for c in await oa.chat.completions.create(messages=messages, stream=True, **kw)]
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["read_file"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    an = anthropic.AsyncAnthropic(base_url=toolbot, api_key="unused", max_retries=0)
    history = [{"role": "user", "content": "Fix the failing test in parser.py"}]
    akw = dict(model="toolbot", max_tokens=16, tools=[TOOL], extra_body={"temperature": 0},
               extra_headers={"X-Claude-Code-Session-Id": "tb-an"})
    for turn in range(2):
        msg = await an.messages.create(messages=history, **akw)
        assert msg.stop_reason == "tool_use"
        [use] = [b for b in msg.content if b.type == "tool_use"]
        assert use.name == "read_file" and use.input == {"path": "parser.py"}
        history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": f"contents {turn}"}]}]
    assert msg.usage.cache_read_input_tokens >= 16
    async with an.messages.stream(messages=history, **akw) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"path": "parser.py"}


async def test_openai_logprobs_and_logit_bias_plain_and_streamed(served):
    from talaria.shared.catalog import BUILTIN_MODELS
    from talaria.shared.model_text import text_for

    client = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say something."}]
    kw = dict(model="qwen3-tiny", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    plain = await client.chat.completions.create(messages=messages, **kw, extra_headers={"session_id": "lp-1"})
    content = plain.choices[0].logprobs.content
    assert len(content) == plain.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == plain.choices[0].message.content
    for c in content:  # greedy: the chosen token is the most likely one, listed first
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == c.logprob <= 0 and bytes(c.bytes).decode() == c.token
    chunks = [ch async for ch in await client.chat.completions.create(
        messages=messages, stream=True, **kw, extra_headers={"session_id": "lp-2"})]
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]

    # A +100 bias forces a token the greedy answer did not contain.
    tid = text_for(BUILTIN_MODELS["qwen3-tiny"]).encode("Z", chat=False)[-1]
    forced = await client.chat.completions.create(messages=messages, logit_bias={str(tid): 100},
                                                  **kw, extra_headers={"session_id": "lp-3"})
    assert forced.choices[0].message.content == "Z" * 5
    assert all(c.token == "Z" and c.logprob > -1e-3 for c in forced.choices[0].logprobs.content)
