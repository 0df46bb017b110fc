"""The client side of the simulator: what an agent session does with each of its calls.

`RetryPolicy`: a rejected call is retried after Retry-After, as the OpenAI and Anthropic SDKs do,
up to an agent harness's bound; a call that gives up counts as SCT = inf, so dropping work can
only make a run look worse. `PromptHashes`: the block hashes the gateway would compute for each
call's prompt, from synthetic token ids that share what the trace says is reusable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from talaria.services.router.prefix_index import INDEXED_BLOCKS
from talaria.shared.tokenizer import HASH_BLOCK_TOKENS, chain_block_hashes


@dataclass(frozen=True)
class RetryPolicy:
    """A rejected call (503 + Retry-After) is retried after Retry-After, as the
    OpenAI and Anthropic Python SDKs do (they honour a Retry-After of up to 60 s, else back
    off 0.5 s * 2**attempt up to 8 s). The SDKs stop after 2 retries by default; an agent
    harness wraps them and keeps retrying, so the bound here is `max_retries` = 10 [asm].
    The wait counts in the session's SCT (the call's TTFT keeps counting from its first
    release). A call that exhausts the bound gives up and its session never completes:
    metrics count it as SCT = inf, TTFT = inf, so dropping work can only make a run look worse.
    """

    max_retries: int = 10  # [asm] an agent harness's bound (the SDKs alone stop at 2)
    retry_after_cap_s: float = 60.0  # SDKs: a Retry-After above this is ignored
    backoff_initial_s: float = 0.5  # SDKs: without Retry-After, 0.5 s * 2**attempt ...
    backoff_max_s: float = 8.0  # ... up to 8 s (jitter left out: deterministic runs)

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, not {self.max_retries}")

    def wait_s(self, attempt: int, retry_after_s: float | None) -> float | None:
        """Seconds before retry number `attempt` (1-based), or None: give up."""
        if attempt > self.max_retries:
            return None
        if retry_after_s is not None and 0 < retry_after_s <= self.retry_after_cap_s:
            return retry_after_s
        return min(self.backoff_max_s, self.backoff_initial_s * 2 ** (attempt - 1))


class PromptHashes:
    """Per session, the token ids of its context (up to the index horizon) and the chain
    digests after each block, so a call hashes only the blocks it does not share.

    The block hashes the gateway would put in `CallSubmitted.block_hashes`
    for each call's prompt (shared/tokenizer.py's chained hashing over the token ids). The
    simulator has no text, so a session's token ids are synthetic bytes drawn per
    (session, call): the first `reusable_prefix_tokens` of a call's prompt are the same ids
    as the session's previous context, the rest are new. A prompt that starts afresh (a
    session's first call, or one after compaction) opens with its model's shared prefix
    (`shared` tokens: a system prompt and tool schema every session of the model sends, ids
    drawn per model), so prefix matches also cross sessions; without it sessions share nothing.
    Only the first `INDEXED_BLOCKS` blocks are hashed: the router's prefix index reads no
    block past its last sampled position (services/router/prefix_index.py), so the rest
    would change no decision.
    """

    def __init__(self, seed: int = 0, horizon_blocks: int = INDEXED_BLOCKS,
                 block: int = HASH_BLOCK_TOKENS) -> None:
        self.seed = seed
        self.block = block
        self.horizon = horizon_blocks * block
        self._ids: dict[str, bytearray] = {}
        self._digests: dict[str, list[bytes]] = {}  # digest after block k
        self._hashes: dict[str, list[int]] = {}
        self._common: dict[str, bytes] = {}  # model -> its shared prefix's ids (to the horizon)

    def for_call(self, session: str, index: int, prompt: int, reusable: int, shared: int = 0,
                 model: str = "") -> list[int]:
        """The hashes of call `index`'s prompt (prompt tokens, of which `reusable` continue
        the session's previous context and the first `shared` are the model's shared prefix)."""
        ids = self._ids.get(session, bytearray())
        keep = min(max(0, reusable), len(ids), self.horizon) if index > 0 else 0
        want = min(prompt, self.horizon)
        if want > keep:
            rng = random.Random(f"{self.seed}/{session}/{index}")
            ids = ids[:keep] + rng.randbytes(want - keep)
            common = min(shared, want)
            if common > keep:  # a fresh prompt opens with the model's shared prefix
                ids[keep:common] = self._shared(model, common)[keep:common]
        else:
            ids = ids[:want]
        blocks = len(ids) // self.block
        kept = min(keep // self.block, blocks)
        digests = self._digests.get(session, [])[:kept]
        hashes = self._hashes.get(session, [])[:kept]
        if blocks > kept:
            prev = digests[-1] if digests else b""
            for k in range(kept, blocks):  # one block at a time: keep every digest
                h, prev = chain_block_hashes(ids[k * self.block:(k + 1) * self.block], self.block, prev)
                hashes.append(h[0])
                digests.append(prev)
        self._ids[session], self._digests[session], self._hashes[session] = ids, digests, hashes
        return list(hashes)

    def _shared(self, model: str, tokens: int) -> bytes:
        have = self._common.get(model, b"")
        if len(have) < tokens:
            have = self._common[model] = random.Random(f"{self.seed}/shared/{model}").randbytes(self.horizon)
        return have

    def forget(self, session: str) -> None:
        for d in (self._ids, self._digests, self._hashes):
            d.pop(session, None)
