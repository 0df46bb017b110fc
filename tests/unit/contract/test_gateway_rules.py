"""The gateway's request rules, shared by the HTTP and NATS APIs."""

from pathlib import Path

import pytest

from talaria.services.gateway.prepare import RequestError, prepare
from talaria.services.gateway.session_ids import SESSION_HEADERS, InvalidSessionId, session_id_from
from talaria.shared.catalog import BUILTIN_MODELS
from talaria.shared.messages import CallRequest, ChatMessage
from talaria.shared.model_text import text_for
from talaria.shared.tokenizer import block_hashes, encode, render_chat


def chat(**kw):
    base = dict(model="qwen3-tiny", messages=[ChatMessage("user", "hi")], max_tokens=4)
    base.update(kw)
    return CallRequest(**base)


def test_a_chat_call_is_tokenised_and_hashed():
    call = prepare(BUILTIN_MODELS, chat(), "s1", "chat")
    text = text_for(BUILTIN_MODELS["qwen3-tiny"])
    assert call.prompt_ids == text.encode(render_chat([("user", "hi")]))
    assert text.tok.decode(call.prompt_ids[1:]) == render_chat([("user", "hi")])
    assert call.block_hashes == block_hashes(call.prompt_ids)
    assert call.session_id == "s1" and call.max_tokens == 4


def test_unknown_model_is_404_in_openai_shape():
    with pytest.raises(RequestError) as info:
        prepare(BUILTIN_MODELS, chat(model="gpt-9"), "s", "chat")
    assert info.value.reply.status == 404 and info.value.reply.code == "model_not_found"


def test_prompt_longer_than_the_context_is_400():
    limit = BUILTIN_MODELS["gpt2-tiny"].context_length
    with pytest.raises(RequestError) as info:
        prepare(BUILTIN_MODELS, chat(model="gpt2-tiny", messages=[ChatMessage("user", "x" * limit)]), "s", "chat")
    assert info.value.reply.status == 400 and info.value.reply.code == "context_length_exceeded"


def test_a_max_tokens_past_the_context_is_400_naming_what_was_asked():
    limit = BUILTIN_MODELS["qwen3-tiny"].context_length
    with pytest.raises(RequestError) as info:
        prepare(BUILTIN_MODELS, chat(model="qwen3-tiny", max_tokens=10**9), "s", "chat")
    reply = info.value.reply
    assert reply.status == 400 and reply.code == "context_length_exceeded" and reply.param == "messages"
    # the prompt's own lower bound, never a negative count left from the context
    assert f"maximum context length is {limit}" in reply.message and "-" not in reply.message
    assert "1000000000 for the completion" in reply.message


@pytest.mark.parametrize("kw,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": 3.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"messages": []}, "messages"), ({"call_id": "a.b"}, "call_id"), ({"stop": [""]}, "stop"),
    ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("inf")}, "top_p"), ({"stop": ["x" * 1025]}, "stop"), ({"stop": ["s"] * 9}, "stop"),
    ({"call_id": "a\x00b"}, "call_id"), ({"call_id": "a\x0bb"}, "call_id"),
])
def test_bad_fields_are_400_naming_the_field(kw, param):
    with pytest.raises(RequestError) as info:
        prepare(BUILTIN_MODELS, chat(**kw), "s", "chat")
    assert info.value.reply.status == 400 and info.value.reply.param == param


def test_extreme_but_valid_sampling_values_are_accepted():
    # The engine handles these (engine/sampling.py); only values outside the API's bounds are refused.
    for kw in ({"temperature": 1e-300}, {"top_p": 5e-324}, {"seed": 2**63 - 1}, {"seed": -(2**63)}):
        prepare(BUILTIN_MODELS, chat(**kw), "s", "chat")


def test_deeply_nested_json_is_a_400_not_a_crash():
    from talaria.services.gateway.openai_api import CHAT_DECODER
    from talaria.services.gateway.validation import decode

    body = b'{"model":"m","messages":[],"junk":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(RequestError) as info:
        decode(CHAT_DECODER, body)
    assert info.value.reply.status == 400 and info.value.reply.code == "invalid_json"


def test_a_call_larger_than_one_bus_message_is_a_permanent_413():
    from talaria.services.gateway.validation import check_size

    call = prepare(BUILTIN_MODELS, chat(), "s", "chat")
    assert check_size(call, 1 << 20) is None
    reply = check_size(call, 64)
    assert reply.status == 413 and reply.retry_after_s is None


def test_every_decoder_refuses_ids_with_control_characters_or_unbounded():
    import msgspec

    from talaria.shared import wire
    from talaria.shared.events import CallStarted, EVENT_DECODER
    from talaria.shared.snapshots import InstanceSnapshot, SNAPSHOT_DECODER, SessionKv

    good = CallStarted("c1", "s1", "agent-0", 1.0)
    assert EVENT_DECODER.decode(wire.encode(good)) == good
    for bad in (dict(call_id="c\x00"), dict(call_id="c d"), dict(call_id="c" * 129), dict(session_id=""),
                dict(session_id="s\x0c"), dict(instance_id="a.b"), dict(session_id="s" * 257)):
        with pytest.raises(msgspec.ValidationError):
            EVENT_DECODER.decode(wire.encode(msgspec.structs.replace(good, **bad)))
    snap = InstanceSnapshot("agent-0", 1, 1.0, sessions=[SessionKv("s\x00", "qwen3-tiny", "device")])
    with pytest.raises(msgspec.ValidationError):
        SNAPSHOT_DECODER.decode(wire.encode(snap))


