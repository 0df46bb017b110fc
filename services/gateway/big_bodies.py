"""Big bodies are parsed, validated and tokenised in one worker process, off the event loop.
Each tenant may have one body there at a time (issue 25: three 7.9 MB bodies of one tenant,
queued in the worker, delayed another tenant's 70 KiB request from 0.96 s to 18.6 s). A
tenant's next big body while one is parsed is answered 429 with `Retry-After`, so the worker's
queue holds at most one body per tenant: another tenant waits for at most one body of each.
The worker dies with the gateway, even a SIGKILLed one (and with it the resource tracker it
holds open)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

from talaria.shared.messages import ErrorReply
from talaria.shared.runtime import die_with_parent

PER_TENANT = 1


def parser_pool() -> ProcessPoolExecutor:
    """The one worker process big bodies are parsed in (spawned: no copy of the loop's state)."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=die_with_parent, initargs=(os.getpid(),))


class BigBodies:
    def __init__(self, pool) -> None:
        self.pool = pool
        self.parsing: Counter = Counter()  # tenant -> its bodies in the worker

    async def parse(self, tenant: str, fn, *args):
        """`fn(*args)` in the worker, or a 429 while this tenant already has a body there."""
        if self.parsing[tenant] >= PER_TENANT:
            return ErrorReply(429, "too_many_large_requests",
                              "another large request of yours is still being parsed; retry when it is done",
                              retry_after_s=1.0)
        self.parsing[tenant] += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.parsing[tenant] -= 1
            if self.parsing[tenant] <= 0:
                del self.parsing[tenant]
