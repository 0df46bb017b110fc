"""The gateway's session inference through prepare() and the Submitter's shell: named calls
untouched, inferred ids scoped to the tenant, KV scopes and salts right in every sharing mode,
and the answer's head read with each built-in model's tokenizer."""

from __future__ import annotations

import pytest

from talaria.services.gateway.auth import kv_scope
from talaria.services.gateway.prepare import prepare
from talaria.services.gateway.session_inferrer import SessionInferrer
from talaria.shared.catalog import BUILTIN_MODELS
from talaria.shared.messages import CallRequest, CallResult, ChatMessage, ErrorReply, Timings, Usage
from talaria.shared.metrics import FrontendMetrics
from talaria.shared.tokenizer import block_hashes

SYSTEM = ChatMessage("system", "You are an agent that fixes bugs in Python code. " * 30)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def request(model: str, turns: list[ChatMessage]) -> CallRequest:
    return CallRequest(model=model, messages=[SYSTEM, *turns], max_tokens=32)


def result(call, text: str) -> CallResult:
    return CallResult(call.call_id, call.session_id, 0, call.model, "agent-0", text, "stop", Usage(1, 1, 2), Timings())


def run(inferrer: SessionInferrer, req: CallRequest, tenant: str, sharing: str, answer: str | None):
    call = inferrer.resolve(prepare(BUILTIN_MODELS, req, None, "chat", tenant, sharing))
    inferrer.settle(call, result(call, answer) if answer else ErrorReply(503, "x", "x"))
    return call


@pytest.mark.parametrize("model", ["qwen3-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("sharing", ["tenant", "session", "global"])
def test_a_conversation_without_ids_is_one_session_in_every_sharing_mode(model, sharing):
    metrics = FrontendMetrics()
    inferrer = SessionInferrer(BUILTIN_MODELS, sharing, metrics, clock=Clock())
    turns = [ChatMessage("user", "the tests in test_parser.py fail, fix them")]
    calls = []
    for step in range(3):
        answer = f"Step {step}: I will open parser.py and look at the tokenizer loop first."
        call = run(inferrer, request(model, turns), "acme", sharing, answer)
        calls.append(call)
        turns += [ChatMessage("assistant", answer), ChatMessage("user", f"output of step {step}")]
    assert [c.session_origin for c in calls] == ["new", "continued", "continued"]
    assert len({c.session_id for c in calls}) == 1 and calls[0].session_id.startswith("acme:anon-")
    for c in calls:  # the KV salt is the one the mode gives the inferred session
        assert c.kv_scope == kv_scope(sharing, "acme", c.session_id)
        assert c.block_hashes == block_hashes(c.prompt_ids, scope=c.kv_scope)
    assert metrics.sessions_inferred.labels("continued")._value.get() == 2
    assert metrics.sessions_inferred.labels("new")._value.get() == 1


def test_a_named_call_is_left_as_it_is():
    inferrer = SessionInferrer(BUILTIN_MODELS, "session", clock=Clock())
    call = prepare(BUILTIN_MODELS, request("qwen3-tiny", [ChatMessage("user", "hi")]), "acme:mine", "chat",
                   "acme", "session")
    assert call.session_origin == "named" and inferrer.resolve(call) is call


def test_a_fork_under_session_sharing_keeps_its_parents_kv_scope():
    inferrer = SessionInferrer(BUILTIN_MODELS, "session", clock=Clock())
    first = [ChatMessage("user", "try two approaches")]
    answer = "I will try approach A and approach B, one after the other."
    root = run(inferrer, request("qwen3-tiny", first), "", "session", answer)
    base = [*first, ChatMessage("assistant", answer)]
    mine = ChatMessage("user", "A failed: " + "the parser still drops the last field of a line. " * 40)
    left = run(inferrer, request("qwen3-tiny", [*base, mine]), "", "session", "ok A")
    other = ChatMessage("user", "B passed: " + "all 40 tests of the parser are green now. " * 40)
    right = run(inferrer, request("qwen3-tiny", [*base, other]), "", "session", "ok B")
    assert (left.session_origin, left.session_id) == ("continued", root.session_id)
    assert right.session_origin == "forked" and right.session_id != root.session_id
    assert right.kv_scope == root.kv_scope == f"session:{root.session_id}"
    assert right.block_hashes[:4] == root.block_hashes[:4]  # the fork reuses its parent's KV


def test_a_failed_call_records_no_turn():
    inferrer = SessionInferrer(BUILTIN_MODELS, clock=Clock())
    run(inferrer, request("qwen3-tiny", [ChatMessage("user", "x")]), "", "tenant", None)
    assert inferrer.index.turns("") == 0


@pytest.mark.parametrize("model", ["qwen3-tiny", "gpt2-tiny"])
def test_the_answer_head_is_its_tokens_in_the_next_prompt(model):
    inferrer = SessionInferrer(BUILTIN_MODELS)
    head = inferrer.answer_ids(model, "Let me look at the failing test. " * 50)
    full = prepare(BUILTIN_MODELS, request(model, [ChatMessage("assistant", "Let me look at the failing test. " * 50)]),
                   "s", "chat").prompt_ids
    assert 0 < len(head) <= 16
    assert any(full[i:i + len(head)] == head for i in range(len(full)))


def test_a_duplicate_call_id_claims_nothing_and_leaves_the_first_calls_turn():
    inferrer = SessionInferrer(BUILTIN_MODELS, clock=Clock())
    turns = [ChatMessage("user", "task")]
    first = run(inferrer, request("qwen3-tiny", turns), "", "tenant", "an answer long enough to check")
    turns += [ChatMessage("assistant", "an answer long enough to check"), ChatMessage("user", "result")]
    pending = prepare(BUILTIN_MODELS, request("qwen3-tiny", turns), None, "chat")
    mine = inferrer.resolve(pending)
    duplicate = inferrer.resolve(pending)  # the same call id again while the first is in flight
    assert (mine.session_origin, duplicate.session_origin) == ("continued", "new")
    inferrer.settle(mine, result(mine, "next answer"))
    assert mine.session_id == first.session_id and inferrer.index.turns("") == 2
