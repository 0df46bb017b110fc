"""Which live session a call that names none continues, read off its tokens.

An agent's next prompt is its previous prompt, the answer it was given, then what it adds
(a tool result, a user turn). A call continues a session's last turn when it repeats that
turn exactly: every full block of the turn's prompt (one chained block hash, as prepare()
computed it) and the tokens after them, through the first ANSWER_TOKENS of the answer.
Anything less (a shared system prompt, a prompt cut mid-turn, the same prompt asked again)
starts a session. A turn already continued that is extended again is a fork: a new session
that keeps its parent's KV scope, unless the call also repeats the session's newest prompt
but for its last RERENDERED_TAIL_TOKENS (clients that rewrite the end of the last message,
as Claude Code moves its reminders): that continues the session. State is per tenant (never shared), at most `max_turns`
turns each, and a turn is forgotten `horizon_s` after it was answered. Pure: the clock is
passed in; the gateway's Submitter is the shell (SessionInferrer).
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from talaria.shared.tokenizer import HASH_BLOCK_TOKENS

ANSWER_TOKENS = 16  # answer tokens a continuation must repeat: tells apart two sessions asked the same
# A call that repeats a session's earlier turn whole and its newest prompt but for this many
# final tokens continues the session: the client re-rendered the end of its last message.
# 512: on the WEKA Claude Code traces 134 continuations rewrite 129-512 tokens, 23 more
# (results/session_attribution.md); a sibling's fork adding less is taken for a rewrite.
RERENDERED_TAIL_TOKENS = 512
MAX_TURNS = 8192  # per tenant: ~1.4 KB each (measured, the prompt freed), so ~12 MB per tenant at most
HORIZON_S = 3600.0  # the longest tool or user gap after which a session is still recognised

Kind = Literal["new", "continued", "forked"]


@dataclass(eq=False, slots=True)
class Turn:
    """A session's answered call: what a continuation must repeat."""

    session_id: str
    blocks: int  # full blocks of its prompt (>= 1)
    key: int  # its prompt's chained hash at block `blocks - 1`
    expect: bytes  # the prompt's tokens past those blocks, then the answer's first tokens (packed)
    kv_scope: str
    at: float
    tail_keys: Sequence[int] = ()  # its prompt's hashes at the blocks before `key`, nearest last (an array: 8 B each)
    continued: bool = False  # a call has claimed it (a second one is a fork)


@dataclass(frozen=True)
class Inferred:
    """The decision for one call: its session, how it was found, the KV scope it runs in
    (None: the one its sharing mode gives a new session), and the turn it claimed."""

    session_id: str
    kind: Kind
    kv_scope: str | None = None
    parent: str | None = None  # the session a continuation or fork extends
    turn: Turn | None = field(default=None, compare=False)


@dataclass
class _Tenant:
    keys: set[int] = field(default_factory=set)  # every turn's key: one C-speed intersection per call
    shapes: dict[int, Counter[tuple[int, int]]] = field(default_factory=dict)  # key -> (blocks, tokens in expect)
    turns: dict[tuple[int, bytes], list[Turn]] = field(default_factory=dict)  # (key, expect)
    order: OrderedDict[int, Turn] = field(default_factory=OrderedDict)  # by answer time, oldest first
    newest: dict[str, Turn] = field(default_factory=dict)  # each session's newest turn


