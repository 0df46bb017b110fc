"""Issue 25 item 5: one tenant's big bodies cannot queue ahead of everyone in the parser worker."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
import threading

from talaria.services.gateway.big_bodies import BigBodies
from talaria.shared.messages import ErrorReply


async def test_a_tenant_has_one_big_body_in_the_worker_at_a_time():
    release = threading.Event()
    bodies = BigBodies(ThreadPoolExecutor(max_workers=1))  # a stand-in for the worker process
    first = asyncio.ensure_future(bodies.parse("a", release.wait))
    while not bodies.parsing:
        await asyncio.sleep(0)
    second = await bodies.parse("a", lambda: "parsed")
    assert isinstance(second, ErrorReply) and second.status == 429 and second.retry_after_s
    other = asyncio.ensure_future(bodies.parse("b", lambda: "b parsed"))  # another tenant queues
    release.set()
    assert await first is True and await other == "b parsed"
    assert await bodies.parse("a", lambda: "again") == "again"  # its turn came back
    assert not bodies.parsing
