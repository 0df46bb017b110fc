"""Router replicas' partition ownership (ownership.py): who claims, renews, releases and
notices a loss, from what the KV bucket holds and which routers are heard from."""

from __future__ import annotations

from collections import Counter

import pytest

from talaria.services.router.ownership import (
    Ownership, PartitionClaim, Partitioning, partition_of, preferred, slots_of, valid_partitions,
)
from talaria.shared.session_slots import SLOTS, slot_of


def free(n):
    return {p: None for p in range(n)}


def test_a_lone_router_claims_every_free_partition():
    o = Ownership("r1", 8, ttl_s=3.0)
    assert sorted(o.plan(free(8), set(), 0.0).claim) == list(range(8))


def test_two_routers_split_the_partitions_by_rendezvous_and_agree():
    a, b = Ownership("a", 8, 3.0), Ownership("b", 8, 3.0)
    ca = a.plan(free(8), {"a", "b"}, 0.0).claim
    cb = b.plan(free(8), {"a", "b"}, 0.0).claim
    assert sorted(ca + cb) == list(range(8)) and not set(ca) & set(cb)
    assert ca and cb  # both get a share


def test_a_member_joining_takes_only_its_share_from_the_owner():
    a = Ownership("a", 16, 3.0)
    bucket = {p: PartitionClaim("a", 10 + p) for p in range(16)}
    for p, rev in bucket.items():
        a.claimed(p, rev.revision)
    plan = a.plan(bucket, {"a", "b"}, 1.0)
    released = [p for p, _ in plan.release]
    assert released == [p for p in range(16) if preferred(p, {"a", "b"}) == "b"]
    assert sorted(released + [p for p, _ in plan.renew]) == list(range(16))
    assert all(rev == 10 + p for p, rev in plan.release + plan.renew)  # revision-checked writes


def test_a_free_partition_preferred_elsewhere_is_claimed_after_one_ttl():
    """Its preferred router is heard but never claims it (stuck): someone must, within a TTL."""
    o = Ownership("a", 2, ttl_s=3.0)
    theirs = next(p for p in range(2) if preferred(p, {"a", "b"}) == "b")
    assert theirs not in o.plan(free(2), {"a", "b"}, 0.0).claim
    assert theirs not in o.plan(free(2), {"a", "b"}, 2.9).claim
    assert theirs in o.plan(free(2), {"a", "b"}, 3.0).claim


def test_a_claim_that_expired_or_was_taken_is_lost():
    lapsed = next(p for p in range(8) if preferred(p, {"a", "b"}) == "b")
    o = Ownership("a", 8, 3.0)
    o.claimed(lapsed, 5)
    taken = next(p for p in range(8) if p != lapsed)
    o.claimed(taken, 6)
    plan = o.plan({lapsed: None, taken: PartitionClaim("b", 9)}, {"a", "b"}, 10.0)
    assert sorted(plan.lost) == sorted([lapsed, taken])  # lapsed and preferred elsewhere: b's to claim
    assert taken not in plan.claim and lapsed not in plan.claim and not plan.reclaim


def test_a_lapsed_claim_nobody_took_is_made_again_in_place():
    """The bucket was unreachable past the TTL (a broker failover): the preferred owner creates
    its key again and keeps its intake, instead of losing and re-taking the partition."""
    o = Ownership("a", 8, 3.0)
    mine = next(p for p in range(8) if preferred(p, {"a", "b"}) == "a")
    o.claimed(mine, 5)
    plan = o.plan({mine: None}, {"a", "b"}, 10.0)
    assert plan.reclaim == [mine] and mine not in plan.lost and mine not in plan.claim


def test_a_restart_under_the_same_id_adopts_its_claims():
    o = Ownership("a", 2, 3.0)
    plan = o.plan({0: PartitionClaim("a", 4), 1: PartitionClaim("a", 7)}, set(), 0.0)
    assert sorted(plan.renew) == [(0, 4), (1, 7)] and not plan.claim and not plan.lost


def test_partitioning_answers_for_a_session_and_router_wide_work():
    part = Partitioning(4, frozenset({partition_of("s1", 4)}))
    assert part.owns("s1")
    assert Partitioning.everything().owns("anything") and Partitioning.everything().owns(None)
    assert part.owns(None) == (0 in part.owned)  # router-wide: partition 0's owner


def test_slots_are_stable_and_spread():
    # Part of the wire contract: gateways and routers of different versions must agree.
    assert (slot_of("session-42"), slot_of("A")) == (57, 11)
    counts = Counter(slot_of(f"s{i}") for i in range(64_000))
    assert len(counts) == SLOTS and max(counts.values()) < 1.2 * min(counts.values())
    for count in (1, 2, 8, 64):
        assert sorted(s for p in range(count) for s in slots_of(p, count)) == list(range(SLOTS))


@pytest.mark.parametrize("bad", [0, 3, 65])
def test_a_partition_count_must_divide_the_slots(bad):
    assert not valid_partitions(bad)
    with pytest.raises(ValueError):
        Ownership("a", bad, 3.0)