class SessionIndex:
    """Per-tenant turns of live sessions; `infer` a call's session, `record` its answered turn."""

    def __init__(self, max_turns: int = MAX_TURNS, horizon_s: float = HORIZON_S,
                 block: int = HASH_BLOCK_TOKENS, answer_tokens: int = ANSWER_TOKENS,
                 rerendered_tail: int = RERENDERED_TAIL_TOKENS) -> None:
        if max_turns < 1 or horizon_s <= 0 or rerendered_tail < 0:
            raise ValueError("max_turns and horizon_s must be positive, rerendered_tail not negative")
        self.max_turns, self.horizon_s, self.block, self.answer_tokens = max_turns, horizon_s, block, answer_tokens
        self.rerendered_tail = rerendered_tail
        self._tenants: dict[str, _Tenant] = {}

    def turns(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return len(t.order) if t is not None else 0

    def infer(self, tenant: str, hashes: Sequence[int], ids: Sequence[int], now: float, new_id: str) -> Inferred:
        """The session of a call with these block hashes (not salted by a session) and prompt
        ids; `new_id` if it starts one. A continued turn is claimed: a second call extending
        it forks."""
        t = self._tenants.get(tenant)
        if t is not None:
            self._expire(t, now)
            match = self._longest(t, hashes, ids)
            if match is not None:
                open_turn = next((x for x in reversed(match) if not x.continued), None)
                if open_turn is not None:
                    open_turn.continued = True
                    return Inferred(open_turn.session_id, "continued", open_turn.kv_scope,
                                    open_turn.session_id, open_turn)
                parent = match[-1]
                newest = t.newest.get(parent.session_id)
                if newest is not None and not newest.continued and self._repeats_most(newest, parent, hashes):
                    newest.continued = True
                    return Inferred(newest.session_id, "continued", newest.kv_scope, newest.session_id, newest)
                return Inferred(new_id, "forked", parent.kv_scope, parent.session_id)
        return Inferred(new_id, "new")

    def release(self, tenant: str, inferred: Inferred) -> None:
        """The continuation failed: its turn may be continued again (the client retries it)."""
        if inferred.turn is not None and inferred.turn.continued:
            t = self._tenants.get(tenant)
            if t is not None and t.order.get(id(inferred.turn)) is inferred.turn:
                inferred.turn.continued = False

    def record(self, tenant: str, session_id: str, hashes: Sequence[int], ids: Sequence[int],
               answer: Sequence[int], kv_scope: str, now: float) -> bool:
        """Remember an answered call as its session's newest turn. False when it cannot be
        continued by inference: a prompt under one block, or an empty answer."""
        blocks = len(hashes)
        if blocks < 1 or not answer:
            return False
        t = self._tenants.setdefault(tenant, _Tenant())
        tail = max(0, blocks - 1 - self.rerendered_tail // self.block)
        turn = Turn(session_id, blocks, hashes[blocks - 1],
                    _packed([*ids[blocks * self.block:], *answer[: self.answer_tokens]]), kv_scope, now,
                    array("q", hashes[tail:blocks - 1]))
        t.newest[session_id] = turn
        t.keys.add(turn.key)
        t.shapes.setdefault(turn.key, Counter())[(blocks, len(turn.expect) // 8)] += 1
        t.turns.setdefault((turn.key, turn.expect), []).append(turn)
        t.order[id(turn)] = turn
        self._expire(t, now)
        return True

    def _longest(self, t: _Tenant, hashes: Sequence[int], ids: Sequence[int]) -> list[Turn] | None:
        """The turns repeated by the longest prefix of this prompt (most recent last), or None.
        The prompt's hashes that are some turn's key come from one set intersection (a miss
        costs no Python loop over the prompt); each is then checked at its turns' lengths."""
        m, best, found = len(hashes), 0, []
        for key in t.keys.intersection(hashes):
            for blocks, n in t.shapes[key]:
                if best <= blocks <= m and hashes[blocks - 1] == key:
                    start = blocks * self.block
                    turns = t.turns.get((key, _packed(ids[start:start + n])))
                    if turns:
                        found = turns if blocks > best else found + turns
                        best = blocks
        return sorted(found, key=lambda x: x.at) if found else None

    def _repeats_most(self, newest: Turn, parent: Turn, hashes: Sequence[int]) -> bool:
        """Whether a call that extends `parent` (an earlier turn of the session) also repeats
        `newest`'s prompt but for its re-rendered tail, past `parent`'s prompt."""
        for d, key in enumerate(reversed(newest.tail_keys), 1):
            j = newest.blocks - 1 - d  # block index of `key`
            if j < parent.blocks:
                return False
            if j < len(hashes) and hashes[j] == key:
                return True
        return False

    def _expire(self, t: _Tenant, now: float) -> None:
        while t.order:
            oldest = next(iter(t.order.values()))
            if len(t.order) <= self.max_turns and now - oldest.at <= self.horizon_s:
                break
            self._drop(t, oldest)

    def _drop(self, t: _Tenant, turn: Turn) -> None:
        del t.order[id(turn)]
        same = t.turns[(turn.key, turn.expect)]
        same.remove(turn)
        if not same:
            del t.turns[(turn.key, turn.expect)]
        shapes = t.shapes[turn.key]
        shapes[(turn.blocks, len(turn.expect) // 8)] -= 1
        if not shapes[(turn.blocks, len(turn.expect) // 8)]:
            del shapes[(turn.blocks, len(turn.expect) // 8)]
        if not shapes:
            del t.shapes[turn.key]
            t.keys.discard(turn.key)
        if t.newest.get(turn.session_id) is turn:
            del t.newest[turn.session_id]


def _packed(tokens: Sequence[int]) -> bytes:
    """Token ids as 8 bytes each: a turn keeps no int objects alive (~0.8 KB less per turn)."""
    packed = array("q")
    packed.extend(tokens)  # not array("q", tokens): that reads a bytes-like (the simulator's ids) as raw memory
    return packed.tobytes()