@pytest.mark.parametrize("i,j", [(i, j) for i in range(len(SESSION_HEADERS)) for j in range(i + 1, len(SESSION_HEADERS))])
def test_the_earlier_listed_session_header_wins_whatever_the_order_sent(i, j):
    # Pinned by issue 15: precedence between two session headers was untested.
    from multidict import CIMultiDict

    earlier, later = SESSION_HEADERS[i], SESSION_HEADERS[j]
    for headers in ({later: "later", earlier: "earlier"}, {earlier: "earlier", later: "later"}):
        assert session_id_from(CIMultiDict(headers), "user") == "earlier"
        assert session_id_from({k.upper(): v for k, v in headers.items()}, None) == "earlier"
    assert session_id_from({earlier: "", later: "later"}, None) == "later"  # an empty one does not count


def test_session_id_comes_from_headers_then_user_then_a_fresh_one():
    assert session_id_from({"X-Session-Id": "a"}, "u") == "a"
    assert session_id_from({"session_id": "codex"}, None) == "codex"
    assert session_id_from({}, "user-7") == "user-7"
    one, two = session_id_from({}, None), session_id_from({}, None)
    assert one != two and one.startswith("anon-")
    with pytest.raises(InvalidSessionId):
        session_id_from({"X-Session-Id": "x" * 300})


def test_the_demo_bpe_fits_a_coding_agents_first_request():
    # Claude Code / Codex send 60-100 KB of system prompt and tool schemas on their first call.
    system = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    while len(system) < 100_000:
        system += system
    call = prepare(BUILTIN_MODELS, chat(messages=[ChatMessage("system", system[:100_000]), ChatMessage("user", "hi")]), "s", "chat")
    assert call.prompt_tokens < 40_000 < BUILTIN_MODELS["qwen3-tiny"].context_length


def test_continuation_prompt_starts_with_previous_prompt_and_answer():
    first = render_chat([("user", "fix the bug")])
    second = render_chat([("user", "fix the bug"), ("assistant", "ok"), ("tool", "done")])
    assert second.startswith(first + "ok")
    a, b = block_hashes(encode(first + "ok")), block_hashes(encode(second))
    assert a == b[: len(a)]


@pytest.mark.parametrize("model", ["qwen3-tiny", "gpt2-tiny"])
def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenised(model, monkeypatch):
    """Issue 25: a 7.9 MB body took 6-11 s to tokenise before the context check refused it.
    Its length in bytes bounds its tokens from below: refused without tokenising."""
    text = text_for(BUILTIN_MODELS[model])

    def no_tokenising(*a, **kw):
        raise AssertionError("tokenised a prompt that cannot fit")

    monkeypatch.setattr(type(text), "encode", no_tokenising)
    if hasattr(text, "tok"):
        monkeypatch.setattr(text, "tok", _CountingTok(text.tok))
    huge = "go on " * (1_400_000)  # 8.4 MB
    for req in (CallRequest(model=model, prompt=huge, max_tokens=1),
                CallRequest(model=model, messages=[ChatMessage("user", huge)], max_tokens=1)):
        with pytest.raises(RequestError) as err:
            prepare(BUILTIN_MODELS, req, "s", "chat")
        assert err.value.reply.code == "context_length_exceeded" and "at least" in err.value.reply.message
    if hasattr(text, "tok"):  # it stopped soon after the count passed the context
        assert text.tok.chars < 4 * BUILTIN_MODELS[model].context_length * 8


class _CountingTok:
    def __init__(self, tok):
        self.tok, self.chars = tok, 0

    def encode(self, piece, **kw):
        self.chars += len(piece)
        return self.tok.encode(piece, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("model", ["qwen3-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("sample", ["", "hello world", "y" * 5000, "ﬁ𝐀Ａ é\n\t" * 300,
                                    "<|user|><tool_call></tool_call>" * 50, "def f(x):\n    return x  # 😀\n" * 200])
def test_the_bound_never_exceeds_the_real_token_count(model, sample):
    """The early refusal is sound: it never refuses a prompt that would have fitted."""
    from talaria.services.gateway.prepare import prompt_tokens_at_least

    text = text_for(BUILTIN_MODELS[model])
    assert prompt_tokens_at_least(text, sample) <= len(text.encode(sample, chat=False))


@pytest.mark.parametrize("sample", ["hello world " * 20000, "a  b\n\n  c\t d " * 9000, "x" * 70000 + " y" * 9000,
                                    "def f(x):\n    return x  # 😀 ok\n" * 5000, "<|user|> hi <tool_call> x" * 9000])
def test_the_demo_bpe_counted_piece_by_piece_gives_the_same_ids(sample):
    from talaria.services.gateway.prepare import encode_within, word_pieces

    text = text_for(BUILTIN_MODELS["qwen3-tiny"])
    assert "".join(word_pieces(sample, 1000)) == sample
    assert encode_within(text, sample, True, 10**9) == text.encode(sample, chat=True)
