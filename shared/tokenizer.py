"""Byte-level tokenizer and chat template: needs no download, identical in every service.

Token ids 0..255 are raw UTF-8 bytes; specials follow. The gateway counts tokens and
hashes prefix blocks with it; the engine encodes and decodes with it.
"""

from __future__ import annotations

import codecs
import hashlib
import struct
from collections.abc import Iterable, Sequence

BOS = 256
EOS = 257
VOCAB_SIZE = 260  # 256 bytes + BOS + EOS + 2 reserved
HASH_BLOCK_TOKENS = 16  # prefix-hash granularity shared by router policies and engines


def encode(text: str, *, bos: bool = True) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [BOS, *ids] if bos else ids


def decode(ids: Iterable[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns a token stream into text without splitting multi-byte characters."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id >= 256:
            return ""
        return self._dec.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    """A fixed, simple template: each turn tagged with its role, then the assistant cue.

    A continuation call repeats the previous turns verbatim, so its token ids start
    with the previous prompt plus the previous answer, which is what makes the KV prefix
    reusable across a session's calls.
    """
    parts = [f"<|{role}|>{content}<|end|>" for role, content in messages]
    parts.append("<|assistant|>")
    return "".join(parts)


def block_hashes(ids: Sequence[int], block: int = HASH_BLOCK_TOKENS, scope: str = "") -> list[int]:
    """Cumulative hashes of each full block: hash i covers ids[: (i+1)*block].

    `scope` salts the chain (like vLLM's `cache_salt`): equal prompts in different scopes
    (tenants) hash differently, so no cache, index or `cached_tokens` count matches across them.
    """
    prev = hashlib.blake2b(scope.encode(), digest_size=8).digest() if scope else b""
    return chain_block_hashes(ids, block, prev)[0]


def chain_block_hashes(ids: Sequence[int], block: int = HASH_BLOCK_TOKENS,
                       prev: bytes = b"") -> tuple[list[int], bytes]:
    """`block_hashes` continued from the digest `prev` of the blocks before `ids` (b"" at
    the start of an unscoped prompt): (hashes, digest to continue from). Chunked calls give
    the same hashes as one call over the concatenation (the simulator extends a session's prompt)."""
    out: list[int] = []
    for start in range(0, len(ids) - block + 1, block):
        h = hashlib.blake2b(prev, digest_size=8)
        h.update(_pack(ids[start : start + block]))
        prev = h.digest()
        out.append(int.from_bytes(prev, "big") >> 1)  # 63 bits: fits a Postgres BIGINT
    return out, prev


def _pack(ids: Sequence[int]) -> bytes:
    # Two bytes per id; ids past 0xFFFE (large vocabularies) are escaped as 0xFFFF + 4 bytes,
    # so the packing stays unambiguous and the built-in models' hashes are unchanged.
    if max(ids, default=0) < 0xFFFF:
        return struct.pack(f"<{len(ids)}H", *ids)  # the common case, without a Python loop
    buf = bytearray()
    for i in ids:
        buf += i.to_bytes(2, "little") if i < 0xFFFF else b"\xff\xff" + i.to_bytes(4, "little")
    return bytes(buf)
