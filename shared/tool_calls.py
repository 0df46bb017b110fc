"""Tools in the prompt, tool calls out of the model's text (the Hermes / Qwen form).

Both HTTP APIs (OpenAI and Anthropic) turn their tool schemas and assistant tool calls into
plain chat turns here (tool results become `tool` turns), so one chat template renders them
and one parser reads the model's calls back:

    <tool_call>
    {"name": "read_file", "arguments": {"path": "a.py"}}
    </tool_call>

An assistant turn that made calls is rendered exactly as the model would have written
them, so the next call's prompt repeats the previous answer and its KV prefix is reused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from talaria.shared.messages import ChatMessage, ToolSpec

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)

    def input(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {}


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_text(tools: list[ToolSpec]) -> str:
    """The system-prompt block that declares the tools (Qwen's template wording)."""
    lines = [TOOLS_PREAMBLE]
    for t in tools:
        fn = {"name": t.name, "description": t.description, "parameters": t.parameters}
        lines.append("\n" + _dumps({"type": "function", "function": fn}))
    lines.append(TOOLS_POSTAMBLE)
    return "".join(lines)


def choice_note(choice: str, forced: str | None) -> str | None:
    """`required` / a named tool: a template cannot constrain decoding, so the choice is stated
    in the system prompt (for every model alike) rather than dropped."""
    if choice == "required":
        return "You must call at least one function."
    if choice == "tool" and forced:
        return f"You must call the function `{forced}`."
    return None


def with_system(turns: list[ChatMessage], block: str) -> list[ChatMessage]:
    """Append a block to the leading system turn (or start one), as chat templates do."""
    if turns and turns[0].role == "system":
        return [ChatMessage("system", f"{turns[0].content}\n\n{block}"), *turns[1:]]
    return [ChatMessage("system", block), *turns]


def hermes_turns(messages: list[ChatMessage], tools: list[ToolSpec] | None) -> list[tuple[str, str]]:
    """(role, text) turns for the built-in template: tools into the system turn, assistant
    calls in the `<tool_call>` form, tool results as `tool` turns."""
    turns = [ChatMessage(m.role, render_assistant(m.content, [ToolCall(c.name, c.arguments) for c in m.tool_calls])
                         if m.tool_calls else m.content) for m in messages]
    if tools:
        turns = with_system(turns, tools_text(tools))
    return [("system" if t.role == "developer" else t.role, t.content) for t in turns]


def render_call(call: ToolCall) -> str:
    try:
        args: Any = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:
        args = call.arguments  # kept verbatim: the model wrote it this way
    return f"{CALL_OPEN}\n{_dumps({'name': call.name, 'arguments': args})}\n{CALL_CLOSE}"


def render_assistant(text: str, calls: list[ToolCall]) -> str:
    parts = [text] if text else []
    parts += [render_call(c) for c in calls]
    return "\n".join(parts)


def parse_calls(text: str, fmt: str = "hermes") -> tuple[str, list[ToolCall]]:
    """Split the model's output into its text and its well-formed tool calls.

    `fmt` is the model's form: "hermes" (`<tool_call>` blocks, Qwen) or "json" (the whole
    answer is one `{"name": ..., "parameters": ...}` object, Llama 3). A block that is not a
    JSON object with a string `name` stays in the text: a malformed call is shown, not dropped.
    """
    if fmt == "json":
        call = _call_from_json(text.strip()) if text.strip().startswith("{") else None
        return ("", [call]) if call is not None else (text, [])
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        end = text.find(CALL_CLOSE, start)
        if end < 0:
            break
        body = text[start + len(CALL_OPEN):end].strip()
        call = _call_from_json(body)
        if call is None:
            kept.append(text[pos:end + len(CALL_CLOSE)])
        else:
            kept.append(text[pos:start])
            calls.append(call)
        pos = end + len(CALL_CLOSE)
    kept.append(text[pos:])
    if not calls:
        return text, calls
    content = "".join(kept)
    return (content if content.strip() else ""), calls


def _call_from_json(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models quote the arguments object
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], _dumps(args))


class TextUntilCalls:
    """Streams the model's text while holding back anything that may start a tool call.

    Once `<tool_call>` appears, the rest is buffered: the calls are parsed from the final
    text and sent as whole tool-call blocks at the end.
    """

    def __init__(self, enabled: bool, fmt: str = "hermes") -> None:
        self.enabled, self.fmt = enabled, fmt
        self.text = ""
        self._released = 0
        self.in_calls = False

    def push(self, piece: str) -> str:
        self.text += piece
        if not self.enabled:
            return self._release(len(self.text))
        if self.in_calls:
            return ""
        if self.fmt == "json":  # a call is the whole answer: hold an answer that starts like one
            head = self.text.lstrip()
            if not head or head.startswith("{"):
                self.in_calls = bool(head)
                return ""
            return self._release(len(self.text))
        at = self.text.find(CALL_OPEN, self._released)
        if at >= 0:
            self.in_calls = True
            return self._release(at)
        return self._release(len(self.text) - _partial_suffix(self.text, CALL_OPEN))

    def rest(self, content: str) -> str:
        """Text still owed at the end, given the final text outside the calls: the
        streamed part is a prefix of it (tokens and the reply travel separately)."""
        sent = self.text[:self._released]
        return content[len(sent):] if content.startswith(sent) else ""

    def _release(self, upto: int) -> str:
        out = self.text[self._released:upto]
        self._released = max(self._released, upto)
        return out


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
