"""A durable pull consumer that outlives a broker node: made again from its ack floor after a
reconnect or a failed fetch.

JetStream may deliver a message to a pull request whose client connection died with a node;
it is delivered again only after the consumer's ack_wait (the router's 30 s, an agent's 60 s:
a call's whole deadline, so the call answered 504 in CI). Deleting the consumer and adding it
back from its ack floor delivers every unacked message at once. A copy already handled is
skipped by its reader (the router's call-id fence, an agent's `holds`).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError


async def from_ack_floor(api, stream: str, config: ConsumerConfig, log, start: int | None = None, **context):
    """Consumer `config.durable_name` made again from its ack floor and bound; a consumer not
    there (deleted by a failed earlier try) starts at `start` when given (never at the head
    of the stream: that would deliver its whole history again). Returns (subscription, the
    start sequence used, or None when made from `config` as it is)."""
    name = config.durable_name
    try:
        info = await api.consumer_info(stream, name)
    except NotFoundError:
        info = None
    if info is not None:
        start = info.ack_floor.stream_seq + 1
        if info.num_ack_pending:
            log.warning("resuming a consumer after its ack floor", consumer=name, resume_at=start,
                        unacked=info.num_ack_pending, **context)
        await api.delete_consumer(stream, name)
    if start is not None:
        config = replace(config, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
    await api.add_consumer(stream, config=config)
    return await api.pull_subscribe_bind(name, stream=stream), start


class DurablePull:
    """Fetches from a durable consumer; after the connection reconnected or a fetch failed it
    makes the consumer again (`from_ack_floor`) beside the fetches, which go on from the old
    subscription until the new one is bound (a rebuild needs the JetStream meta leader, which
    a node's loss may take for seconds)."""

    def __init__(self, nc, api, stream: str, config: ConsumerConfig, sub, log, retry_wait_s: float, **context) -> None:
        self.nc, self.api, self.stream, self.config, self.sub, self.log = nc, api, stream, config, sub, log
        self.retry_wait_s, self.context = retry_wait_s, context
        self._seen = nc.stats["reconnects"]
        self._rebuild = False
        self._rebuilding: asyncio.Task | None = None
        self._start: int | None = None  # the last start a rebuild used, should the consumer be gone

    async def fetch(self, batch: int, timeout: float) -> list:
        """Up to `batch` messages; [] when none came within `timeout` or the fetch failed."""
        if self.nc.stats["reconnects"] != self._seen:
            self._seen, self._rebuild = self.nc.stats["reconnects"], True
        if self._rebuild and self._rebuilding is None:
            self._rebuild = False
            self._rebuilding = asyncio.create_task(
                from_ack_floor(self.api, self.stream, self.config, self.log, self._start, **self.context))
        if self._rebuilding is not None and self._rebuilding.done():
            await self._take_rebuilt()
        try:
            return await self.sub.fetch(batch, timeout=timeout)
        except asyncio.TimeoutError:
            return []
        except Exception as exc:
            self.log.warning("fetch failed", error=str(exc), **self.context)
            self._rebuild = self._rebuild or self._rebuilding is None  # one under way covers this
            await asyncio.sleep(self.retry_wait_s)
            return []

    async def _take_rebuilt(self) -> None:
        task, self._rebuilding = self._rebuilding, None
        if task.exception() is None:
            await unsubscribed(self.sub)
            self.sub, self._start = task.result()
        else:
            self.log.warning("consumer not made again; retrying", consumer=self.config.durable_name,
                             error=str(task.exception()), **self.context)
            self._rebuild = True

    async def close(self) -> None:
        if self._rebuilding is not None:
            self._rebuilding.cancel()
            await asyncio.gather(self._rebuilding, return_exceptions=True)
        await unsubscribed(self.sub)


async def unsubscribed(sub) -> None:
    try:
        await sub.unsubscribe()
    except Exception:
        pass  # the connection it was on is gone: nothing left to end
