"""The OpenAI Responses API (`POST /v1/responses`, what Codex CLI speaks) through the official
`openai` SDK, over real NATS, Postgres and a torch-engine agent: plain and streamed answers,
a function-tool round trip with calls parsed from a served checkpoint, KV reuse reported as
cached input, and every streamed event valid as the SDK's own event type."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from pydantic import TypeAdapter
from openai.types.responses import ResponseStreamEvent

from tests.integration.test_agent_apis import served, toolbot  # noqa: F401 (fixtures)

pytestmark = pytest.mark.integration

READ_FILE = {"type": "function", "name": "read_file", "description": "Read a file", "strict": False,
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
EVENTS = TypeAdapter(ResponseStreamEvent)


async def raw_events(base: str, body: dict, session: str) -> list:
    """The SSE stream as sent, each event validated strictly against the SDK's event union."""
    events = []
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base}/v1/responses", json={**body, "stream": True},
                          headers={"session_id": session}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            kind = None
            async for line in r.content:
                line = line.decode().rstrip("\n")
                if line.startswith("event: "):
                    kind = line[len("event: "):]
                elif line.startswith("data: "):
                    event = EVENTS.validate_python(json.loads(line[len("data: "):]))
                    assert event.type == kind
                    events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


async def test_a_codex_style_session_plain_and_streamed(served):
    client = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    kw = dict(model="qwen3-tiny", instructions="You are a coder.", tools=[READ_FILE], max_output_tokens=12,
              temperature=0, store=False, extra_headers={"session_id": "codex-r1"})
    history = [{"role": "user", "content": [{"type": "input_text", "text": "Fix the failing test in parser.py"}]}]
    first = await client.responses.create(input=history, **kw)
    assert first.object == "response" and first.model == "qwen3-tiny" and first.id.startswith("resp_")
    assert first.status in ("completed", "incomplete") and first.output[0].type == "message"
    assert first.usage.output_tokens == 12 or first.status == "completed"

    # The agent ran the tool: the input now holds the answer, its call and the call's output.
    history += [o.model_dump(exclude_none=True) for o in first.output]
    history += [{"type": "function_call", "call_id": "call_1", "name": "read_file",
                 "arguments": '{"path": "parser.py"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "def parse(s): return s.split(',')"}]
    second = await client.responses.create(input=history, **kw)
    assert second.usage.input_tokens > first.usage.input_tokens + 40  # the call and its output are in the prompt
    assert second.usage.input_tokens_details.cached_tokens >= 16  # the session's first prompt stayed in KV

    # Streamed (another session, so nothing is cached): the same text, in the documented order.
    stream = await client.responses.create(input=history, stream=True,
                                           **{**kw, "extra_headers": {"session_id": "codex-r2"}})
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    final = events[-1].response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{second.status}"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == second.output_text
    assert final.output_text == second.output_text and final.usage.output_tokens == second.usage.output_tokens

    raw = await raw_events(served, {"model": "qwen3-tiny", "input": "hello", "max_output_tokens": 5,
                                    "temperature": 0}, "codex-r3")
    assert raw[0].type == "response.created" and raw[-1].type in ("response.completed", "response.incomplete")


async def test_bad_requests_are_openai_shaped_400s(served):
    client = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="qwen3-tiny", input="x", previous_response_id="resp_earlier")
    assert info.value.body["param"] == "previous_response_id" and "keeps no responses" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="qwen3-tiny", input="x", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model="gpt-9", input="x")
    assert info.value.body["code"] == "model_not_found"
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{served}/v1/responses", data=b"{not json") as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"


async def test_a_function_tool_round_trip_from_a_served_checkpoint(toolbot):
    client = openai.AsyncOpenAI(base_url=f"{toolbot}/v1", api_key="unused", max_retries=0)
    kw = dict(model="toolbot", tools=[READ_FILE], max_output_tokens=16, temperature=0, store=False,
              extra_headers={"session_id": "tb-responses"})
    history: list = [{"role": "user", "content": "Fix the failing test in parser.py"}]
    for turn in range(2):  # call, output, call again
        r = await client.responses.create(input=history, **kw)
        assert r.status == "completed" and r.output_text == ""
        [call] = r.output
        assert call.type == "function_call" and call.name == "read_file"
        assert call.arguments == '{"path": "parser.py"}' and call.call_id
        history += [call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id, "output": f"contents {turn}"}]
    assert r.usage.input_tokens_details.cached_tokens >= 16

    async with client.responses.stream(input=history, **kw) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_response()
    assert [o.type for o in final.output] == ["function_call"] and final.output[0].name == "read_file"
    assert kinds[-4:] == ["response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    raw = await raw_events(toolbot, {"model": "toolbot", "input": history, "tools": [READ_FILE],
                                     "max_output_tokens": 16, "temperature": 0}, "tb-raw")
    [done] = [e for e in raw if e.type == "response.function_call_arguments.done"]
    assert done.arguments == '{"path": "parser.py"}' and raw[-1].response.output[0].call_id


async def test_a_large_body_for_a_served_checkpoint_is_parsed_in_the_worker_too(toolbot):
    """Bodies over 64 KiB are parsed in the gateway's worker process, which must know the
    checkpoints (TALARIA_MODELS=name=/path) too: Codex's input passes 64 KiB within a session.
    Too long for toolbot's 2,048 positions, so the answer is a 400 naming the context: found,
    measured, refused (not a 404 `model_not_found`)."""
    big = "word " * 14_000  # 70 KB
    async with aiohttp.ClientSession() as s:
        for path, body in (("/v1/responses", {"model": "toolbot", "input": big, "max_output_tokens": 4}),
                           ("/v1/chat/completions", {"model": "toolbot", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": big}]})):
            async with s.post(f"{toolbot}{path}", json=body) as r:
                error = (await r.json())["error"]
                assert r.status == 400 and error["code"] == "context_length_exceeded", (path, error)
