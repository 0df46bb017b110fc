"""What the vllm engine reports as a session's device KV follows vLLM's LRU prefix cache: the
least recently used sessions of a model are forgotten once they add up to more than that
model's KV capacity, so the router is not told of KV vLLM has already evicted. Pure: the
bookkeeping only (no vLLM)."""

from collections import OrderedDict
from types import SimpleNamespace

from talaria.services.instance_agent.engine.vllm_engine import VllmEngine


def engine_with_capacity(blocks: dict[str, int], block: int = 128) -> VllmEngine:
    eng = object.__new__(VllmEngine)  # the bookkeeping alone: no vLLM engines started
    eng.sessions, eng.host_sessions, eng._asleep, eng._block = OrderedDict(), {}, set(), block
    eng._llms = {m: SimpleNamespace(vllm_config=SimpleNamespace(cache_config=SimpleNamespace(
        num_gpu_blocks=n, block_size=block))) for m, n in blocks.items()}
    return eng


def test_the_oldest_sessions_of_a_model_are_forgotten_past_its_capacity():
    eng = engine_with_capacity({"a": 8, "b": 8})  # 1,024 tokens each
    eng._remember("s1", "a", [1] * 400)
    eng._remember("s2", "a", [2] * 400)
    eng._remember("t1", "b", [3] * 900)  # another model's engine: its own capacity
    eng._remember("s1", "a", [1] * 500)  # s1 returns: now the newest of a
    eng._remember("s3", "a", [4] * 300)  # 500 + 400 + 300 > 1,024: s2 (least recent) goes
    assert [k for k in eng.sessions] == [("t1", "b"), ("s1", "a"), ("s3", "a")]
    assert eng.kv_state("s2", "a") == "none" and eng.kv_state("s1", "a") == "device"
    assert eng.device_prefix("s1", "a", [1] * 600) == 384  # whole 128-token blocks


def test_a_session_larger_than_the_cache_is_still_its_newest_entry():
    eng = engine_with_capacity({"a": 1})
    eng._remember("big", "a", [1] * 1000)
    assert list(eng.sessions) == [("big", "a")]


def test_host_entries_past_the_connectors_pool_are_forgotten_oldest_first():
    # The connector's pool holds host_kv_bytes of KV (its LRU evicts past that): what the
    # engine reports as "host" follows it, instead of every session ever saved.
    eng = engine_with_capacity({"a": 8, "b": 8})
    spec = SimpleNamespace(layers=2, kv_heads=1, head_dim=4, context_length=4096)  # 16 B/token at 1 B
    eng.specs = {"a": spec, "b": spec}
    eng.dtypes = {m: SimpleNamespace(dtype=SimpleNamespace(itemsize=1)) for m in ("a", "b")}
    eng.host_kv_bytes = 16 * 1000  # 1,000 tokens of each model
    for sid, n in (("s1", 400), ("s2", 400)):
        eng._remember(sid, "a", [1] * n)
    eng._save_sessions("a")  # a sleeps: both to host (whole 128-token blocks: 384 each)
    eng._remember("t1", "b", [2] * 900)
    eng._save_sessions("b")
    eng._remember("s3", "a", [3] * 400)
    eng._save_sessions("a")  # s2, s3 saved (s1 left the device cache): 3 x 384 > 1,000, s1 the oldest goes
    assert list(eng.host_sessions) == [("t1", "b"), ("s2", "a"), ("s3", "a")]
    assert sum(n for (_, m), n in eng.host_sessions.items() if m == "a") <= 1000
