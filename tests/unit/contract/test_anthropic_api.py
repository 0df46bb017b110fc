"""Anthropic Messages bodies become the same chat turns as OpenAI ones; answers and errors
come back in Anthropic's shapes."""

import json

import pytest

from talaria.services.gateway.anthropic_api import error_body, message_body
from talaria.services.gateway.anthropic_input import DECODER, chat_turns, session_of, to_call_request
from talaria.services.gateway.http_api import _to_call_request
from talaria.services.gateway.openai_api import CHAT_DECODER
from talaria.services.gateway.prepare import RequestError, prepare
from talaria.shared.catalog import BUILTIN_MODELS
from talaria.shared.model_text import text_for
from talaria.shared.messages import CallResult, ErrorReply, Timings, Usage

TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def decode(body: dict):
    return DECODER.decode(json.dumps(body).encode())


def prompt_of(body: dict) -> list[int]:
    req = decode(body)
    return prepare(BUILTIN_MODELS, to_call_request(req, chat_turns(req)), "s", "anthropic", fit_max_tokens=True).prompt_ids


def result(text, finish="stop", stop_sequence=None):
    return CallResult("abc", "s1", 0, "qwen3-tiny", "agent-0", text, finish, Usage(100, 7, 107, 64), Timings(),
                      stop_sequence=stop_sequence)


def test_a_tool_session_renders_as_the_same_prompt_as_its_openai_twin():
    anthropic = {"model": "qwen3-tiny", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief.",
                                                                       "cache_control": {"type": "ephemeral"}}],
                 "tools": [TOOL], "messages": [
                     {"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": [{"type": "text", "text": "18C, sunny"}]},
                                                  {"type": "text", "text": "And tomorrow?"}]}]}
    openai = {"model": "qwen3-tiny", "max_tokens": 8, "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": TOOL["input_schema"]}}],
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                         "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "c", "content": "18C, sunny"},
                     {"role": "user", "content": "And tomorrow?"}]}
    req, _ = _to_call_request(CHAT_DECODER.decode(json.dumps(openai).encode()), chat=True)
    assert prompt_of(anthropic) == prepare(BUILTIN_MODELS, req, "s", "chat").prompt_ids


def test_a_system_message_inside_the_conversation_renders_at_its_position_as_its_openai_twin():
    """Anthropic's API takes a system message anywhere in `messages`, applying from there on;
    Claude Code (2.1.197) sends one at index 1. Other roles are refused, naming the field."""
    body = {"model": "qwen3-tiny", "max_tokens": 8, "system": "Top.", "messages": [
        {"role": "user", "content": "a"}, {"role": "system", "content": [{"type": "text", "text": "Mid."}]},
        {"role": "user", "content": "b"}]}
    openai = {"model": "qwen3-tiny", "max_tokens": 8, "messages": [
        {"role": "system", "content": "Top."}, {"role": "user", "content": "a"},
        {"role": "system", "content": "Mid."}, {"role": "user", "content": "b"}]}
    req, _ = _to_call_request(CHAT_DECODER.decode(json.dumps(openai).encode()), chat=True)
    assert prompt_of(body) == prepare(BUILTIN_MODELS, req, "s", "chat").prompt_ids
    body["messages"][1]["role"] = "developer"
    with pytest.raises(RequestError, match="'user', 'assistant' or 'system'") as info:
        prompt_of(body)
    assert info.value.reply.status == 400 and info.value.reply.param == "messages.1.role"
    body["messages"][1] = {"role": "system", "content": [{"type": "image", "source": {}}]}
    with pytest.raises(RequestError, match="not supported") as info:
        prompt_of(body)
    assert info.value.reply.param == "messages.1.content"


def test_a_trailing_assistant_message_is_continued():
    body = {"model": "qwen3-tiny", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I am"}]}
    prompt = text_for(BUILTIN_MODELS["qwen3-tiny"]).tok.decode(prompt_of(body)[1:])
    assert prompt == "<|user|>Say hi<|end|><|assistant|>Hi, I am"


def test_the_answer_is_a_message_with_usage_split_by_cache():
    body = message_body(result("hello", "length"), None)
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": "hello"}] and body["stop_reason"] == "max_tokens"
    assert body["usage"] == {"input_tokens": 36, "output_tokens": 7, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 64}
    assert message_body(result("x"), None)["stop_reason"] == "end_turn"
    stopped = message_body(result("x", stop_sequence="END"), None)
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "END"


def test_a_tool_call_in_the_output_is_a_tool_use_block():
    body = message_body(result("Checking.\n" + CALL_TEXT), "hermes")
    assert body["stop_reason"] == "tool_use"
    text, use = body["content"]
    assert text == {"type": "text", "text": "Checking.\n"}
    assert use["type"] == "tool_use" and use["name"] == "get_weather" and use["input"] == {"city": "Paris"}
    assert use["id"].startswith("toolu_")


def test_claude_code_session_ids_come_from_its_header_or_metadata():
    from talaria.services.gateway.anthropic_input import Metadata

    assert session_of({"X-Claude-Code-Session-Id": "cc-1"}, None) == "cc-1"
    user = "user_ab12_account_1234_session_5f0c8f4e-7d1a-4c3b-9e2a-0123456789ab"
    assert session_of({}, Metadata(user)) == "5f0c8f4e-7d1a-4c3b-9e2a-0123456789ab"
    assert session_of({}, Metadata("alice")) == "alice"


def test_max_tokens_beyond_the_context_is_cut_to_fit():
    body = {"model": "qwen3-tiny", "max_tokens": 10**6, "messages": [{"role": "user", "content": "hi"}]}
    req = decode(body)
    call = prepare(BUILTIN_MODELS, to_call_request(req, chat_turns(req)), "s", "anthropic", fit_max_tokens=True)
    assert call.max_tokens + call.prompt_tokens == BUILTIN_MODELS["qwen3-tiny"].context_length


@pytest.mark.parametrize("change,param", [
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": 1.5}, "temperature"),
    ({"top_k": 5}, "top_k"), ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"), ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
])
def test_bad_fields_are_400_naming_them(change, param):
    body = {"model": "qwen3-tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(RequestError) as info:
        prompt_of(body)
    assert info.value.reply.status == 400 and info.value.reply.param == param


def test_errors_are_anthropic_shaped():
    assert error_body(ErrorReply(404, "model_not_found", "no such model")) == {
        "type": "error", "error": {"type": "not_found_error", "message": "no such model"}}
    assert error_body(ErrorReply(503, "no_capacity", "busy"))["error"]["type"] == "overloaded_error"
