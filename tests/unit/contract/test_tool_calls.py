"""Tools into the prompt and tool calls out of the model's text, for both HTTP APIs."""

import json

import msgspec
import pytest

from talaria.services.gateway.http_api import _to_call_request
from talaria.services.gateway.openai_api import CHAT_DECODER, COMPLETION_DECODER, chat_response
from talaria.services.gateway.prepare import RequestError, prepare, tool_format
from talaria.shared.tool_calls import TextUntilCalls, ToolCall, parse_calls, render_assistant
from talaria.shared.messages import CallResult, ChatMessage, Timings, Usage
from talaria.shared.catalog import BUILTIN_MODELS
from talaria.shared.model_text import text_for


def decode(ids):
    return text_for(BUILTIN_MODELS["qwen3-tiny"]).tok.decode(ids[1:])

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def result(text: str, finish: str = "stop", stop_sequence: str | None = None) -> CallResult:
    return CallResult("c1", "s1", 0, "qwen3-tiny", "agent-0", text, finish, Usage(10, 5, 15, 4), Timings(),
                      stop_sequence=stop_sequence)


def openai_request(body: dict):
    req, _ = _to_call_request(CHAT_DECODER.decode(json.dumps(body).encode()), chat=True)
    return req


def test_llama3_json_calls_are_the_whole_answer():
    assert parse_calls('{"name": "get_weather", "parameters": {"city": "Paris"}}', "json") == (
        "", [ToolCall("get_weather", '{"city": "Paris"}')])
    assert parse_calls("It is {sunny}", "json") == ("It is {sunny}", [])
    s = TextUntilCalls(enabled=True, fmt="json")
    assert s.push(' {"na') == "" and s.in_calls
    t = TextUntilCalls(enabled=True, fmt="json")
    assert t.push("Sure") == "Sure"


def test_parse_calls_splits_text_and_well_formed_calls():
    text, calls = parse_calls("Let me look.\n" + CALL_TEXT)
    assert text == "Let me look.\n" and calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    assert calls[0].input() == {"city": "Paris"}
    # malformed blocks stay visible in the text, never dropped
    bad = "<tool_call>{not json}</tool_call>"
    assert parse_calls(bad) == (bad, [])
    assert parse_calls("no calls here") == ("no calls here", [])
    assert parse_calls(CALL_TEXT + "\n" + CALL_TEXT)[1] == [ToolCall("get_weather", '{"city": "Paris"}')] * 2


def test_an_assistant_call_renders_back_as_the_model_wrote_it():
    _, calls = parse_calls(CALL_TEXT)
    assert render_assistant("", calls) == CALL_TEXT  # so the next prompt repeats the answer byte for byte


def test_streaming_holds_back_a_possible_call_and_sends_only_text():
    s = TextUntilCalls(enabled=True)
    out = [s.push(p) for p in ("Hi <", "tool", "_call>\n{", '"name": "get_weather", "arguments": {}}\n</tool_call>')]
    assert "".join(out) == "Hi " and s.in_calls
    content, calls = parse_calls(s.text)
    assert calls and s.rest(content) == ""
    plain = TextUntilCalls(enabled=True)
    assert plain.push("a <to") == "a " and plain.rest("a <tod") == "<tod"


def test_openai_tools_and_tool_history_are_rendered_into_the_prompt():
    body = {"model": "qwen3-tiny", "tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]}
    req = openai_request(body)
    assert tool_format(BUILTIN_MODELS, req) == "hermes"
    prompt = decode(prepare(BUILTIN_MODELS, req, "s", "chat").prompt_ids)
    assert prompt.startswith("<|system|>Be brief.\n\n# Tools") and '"name": "get_weather"' in prompt
    assert CALL_TEXT in prompt and "<|tool|>18C, sunny<|end|>" in prompt
    body["tool_choice"] = "none"
    assert "# Tools" not in decode(prepare(BUILTIN_MODELS, openai_request(body), "s", "chat").prompt_ids)


def test_openai_response_carries_parsed_tool_calls():
    body = chat_response(BUILTIN_MODELS, result("Checking.\n" + CALL_TEXT), "hermes")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["id"]
    # without tools offered the text is just text
    assert chat_response(BUILTIN_MODELS, result(CALL_TEXT))["choices"][0]["message"] == {"role": "assistant", "content": CALL_TEXT}


@pytest.mark.parametrize("extra,param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 20, "max_tokens": 4000}, "top_logprobs"),
    ({"logit_bias": {"999999": 10}}, "logit_bias"), ({"logit_bias": {"65": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
])
def test_openai_fields_we_do_not_honour_are_400_naming_them(extra, param):
    body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(RequestError) as info:
        prepare(BUILTIN_MODELS, openai_request(body), "s", "chat")
    assert info.value.reply.status == 400 and info.value.reply.param == param


@pytest.mark.parametrize("extra,param", [
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]}, "messages[1].content"),
])
def test_fields_outside_the_strict_rules_are_400_naming_them(extra, param):
    body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(RequestError) as info:
        openai_request(body)
    assert info.value.reply.status == 400 and info.value.reply.param == param


def test_a_string_penalty_is_a_decode_error_naming_it():
    body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "x"}], "presence_penalty": "high"}
    with pytest.raises(msgspec.ValidationError, match="presence_penalty"):
        CHAT_DECODER.decode(json.dumps(body).encode())
    body = {"model": "qwen3-tiny", "presence_penalty": 0, "frequency_penalty": 0.0, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}
    assert openai_request(body).messages[1].tool_calls  # null content with tool calls, zero penalties: fine


def test_completions_refuse_logprobs_and_echo():
    for extra in ({"logprobs": 1}, {"echo": True}):
        decoded = COMPLETION_DECODER.decode(msgspec.json.encode({"model": "gpt2-tiny", "prompt": "x", **extra}))
        with pytest.raises(RequestError):
            _to_call_request(decoded, chat=False)


def test_nats_api_roles_are_checked_too():
    from talaria.shared.messages import CallRequest

    with pytest.raises(RequestError) as info:
        prepare(BUILTIN_MODELS, CallRequest(model="qwen3-tiny", messages=[ChatMessage("robot", "x")]), "s", "nats")
    assert info.value.reply.param == "messages[0].role"
