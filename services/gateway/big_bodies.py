"""Big bodies are parsed, validated and tokenised in one worker process, off the event loop.
Each tenant may have one body there at a time (issue 25: three 7.9 MB bodies of one tenant,
queued in the worker, delayed another tenant's 70 KiB request from 0.96 s to 18.6 s). A
tenant's next big body while one is parsed is answered 429 with `Retry-After`, so the worker's
queue holds at most one body per tenant: another tenant waits for at most one body of each."""

from __future__ import annotations

import asyncio
from collections import Counter

from talaria.shared.messages import ErrorReply

PER_TENANT = 1


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
