"""Session inference over real prompts: rendered with the byte model's chat template,
hashed as the gateway hashes them (block_hashes), driven with an explicit clock."""

from __future__ import annotations

import uuid

import pytest

from talaria.services.gateway.session_inference import SessionIndex
from talaria.shared import tokenizer as tok

SYSTEM = "You are a careful software engineer. " * 20  # a shared system prompt of many blocks


def prompt(*turns: tuple[str, str]) -> list[int]:
    return tok.encode(tok.render_chat([("system", SYSTEM), *turns]))


def answer(text: str) -> list[int]:
    return tok.encode(text, bos=False)


class Agent:
    """One conversation: each call repeats the last prompt, its answer and a tool result."""

    def __init__(self, task: str) -> None:
        self.turns: list[tuple[str, str]] = [("user", task)]

    def ids(self) -> list[int]:
        return prompt(*self.turns)

    def answered(self, text: str, tool_result: str) -> None:
        self.turns += [("assistant", text), ("tool", tool_result)]


def call(index: SessionIndex, tenant: str, ids: list[int], now: float):
    return index.infer(tenant, tok.block_hashes(ids), ids, now, f"anon-{uuid.uuid4().hex}")


def done(index: SessionIndex, tenant: str, session: str, ids: list[int], text: str, now: float) -> None:
    assert index.record(tenant, session, tok.block_hashes(ids), ids, answer(text), "", now)


def test_two_interleaved_conversations_with_one_system_prompt_are_two_sessions():
    index = SessionIndex()
    a, b = Agent("fix the bug in parser.py"), Agent("add a test for the cli")
    sessions = {"a": [], "b": []}
    for step in range(3):
        for name, agent in (("a", a), ("b", b)):
            ids = agent.ids()
            got = call(index, "", ids, now=step)
            sessions[name].append(got)
            text = f"<tool_call>run step {step} of {name}</tool_call>"
            done(index, "", got.session_id, ids, text, now=step + 0.5)
            agent.answered(text, f"output of step {step} for {name}")
    for name in "ab":
        kinds = [g.kind for g in sessions[name]]
        assert kinds == ["new", "continued", "continued"], (name, kinds)
        assert len({g.session_id for g in sessions[name]}) == 1
    assert sessions["a"][0].session_id != sessions["b"][0].session_id


def test_sharing_only_the_system_prompt_never_merges():
    index = SessionIndex()
    first = prompt(("user", "task one"))
    got = call(index, "", first, 0)
    done(index, "", got.session_id, first, "a long enough answer to the first task", 1)
    other = prompt(("user", "task two, a different one"))
    assert call(index, "", other, 2).kind == "new"


def test_the_same_prompt_asked_again_is_a_new_session_not_a_continuation():
    index = SessionIndex()
    ids = prompt(("user", "the same benchmark task"))
    first = call(index, "", ids, 0)
    done(index, "", first.session_id, ids, "answer one, long enough to be checked", 1)
    again = call(index, "", ids, 2)  # a second agent on the same task: no answer in its prompt
    assert again.kind == "new" and again.session_id != first.session_id


def test_a_prefix_shorter_than_the_whole_previous_turn_never_merges():
    index = SessionIndex()
    agent = Agent("refactor module x")
    ids = agent.ids()
    got = call(index, "", ids, 0)
    done(index, "", got.session_id, ids, "I will read the file first and then edit it", 1)
    cut = ids[: len(ids) - 20] + answer("I will read the file first and then edit it")
    assert call(index, "", cut, 2).kind == "new"


def test_two_sessions_with_identical_turns_continue_one_each():
    index = SessionIndex()
    ids = prompt(("user", "same task"))
    s1, s2 = call(index, "", ids, 0), call(index, "", ids, 0)
    text = "identical greedy answer from the model"
    done(index, "", s1.session_id, ids, text, 1)
    done(index, "", s2.session_id, ids, text, 1)
    nxt = prompt(("user", "same task"), ("assistant", text), ("tool", "same result"))
    got = {call(index, "", nxt, 2).session_id, call(index, "", nxt, 2).session_id}
    assert got == {s1.session_id, s2.session_id}


def test_a_fork_continues_one_session_and_starts_another_with_its_kv_scope():
    index = SessionIndex()
    agent = Agent("explore two fixes")
    ids = agent.ids()
    root = call(index, "", ids, 0)
    text = "try both approaches in parallel please"
    assert index.record("", root.session_id, tok.block_hashes(ids), ids, answer(text), "scope-root", 1)
    agent.answered(text, "tool says A")
    left = call(index, "", agent.ids(), 2)
    right_ids = prompt(("user", "explore two fixes"), ("assistant", text), ("tool", "tool says B"))
    right = call(index, "", right_ids, 2)
    assert (left.kind, left.session_id) == ("continued", root.session_id)
    assert right.kind == "forked" and right.session_id != root.session_id
    assert right.parent == root.session_id and right.kv_scope == "scope-root"


def test_a_client_that_rewrites_the_end_of_its_last_message_stays_in_its_session():
    """Claude Code moves its reminders: the next prompt repeats the newest one but its end."""
    index = SessionIndex()
    agent = Agent("long task")
    ids = agent.ids()
    root = call(index, "", ids, 0)
    done(index, "", root.session_id, ids, "first answer, a tool call", 1)
    agent.answered("first answer, a tool call", "tool output " * 20 + "<reminder>todo list</reminder>")
    ids = agent.ids()
    second = call(index, "", ids, 2)
    done(index, "", second.session_id, ids, "second answer, another tool call", 3)
    agent.turns[-1] = ("tool", "tool output " * 20)  # the reminder is gone from the old message
    agent.answered("second answer, another tool call", "more output")
    third = call(index, "", agent.ids(), 4)
    assert (third.kind, third.session_id) == ("continued", root.session_id)


