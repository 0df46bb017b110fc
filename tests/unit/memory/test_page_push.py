"""A drain's push (issue 40, KvMigration.push): with no prompt to hash, the target lists the
session's host prefix at the holder (the page protocol's `listing`), pulls those pages with the
same arrival checks, and keeps them, so the session's next call there restores them (its
`kv_source` migrated) and gets the same greedy tokens as a recompute."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from test_page_migration import M, PROMPT, Log, Owner, generate

from talaria.services.instance_agent.kv_migration import KvMigration
from talaria.services.instance_agent.memory.page_client import list_pages
from talaria.shared.events import KvPushRequested
from talaria.shared.tokenizer import encode


def owner_thread(name: str) -> Owner:
    """The engine's owner thread, as EngineThread.call runs work on it."""
    return Owner(ThreadPoolExecutor(1, thread_name_prefix=name))


def ask(session="s1", address=""):
    return KvPushRequested("mover", session, M, "holder", address, 1.0)


def test_a_pushed_session_restores_its_pages_on_the_target_with_the_same_greedy_tokens(make_engine):
    holder, mover = make_engine([M]), make_engine([M])
    h_owner, m_owner = owner_thread("holder"), owner_thread("mover")
    first = h_owner.pool.submit(generate, holder, "c1", "s1", PROMPT).result()
    follow = PROMPT + first.token_ids + encode("<|tool|>3 passed<|end|><|assistant|>", bos=False)
    expected = generate(make_engine([M], hkvr=False, staging=False), "ref", "ref", follow).token_ids

    async def go():
        serving = KvMigration(holder, h_owner, Log(), transport="tcp")
        taking = KvMigration(mover, m_owner, Log(), transport="tcp")
        address = await serving.start()
        await taking.start()
        try:
            listed, why = await list_pages(address, "s1", M, timeout_s=5.0)
            nothing = await taking.push(ask("nobody", address))
            done = await taking.push(ask("s1", address))
            return listed, why, nothing, done, taking.pushed
        finally:
            await serving.close()
            await taking.close()

    listed, why, nothing, done, pushed = asyncio.run(go())
    assert why == "" and len(listed) == len(PROMPT + first.token_ids) // holder.page_size > 0
    assert (nothing.listed, nothing.pages) == (0, 0)  # the holder has nothing of it: nothing to move
    assert done.listed == done.pages == len(listed) and done.why == ""
    assert done.tokens == len(listed) * holder.page_size and done.bytes == len(listed) * holder.page_bytes(M)
    assert list(pushed) == [("s1", M)] and pushed[("s1", M)].tokens == done.tokens
    out = m_owner.pool.submit(generate, mover, "c2", "s1", follow, migrated_tokens=done.tokens).result()
    assert out.kv_source == "migrated" and out.cached_tokens >= done.tokens
    assert out.token_ids == expected


def test_a_listing_names_only_that_sessions_own_prefix(make_engine):
    holder = make_engine([M])
    owner = owner_thread("holder")
    owner.pool.submit(generate, holder, "c1", "s1", PROMPT).result()
    owner.pool.submit(generate, holder, "c2", "s2", PROMPT, kv_scope="other").result()

    async def go():
        serving = KvMigration(holder, owner, Log(), transport="tcp")
        address = await serving.start()
        try:
            return [await list_pages(address, s, M, timeout_s=5.0) for s in ("s1", "s2", "s3")]
        finally:
            await serving.close()

    (s1, _), (s2, _), (s3, _) = asyncio.run(go())
    assert s1 and s2 and s3 == [] and not set(s1) & set(s2)  # another tenant's prefix shares no hash
