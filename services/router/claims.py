"""The JetStream KV bucket holding router partition ownership (ownership.py says what the keys
mean; this is only the I/O). Every write is revision-checked: `create` fails if the key
exists, `renew` and `release` fail unless the key is still at the revision we wrote."""

from __future__ import annotations

import asyncio

from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import APIError, BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from talaria.services.router.ownership import PartitionClaim, key_of
from talaria.shared.bus import deployment_of, replicas
from talaria.shared.settings import SettingsError

PARTITIONS_KEY = "partitions"  # the deployment's partition count: the first router writes it, all agree


class ClaimStore:
    def __init__(self, kv, ttl_s: float) -> None:
        self.kv, self.ttl_s = kv, ttl_s

    @classmethod
    async def open(cls, js, ttl_s: float, partitions: int, retried=None) -> ClaimStore:
        """The bucket (created with `ttl_s` when absent; an existing bucket's own TTL is used) and
        the check that every router of the deployment groups slots the same way. `retried`: the
        JetStream context later reads and writes go through (bus.retried_api: short waits, as
        the ownership loop tries again every renewal anyway)."""
        name = deployment_of(js).routers_bucket
        try:
            kv = await js.create_key_value(KeyValueConfig(bucket=name, history=1, ttl=ttl_s,
                                                          storage=StorageType.FILE, replicas=replicas(js)))
        except BadRequestError:  # exists (another router made it, maybe with another TTL)
            kv = await js.key_value(name)
        try:
            info = await js.stream_info(f"KV_{name}")
            ttl_s = (info.config.max_age or ttl_s)
        except NotFoundError:
            pass
        store = cls(kv, ttl_s)
        await store._agree(partitions)
        if retried is not None:
            store.kv = await retried.key_value(name)
        return store

    async def _agree(self, partitions: int) -> None:
        # Written once without expiry would need a second bucket; rewritten by every router at
        # start instead, so it lives while routers do (create, else compare and refresh).
        for _ in range(3):  # the key may expire between a refused create and the read (create below)
            try:
                await self.kv.create(PARTITIONS_KEY, str(partitions).encode())
                return
            except (KeyWrongLastSequenceError, KeyNotFoundError):
                pass
            try:
                entry = await self.kv.get(PARTITIONS_KEY)
                break
            except KeyNotFoundError:
                continue
        else:
            return  # it kept expiring under us: no router holds it, so none disagrees
        if entry.value and int(entry.value) != partitions:
            raise SettingsError("TALARIA_ROUTER_PARTITIONS", str(partitions),
                                f"{int(entry.value)}, the partition count of the routers already running")

    async def read(self, partitions: int) -> dict[int, PartitionClaim | None]:
        got = await asyncio.gather(*(self.claim(p) for p in range(partitions)))
        return dict(enumerate(got))

    async def claim(self, partition: int) -> PartitionClaim | None:
        """The partition's claim now; None when free."""
        try:
            entry = await self.kv.get(key_of(partition))
        except KeyNotFoundError:  # never claimed, expired, or released (a delete marker)
            return None
        if not entry.value or entry.operation in ("DEL", "PURGE"):
            return None
        return PartitionClaim(entry.value.decode(), entry.revision)

    async def create(self, partition: int, me: str) -> int | None:
        """The revision of our new claim, or None if another router created it first."""
        try:
            return await self.kv.create(key_of(partition), me.encode())
        except KeyWrongLastSequenceError:
            return None
        except KeyNotFoundError:
            # nats-py's create, refused because the key existed, reads it to tell a live claim
            # from a delete marker; a claim that expired in between reads as not found. Not ours
            # this round: the next tick claims it, free now.
            return None

    async def renew(self, partition: int, me: str, revision: int) -> int | None:
        """The claim's new revision, or None: it is no longer the one we wrote (lost)."""
        try:
            return await self.kv.update(key_of(partition), me.encode(), last=revision)
        except KeyWrongLastSequenceError:
            return None

    async def refresh_partitions(self, partitions: int) -> None:
        await self.kv.put(PARTITIONS_KEY, str(partitions).encode())

    async def release(self, partition: int, revision: int) -> None:
        try:
            await self.kv.delete(key_of(partition), last=revision)
        except (KeyWrongLastSequenceError, APIError):
            pass  # it had already expired and been taken: nothing of ours to release