def _sibling_after_its_answer(index: SessionIndex, output: str):
    """A session's second call (ending in the tool result `output`) answered, then a call that
    repeats its first turn whole and its second prompt up to that tool result, which differs."""
    agent = Agent("long task")
    ids = agent.ids()
    root = call(index, "", ids, 0)
    done(index, "", root.session_id, ids, "first answer, a tool call", 1)
    agent.answered("first answer, a tool call", output)
    ids = agent.ids()
    done(index, "", call(index, "", ids, 2).session_id, ids, "second answer", 3)
    agent.turns[-1] = ("tool", "a different tool output")
    return root, call(index, "", agent.ids(), 4)


def test_a_fork_that_differs_past_the_rewritable_tail_is_a_fork():
    index = SessionIndex()
    assert _sibling_after_its_answer(index, "tool output " * 50)[1].kind == "forked"  # 600 tokens


def test_the_rewritable_tail_is_a_setting():
    """The same call is a rewrite of the newest prompt (it differs in its last ~250 tokens) under
    the default tail, and a fork when the tail is shorter than what it rewrites."""
    root, got = _sibling_after_its_answer(SessionIndex(), "tool output " * 20)
    assert (got.kind, got.session_id) == ("continued", root.session_id)
    assert _sibling_after_its_answer(SessionIndex(rerendered_tail=128), "tool output " * 20)[1].kind == "forked"


def test_a_failed_continuation_releases_its_turn_for_the_retry():
    index = SessionIndex()
    agent = Agent("task")
    ids = agent.ids()
    root = call(index, "", ids, 0)
    done(index, "", root.session_id, ids, "an answer of some length", 1)
    agent.answered("an answer of some length", "result")
    first = call(index, "", agent.ids(), 2)
    index.release("", first)  # the call failed: its client sends it again
    retry = call(index, "", agent.ids(), 3)
    assert (retry.kind, retry.session_id) == ("continued", root.session_id)


def test_never_across_tenants():
    index = SessionIndex()
    agent = Agent("shared prompt in two tenants")
    ids = agent.ids()
    mine = call(index, "t1", ids, 0)
    done(index, "t1", mine.session_id, ids, "the answer given to tenant one", 1)
    agent.answered("the answer given to tenant one", "result")
    assert call(index, "t2", agent.ids(), 2).kind == "new"
    assert call(index, "t1", agent.ids(), 2).session_id == mine.session_id


def test_turns_expire_with_the_horizon():
    index = SessionIndex(horizon_s=60)
    agent = Agent("slow task")
    ids = agent.ids()
    got = call(index, "", ids, 0)
    done(index, "", got.session_id, ids, "an answer, then a long pause", 10)
    agent.answered("an answer, then a long pause", "result")
    assert call(index, "", agent.ids(), 71).kind == "new"
    assert index.turns("") == 0
    t = index._tenants[""]  # nothing of the expired turn stays behind
    assert not (t.keys or t.shapes or t.turns or t.newest or t.order)


def test_memory_per_tenant_is_bounded_oldest_first():
    index = SessionIndex(max_turns=3)
    agents = [Agent(f"task number {i}") for i in range(5)]
    for i, agent in enumerate(agents):
        ids = agent.ids()
        got = call(index, "", ids, i)
        done(index, "", got.session_id, ids, f"answer number {i} is here", i)
        agent.answered(f"answer number {i} is here", "ok")
    assert index.turns("") == 3
    assert call(index, "", agents[0].ids(), 9).kind == "new"  # forgotten
    assert call(index, "", agents[4].ids(), 9).kind == "continued"


def test_an_empty_answer_or_a_tiny_prompt_is_not_recorded():
    index = SessionIndex()
    ids = prompt(("user", "x"))
    assert not index.record("", "s", tok.block_hashes(ids), ids, [], "", 0)
    assert not index.record("", "s", [], ids[:5], answer("hello"), "", 0)
    assert index.turns("") == 0


def test_settings_are_checked():
    with pytest.raises(ValueError):
        SessionIndex(max_turns=0)
    with pytest.raises(ValueError):
        SessionIndex(rerendered_tail=-1)


def test_a_turn_keeps_under_two_kilobytes_once_its_prompt_is_gone():
    """The documented bound (MAX_TURNS turns of ~1.4 KB per tenant) holds with 200-block prompts:
    a turn keeps no int objects of the prompt alive."""
    import gc
    import random
    import tracemalloc

    index, rng, n = SessionIndex(), random.Random(0), 300
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            ids = [rng.randrange(150_000) for _ in range(200 * tok.HASH_BLOCK_TOKENS + 7)]
            hashes = [rng.getrandbits(63) for _ in range(200)]
            answer_ids = [rng.randrange(150_000) for _ in range(16)]
            assert index.record("", f"s{i}", hashes, ids, answer_ids, "scope", float(i))
            del ids, hashes, answer_ids
        gc.collect()
        per_turn = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert per_turn < 2048, per_turn
