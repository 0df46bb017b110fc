"""Clients that send no session id, in the simulator (issue 41, ask 4).

`RunConfig.session_ids`: `named` (the call's true id, the default); `inferred` (talaria's
gateway: the live SessionIndex, services/gateway/session_inference.py, infers the session from
the call's block hashes and token ids); `per-call` (a peer's router without a session key:
every call its own session; vllm-stack-session then takes its no-key rule).
`without_ids(policy)` is what a configuration does without ids. Only the router and the
agent's scheduler see the visible id; the engine's KV (content-addressed live) and the
metrics (SCT per true session) stay keyed by the true session.

Fabricated, the simulator having no text: token ids drawn per (session, call) as
agents.PromptHashes draws them, over the whole prompt; an answer is `output` ids appended to
the session's context at completion, so the next prompt repeats it where the trace reuses the
previous prompt and answer. A live gateway has the same: the prompt and the answer it sent.
"""

from __future__ import annotations

import random

import msgspec

from talaria.services.gateway.session_inference import ANSWER_TOKENS, Inferred, SessionIndex
from talaria.shared.events import CallCompleted
from talaria.shared.snapshots import InstanceSnapshot
from talaria.shared.tokenizer import chain_block_hashes
from talaria.sim.agents import PromptHashes

SESSION_IDS = ("named", "inferred", "per-call")
TENANT = "sim"  # one tenant: every simulated session may continue any other's turn (the hard case)
_SHARED_CHUNK = 4096  # the shared prefix is drawn in chunks, so any length is a prefix of a longer one


def without_ids(policy: str) -> str:
    """What a deployment does with calls that name no session: talaria's gateway infers them;
    a peer's router has no session key."""
    return "inferred" if policy == "talaria" else "per-call"


class PromptTokens(PromptHashes):
    """PromptHashes over the whole prompt, and the answer appended once a call completes."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed, horizon_blocks=1 << 40)

    def ids(self, session: str) -> bytearray:
        return self._ids.get(session, bytearray())

    def answered(self, session: str, index: int, output: int) -> bytes:
        """Append call `index`'s answer (`output` tokens) to the session's context; its ids."""
        answer = random.Random(f"{self.seed}/{session}/{index}/answer").randbytes(max(0, output))
        ids = self._ids.setdefault(session, bytearray())
        digests, hashes = self._digests.setdefault(session, []), self._hashes.setdefault(session, [])
        ids += answer
        prev = digests[-1] if digests else b""
        for k in range(len(digests), len(ids) // self.block):  # keep every full block hashed
            h, prev = chain_block_hashes(ids[k * self.block:(k + 1) * self.block], self.block, prev)
            hashes.append(h[0])
            digests.append(prev)
        return answer

    def _shared(self, model: str, tokens: int) -> bytes:
        have = self._common.get(model, b"")
        while len(have) < tokens:
            chunk = len(have) // _SHARED_CHUNK
            have += random.Random(f"{self.seed}/shared/{model}/{chunk}").randbytes(_SHARED_CHUNK)
        self._common[model] = have
        return have


class AnonymousSessions:
    """The visible session of each call of a run whose clients name none (module doc)."""

    def __init__(self, mode: str, seed: int = 0) -> None:
        if mode not in SESSION_IDS[1:]:
            raise ValueError(f"session_ids must be one of {SESSION_IDS}, not {mode!r}")
        self.mode = mode
        self.tokens = PromptTokens(seed)
        self.index = SessionIndex() if mode == "inferred" else None
        self.visible: dict[str, str] = {}  # call id -> the session its router sees
        self.origin: dict[str, str] = {}  # call id -> its session_origin
        self.latest: dict[str, str] = {}  # true session -> the visible id of its latest routed call
        self._claims: dict[str, tuple[Inferred, list[int]]] = {}  # call id -> decision, its hashes
        self.kinds: dict[str, int] = {"new": 0, "continued": 0, "forked": 0}
        # measured against the truth, never shown to the index: calls put in another's session
        self._owner: dict[str, str] = {}  # inferred id -> the true session that started it
        self.merged = 0

    def hashes(self, session: str, index: int, prompt: int, reusable: int, shared: int, model: str) -> list[int]:
        """The call's block hashes over its whole prompt (the router reads its first blocks)."""
        return self.tokens.for_call(session, index, prompt, reusable, shared, model)

    def submit(self, call_id: str, session: str, hashes: list[int], now: float) -> str:
        """The call's visible session, decided once when the client sends it (a retry after a
        503 keeps it: live, the released turn is claimed again by the same prompt)."""
        if self.index is None:
            self.visible[call_id], self.origin[call_id] = call_id, "new"
            self.kinds["new"] += 1
            return call_id
        got = self.index.infer(TENANT, hashes, self.tokens.ids(session), now, f"anon-{call_id}")
        self._claims[call_id] = (got, hashes)
        self.visible[call_id], self.origin[call_id] = got.session_id, got.kind
        self.kinds[got.kind] += 1
        self.merged += self._owner.setdefault(got.session_id, session) != session
        return got.session_id

    def routed(self, call_id: str, session: str) -> None:
        self.latest[session] = self.visible[call_id]

    def answered(self, done: CallCompleted, session: str, index: int, output: int, now: float) -> CallCompleted:
        """The call completed: record its turn (inference) and its answer in the session's
        context; the completion as its router knows it (under the visible session)."""
        claim = self._claims.pop(done.call_id, None)
        prompt = bytes(self.tokens.ids(session))  # still this call's: the next is not released yet
        visible = self.visible.pop(done.call_id)
        self.origin.pop(done.call_id, None)
        answer = self.tokens.answered(session, index, output)
        if claim is not None and self.index is not None:
            self.index.record(TENANT, visible, claim[1], prompt, answer[:ANSWER_TOKENS], "", now)
        return msgspec.structs.replace(done, session_id=visible)

    def gave_up(self, call_id: str, session: str) -> None:
        """The call exhausted its retries: its session ends here."""
        claim = self._claims.pop(call_id, None)
        if claim is not None and self.index is not None:
            self.index.release(TENANT, claim[0])
        self.visible.pop(call_id, None)
        self.origin.pop(call_id, None)
        self.forget(session)

    def forget(self, session: str) -> None:
        self.tokens.forget(session)

    def relabel(self, snap: InstanceSnapshot) -> InstanceSnapshot:
        """The snapshot with each session's KV under the id its agent was last given."""
        if not snap.sessions:
            return snap
        latest = self.latest
        return msgspec.structs.replace(snap, sessions=[
            msgspec.structs.replace(kv, session_id=latest.get(kv.session_id, kv.session_id)) for kv in snap.sessions])
