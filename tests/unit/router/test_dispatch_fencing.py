"""Fencing (ownership.py): a dispatch carries its router's claim epoch on the session's
partition, and is superseded once another router has claimed that partition since."""

from __future__ import annotations

from talaria.services.router.ownership import Ownership, PartitionClaim, partition_of, superseded_by
from talaria.shared.events import DispatchFence

P = 4


def test_a_dispatch_is_superseded_once_another_router_claimed_its_partition():
    stale = DispatchFence("router-0", 2, epoch=7)
    assert superseded_by(stale, PartitionClaim("router-1", 15)) == PartitionClaim("router-1", 15)


def test_a_dispatch_runs_while_its_router_holds_the_partition_or_nobody_does():
    fence = DispatchFence("router-0", 2, epoch=7)
    assert superseded_by(fence, PartitionClaim("router-0", 7)) is None  # the claim it was decided under
    assert superseded_by(fence, PartitionClaim("router-0", 31)) is None  # renewed (or claimed again) since
    assert superseded_by(fence, None) is None  # lapsed, nobody took it: no other router placed the call
    assert superseded_by(None, PartitionClaim("router-1", 15)) is None  # an unfenced router's dispatch


def test_an_older_claim_by_another_router_does_not_supersede_a_newer_dispatch():
    # A read of the bucket that lags the dispatch's own claim: the dispatch is the newer one.
    assert superseded_by(DispatchFence("router-1", 2, epoch=20), PartitionClaim("router-0", 15)) is None


def test_a_claims_epoch_is_its_creation_and_survives_renewals():
    o = Ownership("router-0", P, ttl_s=3.0)
    o.claimed(1, 10)
    o.renewed(1, 14)
    o.renewed(1, 19)
    session = next(f"s{i}" for i in range(100) if partition_of(f"s{i}", P) == 1)
    assert o.fenced({1}, P).fence(session) == DispatchFence("router-0", 1, 10)
    o.lost(1)
    o.claimed(1, 40)  # claimed again after losing it: a new epoch
    assert o.fenced({1}, P).fence(session) == DispatchFence("router-0", 1, 40)


def test_a_router_without_claims_dispatches_unfenced():
    o = Ownership("router-0", P, ttl_s=3.0)
    assert o.fenced(set(), P).fence("s1") is None
    from talaria.services.router.ownership import Partitioning

    assert Partitioning.everything(P).fence("s1") is None


def test_a_claim_is_decided_on_only_in_the_first_half_of_its_ttl_after_the_last_write_was_sent():
    o = Ownership("router-0", P, ttl_s=3.0)
    o.claimed(1, 10, sent_at=100.0)
    assert o.current(1, 101.4)
    assert not o.current(1, 101.5)  # stalled: the rest of the TTL is its dispatches' margin
    o.renewed(1, 12, sent_at=100.75)  # a renewal every TTL / 4 keeps a live owner deciding
    assert o.current(1, 102.2) and not o.current(1, 102.25)
    assert not o.current(2, 100.0)  # never ours
    o.lost(1)
    assert not o.current(1, 100.8)
