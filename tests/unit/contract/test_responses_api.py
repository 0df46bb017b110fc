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
from talaria.services.gateway.responses_input import DEFAULT_MAX_OUTPUT_TOKENS
from talaria.shared.catalog import BUILTIN_MODELS
from talaria.shared.model_text import text_for
from talaria.shared.messages import CallResult, ErrorReply, Timings, Usage

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": PARAMS,
        "strict": False}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parse(body: dict, headers: dict | None = None):
    return parse_request(BUILTIN_MODELS, json.dumps({"model": "qwen3-tiny", **body}).encode(), headers or {})


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
    parsed = parse(responses)
    call, fmt = parsed.call, parsed.fmt
    req, _ = _to_call_request(CHAT_DECODER.decode(json.dumps(chat).encode()), chat=True)
    assert call.prompt_ids == prepare(BUILTIN_MODELS, req, "s", "chat").prompt_ids
    assert fmt == "hermes" and call.max_tokens == 8 and call.api == "responses"


def test_a_string_input_is_one_user_turn_and_the_default_answer_fits_the_context():
    parsed = parse({"input": "hi", "instructions": "Be brief."})
    twin = parse({"input": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]})
    call = parsed.call
    assert call.prompt_ids == twin.call.prompt_ids and parsed.fmt is None
    assert call.max_tokens == DEFAULT_MAX_OUTPUT_TOKENS  # no max_output_tokens
    small = parse({"model": "gpt2-tiny", "input": "x" * 8000}).call  # the default, cut to the context left
    assert small.max_tokens == BUILTIN_MODELS["gpt2-tiny"].context_length - small.prompt_tokens
    assert parsed.fields["instructions"] == "Be brief." and parsed.fields["store"] is False


def test_the_session_comes_from_codex_headers_then_prompt_cache_key_then_user():
    assert parse({"input": "x", "prompt_cache_key": "conv"}, {"session_id": "codex-7"}).call.session_id == "codex-7"
    assert parse({"input": "x", "prompt_cache_key": "conv", "user": "u"}).call.session_id == "conv"
    assert parse({"input": "x", "user": "u"}).call.session_id == "u"
    bad = parse({"input": "x"}, {"session_id": "a\x01"})
    assert isinstance(bad, ErrorReply) and bad.status == 400 and bad.code == "invalid_session_id"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "c"}]}]},
     "tools[0].tools[0].type"),
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
    reply = parse_request(BUILTIN_MODELS, b'{"input": "x"}', {})
    assert isinstance(reply, ErrorReply) and reply.status == 400 and reply.param == "model"


def test_codex_style_hints_are_accepted():
    call = parse({"input": "x", "store": False, "include": ["reasoning.encrypted_content"],
                        "reasoning": {"effort": "low", "summary": "auto"}, "parallel_tool_calls": False,
                        "text": {"verbosity": "low"}, "metadata": {"k": "v"}}).call
    assert call.prompt_tokens > 0


def test_answers_validate_as_the_sdks_response_type():
    parsed = parse({"input": "Weather?", "tools": [TOOL], "metadata": {"k": "v"}})
    called = Response.model_validate(result_body(parsed, result("Sure." + CALL_TEXT)))
    assert called.status == "completed" and [o.type for o in called.output] == ["message", "function_call"]
    assert called.output[0].content[0].text == "Sure." and called.output_text == "Sure."
    fc = called.output[1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"} and fc.call_id
    assert called.usage.input_tokens == 100 and called.usage.input_tokens_details.cached_tokens == 64
    assert called.metadata == {"k": "v"} and called.tools[0].name == "get_weather"
    only_call = Response.model_validate(result_body(parsed, result(CALL_TEXT)))
    assert [o.type for o in only_call.output] == ["function_call"]
    cut = Response.model_validate(result_body(parsed, result("blah", finish="length")))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.output_text == "blah"


def test_namespace_functions_are_offered_qualified_and_answered_split():
    """Codex CLI groups its sub-agent functions in a `namespace` tool: the model sees
    `agents.spawn`, the answer names the function and its namespace apart, and the call
    sent back in the next input renders as the model wrote it."""
    spawn = {"type": "function", "name": "spawn", "description": "Start one.", "parameters": PARAMS}
    space = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [spawn]}
    parsed = parse({"input": "go", "tools": [TOOL, space]})
    prompt = text_for(BUILTIN_MODELS["qwen3-tiny"]).tok.decode(parsed.call.prompt_ids)
    assert '"name": "agents.spawn"' in prompt and "Sub-agents. Start one." in prompt
    text = CALL_TEXT.replace("get_weather", "agents.spawn")
    body = Response.model_validate(result_body(parsed, result(text)))
    [fc] = body.output
    assert (fc.name, fc.namespace) == ("spawn", "agents")
    history = [{"role": "user", "content": "go"}, {**fc.model_dump(exclude_none=True)},
               {"type": "function_call_output", "call_id": fc.call_id, "output": "started"}]
    again = parse({"input": history, "tools": [TOOL, space]})
    assert again.call.prompt_ids[:len(parsed.call.prompt_ids)] == parsed.call.prompt_ids
    assert text.split("\n")[1] in text_for(BUILTIN_MODELS["qwen3-tiny"]).tok.decode(again.call.prompt_ids)
