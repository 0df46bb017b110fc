"""A claim key that expires between nats-py's refused create and its read (the race a suite
run hit: the router died starting with `KeyNotFoundError` out of `ClaimStore.create`). The
race cannot be forced on a real server, so `ExpiringKv` is a test double of the KV bucket
that answers as nats-py does when it happens."""

from __future__ import annotations

from nats.js.errors import KeyNotFoundError

from talaria.services.router.claims import ClaimStore


class ExpiringKv:
    """Every create is refused by a key that is gone by the time nats-py reads it back; every
    read finds nothing (it expired)."""

    def __init__(self) -> None:
        self.creates = 0

    async def create(self, key, value):
        self.creates += 1
        raise KeyNotFoundError

    async def get(self, key):
        raise KeyNotFoundError


async def test_a_claim_that_expires_under_create_is_not_ours_this_round():
    store = ClaimStore(ExpiringKv(), ttl_s=3.0)
    assert await store.create(0, "router-a") is None  # not a crash: the next tick claims it


async def test_the_partition_count_check_survives_the_key_expiring_under_it():
    kv = ExpiringKv()
    await ClaimStore(kv, ttl_s=3.0)._agree(4)
    assert kv.creates == 3  # tried again, then gave up without a verdict: nobody holds the key
