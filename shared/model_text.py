"""A model's text side: its tokenizer, chat template and tool-call form.

The gateway renders and tokenises prompts with it, the engine decodes generated ids with it.
Built-in models use the fixed template with the byte-level tokenizer (tokenizer.py) or the
demo BPE (demo_tokenizer.py); a Hugging
Face directory uses its own `tokenizer.json` (the `tokenizers` library) and the chat template
from `tokenizer_config.json` / `chat_template.jinja`, rendered with jinja2 the way
transformers' `apply_chat_template` does (same environment, filters and variables), with
`tools`, assistant tool calls and tool results.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from talaria.shared import tokenizer as byte_tok
from talaria.shared.catalog import ModelSpec
from talaria.shared.messages import ChatMessage, ToolSpec
from talaria.shared.tool_calls import choice_note, hermes_turns, with_system
from talaria.shared.demo_tokenizer import demo_tokenizer


def _prefill(messages: list[ChatMessage]) -> str | None:
    """A trailing assistant message with text and no calls is continued, not answered
    (Anthropic's prefill; transformers' `continue_final_message`)."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant" and not last.tool_calls and last.content.strip():
        return last.content.strip()
    return None


def _with_note(messages: list[ChatMessage], choice: str, forced: str | None) -> list[ChatMessage]:
    note = choice_note(choice, forced)
    return with_system(list(messages), note) if note else list(messages)


# Random weights emit arbitrary ids; the built-in models may only emit tokens of printable
# ASCII, newline and tab (and EOS), so answers round-trip through any JSON client unchanged.
PRINTABLE = frozenset([9, 10, *range(32, 127)])


class ByteText:
    """The byte-level built-ins: byte ids, the fixed `<|role|>...<|end|>` template."""

    tool_format = "hermes"
    eos_ids: tuple[int, ...] = (byte_tok.EOS,)
    allowed_output: tuple[int, ...] | None = (*sorted(PRINTABLE), byte_tok.EOS)

    def encode(self, text: str, *, chat: bool = True) -> list[int]:
        return byte_tok.encode(text)

    def render(self, messages: list[ChatMessage], tools: list[ToolSpec] | None = None,
               choice: str = "auto", forced: str | None = None) -> str:
        offered = tools if tools and choice != "none" else None
        prefill = _prefill(messages)
        if prefill is not None:
            messages = messages[:-1]
        text = byte_tok.render_chat(hermes_turns(_with_note(messages, choice, forced) if offered else messages,
                                                 offered))
        return text + prefill if prefill is not None else text

    def decoder(self) -> byte_tok.StreamDecoder:
        return byte_tok.StreamDecoder()


class DemoBpeText(ByteText):
    """The BPE built-ins (demo_tokenizer.py): same template and specials, merged ids."""

    def __init__(self) -> None:
        self.tok = demo_tokenizer()
        printable = [i for i in range(self.tok.get_vocab_size())
                     if (t := self.tok.decode([i], skip_special_tokens=True)) and all(ord(c) in PRINTABLE for c in t)]
        self.allowed_output = (*printable, byte_tok.EOS)

    def encode(self, text: str, *, chat: bool = True) -> list[int]:
        return [byte_tok.BOS, *self.tok.encode(text, add_special_tokens=False).ids]

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.tok)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out
        return value.get("content")
    return value


class HfText:
    """A Hugging Face directory's tokenizer and chat template."""

    allowed_output = None  # a trained model's output is not restricted

    def __init__(self, path: str | Path, eos_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.tok = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        cfg_file = self.path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        template = cfg.get("chat_template")
        jinja_file = self.path / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.template_source: str | None = template
        self.special = {k: _token_text(cfg.get(k)) for k in
                        ("bos_token", "eos_token", "unk_token", "pad_token") if cfg.get(k) is not None}
        eos = list(eos_ids)
        if not eos and self.special.get("eos_token") is not None:
            tid = self.tok.token_to_id(self.special["eos_token"])
            eos = [tid] if tid is not None else []
        self.eos_ids = tuple(eos)
        self.tool_format = "hermes" if template and "<tool_call>" in template else "json"
        self._template = _compile(template) if template else None

    def encode(self, text: str, *, chat: bool = True) -> list[int]:
        # A rendered chat already holds its special tokens (BOS included), as in transformers.
        return self.tok.encode(text, add_special_tokens=not chat).ids

    def render(self, messages: list[ChatMessage], tools: list[ToolSpec] | None = None,
               choice: str = "auto", forced: str | None = None) -> str:
        if self._template is None:
            raise ValueError(f"{self.path}: no chat template (tokenizer_config.json `chat_template`)")
        offered = tools if tools and choice != "none" else None
        msgs = _with_note(messages, choice, forced) if offered else messages
        prefill = _prefill(msgs)
        text = self._template.render(
            messages=[_as_dict(m) for m in msgs],
            tools=[{"type": "function", "function": {"name": t.name, "description": t.description,
                                                     "parameters": t.parameters}} for t in offered] if offered else None,
            add_generation_prompt=prefill is None, **self.special)
        if prefill is not None:  # as transformers' continue_final_message: cut after the prefill
            if prefill not in text:
                raise ValueError("the chat template does not render the final assistant message verbatim")
            text = text[: text.rindex(prefill) + len(prefill)]
        return text

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.tok)


def _as_dict(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"type": "function", "id": c.id,
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _compile(source: str):
    """The jinja2 environment transformers uses for chat templates."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDecoder:
    """Text released token by token: a token whose bytes end mid-character is held until the
    character completes (the offsets scheme streaming servers use with `tokenizers`)."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        self.prefix = self.read = len(self.ids)
        return now[len(before):]


BYTE_TEXT = ByteText()


@lru_cache(maxsize=None)
def _hf_text(path: str, eos_ids: tuple[int, ...]) -> HfText:
    return HfText(path, eos_ids)


@lru_cache(maxsize=1)
def _demo_bpe() -> DemoBpeText:
    return DemoBpeText()


def text_for(spec: ModelSpec) -> ByteText | HfText:
    if spec.path is not None:
        return _hf_text(spec.path, spec.eos_ids)
    return _demo_bpe() if spec.tokenizer == "bpe" else BYTE_TEXT
