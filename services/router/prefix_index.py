"""Approximate per-instance prefix index over cumulative block hashes.

`CallSubmitted.block_hashes[p]` hashes the whole prompt up to block p (shared/tokenizer.py),
so "the instance holds hash p" implies it holds every earlier block of that prompt: a match
is monotone in p, and the longest match is a binary search, not a tree walk.

To keep memory and fold time bounded we index a fixed set of *sampled* positions,
`SAMPLED` = blocks 0..15, then every 16th block up to 64 positions (~12.5K tokens at 16
tokens/block). A match is therefore exact up to 256 tokens and then rounded down to the
nearest 256-token step, up to the cap. This is the router's own prediction from routed
calls (like sgl-router's approximate tree and Dynamo's ApproxKvIndexer), not engine truth.
A soft cache: not persisted by `RouterState.to_dict`, it refills from routed calls after a
restart (Dynamo documents the same for its approximate indexer).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from talaria.shared.tokenizer import HASH_BLOCK_TOKENS

SAMPLED: tuple[int, ...] = tuple(range(16)) + tuple(15 + 16 * k for k in range(1, 49))
INDEXED_BLOCKS = SAMPLED[-1] + 1  # no block past this one is ever read
INDEXED_TOKENS = INDEXED_BLOCKS * HASH_BLOCK_TOKENS  # the longest match the index can report


@dataclass
class PrefixIndex:
    """The index's tables:

        by_model[m][hash] -> {instance_id: session that last sent it there}
        lru[instance_id]  -> OrderedDict[(model, hash)] in insertion/refresh order, capped
    """

    max_entries_per_instance: int = 65_536
    by_model: dict[str, dict[int, dict[str, str]]] = field(default_factory=dict)
    lru: dict[str, OrderedDict] = field(default_factory=dict)

    def insert(self, instance_id: str, model: str, session_id: str, hashes: list[int]) -> None:
        if not hashes:
            return
        table = self.by_model.setdefault(model, {})
        lru = self.lru.get(instance_id)
        if lru is None:
            lru = self.lru[instance_id] = OrderedDict()
        n = len(hashes)
        for p in SAMPLED:
            if p >= n:
                break
            h = hashes[p]
            holders = table.get(h)
            if holders is None:
                holders = table[h] = {}
            holders[instance_id] = session_id
            key = (model, h)
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
        while len(lru) > self.max_entries_per_instance:
            (old_model, old_hash), _ = lru.popitem(last=False)
            self._unlink(old_model, old_hash, instance_id)

    def forget_instance(self, instance_id: str) -> None:
        lru = self.lru.pop(instance_id, None) or {}
        for model, h in lru:
            self._unlink(model, h, instance_id)

    def size(self, instance_id: str) -> int:
        """Indexed entries for the instance: sgl-router's "tree size" for its fallback."""
        lru = self.lru.get(instance_id)
        return len(lru) if lru is not None else 0

    def match(self, model: str, hashes: list[int]) -> dict[str, tuple[int, str]]:
        """instance -> (matched tokens, session that left the prefix there), longest first."""
        table = self.by_model.get(model)
        if not table or not hashes:
            return {}
        levels: list[dict[str, str]] = []
        n = len(hashes)
        for p in SAMPLED:
            if p >= n:
                break
            holders = table.get(hashes[p])
            if not holders:
                break
            levels.append(holders)
        if not levels:
            return {}
        last = len(levels) - 1
        deepest = levels[last]
        full = (SAMPLED[last] + 1) * HASH_BLOCK_TOKENS
        out = {i: (full, s) for i, s in deepest.items()}  # common case: a fully shared prefix
        if len(out) < len(levels[0]):
            for instance_id in levels[0]:
                if instance_id not in out:
                    depth = _deepest(levels, instance_id)
                    out[instance_id] = ((SAMPLED[depth] + 1) * HASH_BLOCK_TOKENS, levels[depth][instance_id])
        return out

    def _unlink(self, model: str, h: int, instance_id: str) -> None:
        table = self.by_model.get(model)
        holders = table.get(h) if table else None
        if holders is not None:
            holders.pop(instance_id, None)
            if not holders:
                del table[h]


def _deepest(levels: list[dict[str, str]], instance_id: str) -> int:
    """Last level holding `instance_id`; levels are monotone per instance (binary search)."""
    lo, hi = 0, len(levels) - 1  # levels[lo] holds it
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if instance_id in levels[mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
