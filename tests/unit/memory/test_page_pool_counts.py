"""Property: the page pool's running counts (pages no call holds, the highest page in use)
equal a scan of its reference counts after any sequence of holds and releases. A snapshot
and every admission read them, so they are kept incrementally instead of scanned."""

from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.services.instance_agent.engine.kv_cache import PagePool

N = 24

ops = st.lists(st.tuples(st.sampled_from(["alloc", "use", "unuse", "cache", "uncache"]), st.integers(0, N - 1)),
               max_size=300)


def scanned_unused(pool: PagePool) -> int:
    return sum(1 for u in pool.use_refs if u == 0)


def scanned_highest(pool: PagePool) -> int:
    free = set(pool._free)
    return max((p for p in range(pool.num_pages) if p not in free), default=-1)


@settings(max_examples=300, deadline=None)
@given(ops, st.sets(st.integers(0, N - 1), max_size=4))
def test_counts_match_a_scan(steps, blocked):
    pool = PagePool(N, is_blocked=lambda p: p in blocked)
    held: list[int] = []  # pages with a use ref we may release
    cached: list[int] = []
    for op, k in steps:
        if op == "alloc":
            page = pool.alloc()
            if page is not None:
                assert page not in blocked
                held.append(page)
        elif op == "use" and held:  # a second holder of a page in use (a shared prefix)
            page = held[k % len(held)]
            pool.use(page)
            held.append(page)
        elif op == "unuse" and held:
            pool.unuse(held.pop(k % len(held)))
        elif op == "cache" and held:  # the prefix index / a session keeps a page in use
            page = held[k % len(held)]
            pool.cache(page)
            cached.append(page)
        elif op == "uncache" and cached:
            pool.uncache(cached.pop(k % len(cached)))
        assert pool.num_unused() == scanned_unused(pool)
        assert pool.highest_used() == scanned_highest(pool)
        assert len(set(pool._free)) == len(pool._free) == pool.num_free  # no page listed free twice
    for page in held:
        pool.unuse(page)
    for page in cached:
        pool.uncache(page)
    assert pool.num_unused() == pool.num_free == N and pool.highest_used() == -1
