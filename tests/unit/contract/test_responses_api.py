"""Responses API bodies become the same chat turns (and prompt) as chat completions ones;
answers validate as the `openai` SDK's own Response type; what cannot be honoured is a 400
naming the field."""

import json

import pytest
from openai.types.responses import Response

from talaria.services.gateway.http_api import _to_call_request
from talaria.services.gateway.openai_api import CHAT_DECODER
from talaria.services.gateway.prepare import prepare
from talaria.services.gateway.responses_api import parse_request, result_body
from talaria.shared.catalog import CATALOG
from talaria.shared.messages import CallResult, ErrorReply, Timings, Usage

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": PARAMS,
        "strict": False}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parse(body: dict, headers: dict | None = None):
    return parse_request(json.dumps({"model": "qwen3-tiny", **body}).encode(), headers or {})


def result(text, finish="stop"):
    return CallResult("abc", "s1", 0, "qwen3-tiny", "agent-0", text, finish, Usage(100, 7, 107, 64), Timings())


def test_a_tool_session_renders_as_the_same_prompt_as_its_chat_twin():
    responses = {"instructions": "Be brief.", "tools": [TOOL], "max_output_tokens": 8, "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c", "output": "18C, sunny"},
        {"type": "reasoning", "summary": []},  # another server's reasoning item, echoed back: skipped
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}]}
    chat = {"model": "qwen3-tiny", "max_tokens": 8, "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": PARAMS}}],
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": "Let me look.", "tool_calls": [
                         {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "c", "content": "18C, sunny"},
                     {"role": "user", "content": "And tomorrow?"}]}
    call, fmt, _ = parse(responses)
    req, _ = _to_call_request(CHAT_DECODER.decode(json.dumps(chat).encode()), chat=True)
    assert call.prompt_ids == prepare(req, "s", "chat").prompt_ids
    assert fmt == "hermes" and call.max_tokens == 8 and call.api == "responses"


def test_a_string_input_is_one_user_turn_and_the_answer_may_use_the_context_left():
    call, fmt, fields = parse({"input": "hi", "instructions": "Be brief."})
    twin, _, _ = parse({"input": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]})
    assert call.prompt_ids == twin.prompt_ids and fmt is None
    assert call.max_tokens == CATALOG["qwen3-tiny"].context_length - call.prompt_tokens  # no max_output_tokens
    assert fields["instructions"] == "Be brief." and fields["store"] is False


def test_the_session_comes_from_codex_headers_then_prompt_cache_key_then_user():
    assert parse({"input": "x", "prompt_cache_key": "conv"}, {"session_id": "codex-7"})[0].session_id == "codex-7"
    assert parse({"input": "x", "prompt_cache_key": "conv", "user": "u"})[0].session_id == "conv"
    assert parse({"input": "x", "user": "u"})[0].session_id == "u"
    bad = parse({"input": "x"}, {"session_id": "a\x01"})
    assert isinstance(bad, ErrorReply) and bad.status == 400 and bad.code == "invalid_session_id"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "output": "o"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"input": 7}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "input"),  # beyond the context
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(body, param):
    reply = parse(body)
    assert isinstance(reply, ErrorReply) and reply.status == 400 and reply.param == param, reply


def test_a_missing_required_field_is_named():
    reply = parse_request(b'{"input": "x"}', {})
    assert isinstance(reply, ErrorReply) and reply.status == 400 and reply.param == "model"


def test_codex_style_hints_are_accepted():
    call, _, _ = parse({"input": "x", "store": False, "include": ["reasoning.encrypted_content"],
                        "reasoning": {"effort": "low", "summary": "auto"}, "parallel_tool_calls": False,
                        "text": {"verbosity": "low"}, "metadata": {"k": "v"}})
    assert call.prompt_tokens > 0


def test_answers_validate_as_the_sdks_response_type():
    call, fmt, fields = parse({"input": "Weather?", "tools": [TOOL], "metadata": {"k": "v"}})
    called = Response.model_validate(result_body(call, fields, result("Sure." + CALL_TEXT), fmt))
    assert called.status == "completed" and [o.type for o in called.output] == ["message", "function_call"]
    assert called.output[0].content[0].text == "Sure." and called.output_text == "Sure."
    fc = called.output[1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"} and fc.call_id
    assert called.usage.input_tokens == 100 and called.usage.input_tokens_details.cached_tokens == 64
    assert called.metadata == {"k": "v"} and called.tools[0].name == "get_weather"
    only_call = Response.model_validate(result_body(call, fields, result(CALL_TEXT), fmt))
    assert [o.type for o in only_call.output] == ["function_call"]
    cut = Response.model_validate(result_body(call, fields, result("blah", finish="length"), fmt))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.output_text == "blah"
