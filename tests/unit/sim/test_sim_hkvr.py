"""The simulator's host KV is the instance agent's own HkvrCore, not a private copy."""

from dataclasses import replace

from talaria.services.instance_agent.memory.hkvr_core import HkvrCore
from talaria.sim.memory import SIM_PAGE_TOKENS, KvStore
from talaria.sim.profiles import PAPER_TP8


def test_host_kv_is_published_page_aligned_through_the_real_registry():
    kv = KvStore(PAPER_TP8)
    assert isinstance(kv.core, HkvrCore)
    kv.put_host("qwen3-235b", "s1", 3 * SIM_PAGE_TOKENS + 100)  # the partial tail page is not kept
    assert kv.host.get(("qwen3-235b", "s1")) == 3 * SIM_PAGE_TOKENS
    assert dict(kv.host.items()) == {("qwen3-235b", "s1"): 3 * SIM_PAGE_TOKENS}
    assert kv.touch_host("qwen3-235b", "s1") == 3 * SIM_PAGE_TOKENS
    assert kv.core.counters.hits == 1


def test_a_full_registry_evicts_least_recently_used_sessions():
    per_page = max(m.kv_bytes_per_token for m in PAPER_TP8.models.values()) * SIM_PAGE_TOKENS
    kv = KvStore(replace(PAPER_TP8, host_bytes=4 * per_page))  # room for four pages
    kv.put_host("qwen3-235b", "old", 2 * SIM_PAGE_TOKENS)
    kv.put_host("qwen3-235b", "new", 2 * SIM_PAGE_TOKENS)
    kv.touch_host("qwen3-235b", "old")  # now "new" is the least recently used
    kv.put_host("qwen3-235b", "newest", 2 * SIM_PAGE_TOKENS)
    assert kv.host_evictions == 2
    assert kv.host.get(("qwen3-235b", "old")) == 2 * SIM_PAGE_TOKENS
    assert kv.host.get(("qwen3-235b", "new")) == 0
    # the snapshot entries, mirrored from the registry's change feed, follow the eviction
    assert {(e.model, e.session_id): e.kv_tokens for e in kv.host.entries()} == dict(kv.host.items()) == {
        ("qwen3-235b", "old"): 2 * SIM_PAGE_TOKENS, ("qwen3-235b", "newest"): 2 * SIM_PAGE_TOKENS}
