"""HKVR as SGLang's HiCache storage backend (NEVER RUN; see sglang_engine.py): SGLang's
hierarchical cache writes KV pages through to this store and prefetches them back, and the
host KV registry's bookkeeping (memory/hkvr_core.py: slots, LRU with pins, publication only
once a page is whole) decides what it holds.

SGLang loads it through its `dynamic` backend factory (`hicache_storage_backend="dynamic"`,
extra config {backend_name, module_path, class_name}) as `TalariaHiCacheStorage(storage_config,
kwargs)`, and calls the legacy page interface: `batch_exists` (leading pages present),
`batch_set` (pages of a flat host layout), `batch_get` (into the pages it hands over).
Keys are SGLang's page hashes (its own chained hash of the page's tokens, salted per request),
hashed to the registry's 63-bit keys; a page's bytes live in one host tensor pool.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from talaria.services.instance_agent.memory.hkvr_core import HkvrCore
from talaria.services.instance_agent.memory.host_pages import LayoutDescriptor, RankReport


def _key(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


class TalariaHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = storage_config.extra_config or {}
        self.model = f"{extra.get('model', storage_config.model_name)}:tp{storage_config.tp_rank}"
        self.core = HkvrCore(int(extra.get("host_pages", 4096)), ranks=1)
        self.pool: torch.Tensor | None = None  # [pages, page bytes], made at the first write

    def _slot(self, key: str) -> int | None:
        page = self.core.pages.get((self.model, 0, _key(key)))
        return None if page is None or page.state != "committed" else page.slot

    def exists(self, key: str) -> bool:
        return (self.model, _key(key)) in self.core.published

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self.core.match(self.model, [_key(k) for k in keys])

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        slot = self._slot(key)
        if slot is None or self.pool is None or target_location is None:
            return None
        flat = target_location.view(torch.uint8).view(-1)
        flat.copy_(self.pool[slot, : flat.numel()])
        return target_location

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        return [self.get(k, t) for k, t in zip(keys, target_locations or [None] * len(keys))]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys:
            return True
        flat = [v.contiguous().view(torch.uint8).view(-1) for v in values]
        if self.pool is None:
            self.pool = torch.empty((self.core.capacity, flat[0].numel()), dtype=torch.uint8)
        hashes = tuple(_key(k) for k in keys)
        n = flat[0].numel()
        template = LayoutDescriptor(self.model, 0, 0, 0, 1, "uint8", "gqa", (n,), 1)
        # One page per key: HKVR's page size here is one SGLang page (its committed count is
        # in pages, so each key is one "token" of the report).
        plan = self.core.plan_save(self.model, f"sglang:{keys[0]}", [RankReport(0, len(keys), hashes)], template)
        for c in plan.copies:
            self.pool[c.slot, :n].copy_(flat[c.page_index])
        self.core.complete(plan.job_id)  # the copy above is synchronous
        return all((self.model, h) in self.core.published for h in hashes)  # False: the pool was full

    def clear(self) -> None:
        self.core = HkvrCore(self.core.capacity, ranks=1)
