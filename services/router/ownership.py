"""Router replicas: which router decides which sessions. Pure: no I/O, no clock.

Sessions hash to 64 slots grouped into `partitions` partitions, each consumed by one durable
consumer and owned by at most one router through a key `partition.<p>` in an expiring JetStream KV
bucket; the KV compare-and-set makes ownership exclusive, rendezvous hashing over the live routers
only balances it (the states and transitions: `Ownership`). `Partitioning` answers "is this
session mine?" for RouterCore.

Fencing: a claim's epoch is the bucket revision that created it (renewals keep it; any later
claim has a higher one). Every dispatch carries its router's (router, partition, epoch); an
agent refuses one whose partition another router has claimed since (`superseded_by`): a
router stalled past its TTL (SIGSTOP, a long pause) must not run a call its successor
already placed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from talaria.shared.events import DispatchFence
from talaria.shared.session_slots import SLOTS, slot_of

RENEWALS_PER_TTL = 4  # an owner renews every ttl_s / 4: three renewals may fail before it lapses
CONFIDENT_SHARE = 0.5  # an owner decides within this share of the TTL after its last renewal (`current`)


def valid_partitions(count: int) -> bool:
    """A partition count groups the slots evenly (it divides SLOTS)."""
    return 1 <= count <= SLOTS and SLOTS % count == 0


def partition_of(session_id: str, count: int) -> int:
    return slot_of(session_id) % count


def slots_of(partition: int, count: int) -> list[int]:
    return [s for s in range(SLOTS) if s % count == partition]


def key_of(partition: int) -> str:
    return f"partition.{partition}"


@dataclass(frozen=True)
class Partitioning:
    """The partitions a router owns now: which sessions it decides, and which router-wide work
    (not tied to a session: partition 0's owner does it, so exactly one router does)."""

    count: int
    owned: frozenset[int]
    router_id: str = ""  # "" with no claims (one router, the simulator): dispatches unfenced
    epochs: tuple[tuple[int, int], ...] = ()  # (partition, epoch of our claim on it)

    @classmethod
    def everything(cls, count: int = 1) -> Partitioning:
        return cls(count, frozenset(range(count)))

    def owns(self, session_id: str | None) -> bool:
        if session_id is None:
            return 0 in self.owned
        return partition_of(session_id, self.count) in self.owned

    def fence(self, session_id: str) -> DispatchFence | None:
        """What a dispatch for this session carries: our claim on its partition."""
        partition = partition_of(session_id, self.count)
        epoch = dict(self.epochs).get(partition)
        if not self.router_id or epoch is None:
            return None
        return DispatchFence(self.router_id, partition, epoch)


@dataclass(frozen=True)
class PartitionClaim:
    """What the bucket holds for a partition: its owner and the revision of that write."""

    owner: str
    revision: int


@dataclass
class Plan:
    claim: list[int] = field(default_factory=list)  # free: create the key
    renew: list[tuple[int, int]] = field(default_factory=list)  # mine: update(last=revision)
    release: list[tuple[int, int]] = field(default_factory=list)  # mine, preferred elsewhere: drain, delete
    lost: list[int] = field(default_factory=list)  # I decided it, the bucket says I no longer own it
    reclaim: list[int] = field(default_factory=list)  # mine, lapsed, free and still mine to prefer: create again


def superseded_by(fence: DispatchFence | None, claim: PartitionClaim | None) -> PartitionClaim | None:
    """The claim that supersedes a dispatch's, or None when the dispatch may run: it is
    unfenced, its partition is free (nobody decided its calls since), or still its router's
    (a later claim by the same router is the same process, or its restart adopting it)."""
    if fence is None or claim is None or claim.owner == fence.router_id:
        return None
    return claim if claim.revision > fence.epoch else None


def preferred(partition: int, members: frozenset[str] | set[str]) -> str:
    """Rendezvous (highest random weight) hashing: the member with the highest hash of
    (partition, member); the same answer on every router that sees the same members."""
    return max(members, key=lambda m: (hashlib.blake2b(f"{partition}/{m}".encode(), digest_size=8).digest(), m))


class Ownership:
    """Plans claims, renewals and hand-overs of this router's partitions.

    Sessions hash to 64 slots (shared/session_slots.py); a deployment groups them into
    `partitions` partitions (slot s belongs to partition s % partitions), each consumed by one
    durable JetStream consumer. Each partition has at most one owner, held as a key
    `partition.<p>` in a JetStream KV bucket whose entries expire `ttl_s` after their last write:

        free  ──create (fails if someone else created it first)──►  mine, revision r
        mine  ──update(last=r) every ttl_s/4 (the renewal)──────────►  mine, revision r'
        mine  ──update fails (expired and re-created by another)────►  lost: stop deciding it
        mine  ──expired, nobody took it, still preferred: create────►  mine again, intake kept
        mine  ──a live member is preferred: drain, delete(last=r)───►  free (a handover)
        a dead owner's key expires ttl_s after its last renewal     ►  free: taken over

    Who should own a partition: rendezvous hashing over the live routers (those heard on the
    health subject within ttl_s), so a router that joins or leaves moves only its share. A free
    partition is claimed by its preferred router, or by anyone once it has stayed free for
    ttl_s (the preferred one is not claiming it). The KV compare-and-set is what makes ownership
    exclusive; the member view only balances it.

    `Ownership.plan` turns what the bucket holds into actions; the router service
    (router_service.py) carries them out and reports back (`claimed`, `renewed`, `lost`,
    `released`). `Partitioning` answers "is this session mine?" for RouterCore.
    """

    def __init__(self, me: str, partitions: int, ttl_s: float) -> None:
        if not valid_partitions(partitions):
            raise ValueError(f"{partitions} partitions: a divisor of {SLOTS}")
        if ttl_s <= 0:
            raise ValueError(f"ownership TTL {ttl_s}: a positive number of seconds")
        self.me, self.partitions, self.ttl_s = me, partitions, ttl_s
        self.owned: dict[int, int] = {}  # partition -> revision of my last write
        self.epochs: dict[int, int] = {}  # partition -> revision that created my claim (its epoch)
        self.confirmed: dict[int, float] = {}  # partition -> when my last write of its claim was sent
        self.free_since: dict[int, float] = {}

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / RENEWALS_PER_TTL

    def plan(self, bucket: dict[int, PartitionClaim | None], members: set[str] | frozenset[str], now: float) -> Plan:
        """`bucket`: each partition's claim as just read (None: free); `members`: the routers
        heard from within ttl_s (this one is always a member)."""
        members = frozenset(members) | {self.me}
        plan = Plan()
        for p in range(self.partitions):
            claim = bucket.get(p)
            if claim is None and p in self.owned and preferred(p, members) == self.me:
                # It lapsed under us, and nobody took it: the bucket was unreachable longer than
                # ttl_s (a broker's leader election takes 4-10 s). Claimed again in place: a
                # hand-over to ourselves would stop the intake and rebuild its consumer.
                plan.reclaim.append(p)
                continue
            if claim is None or claim.owner != self.me:
                if p in self.owned:
                    plan.lost.append(p)  # it expired under us (we stalled), or another took it
                if claim is not None:
                    self.free_since.pop(p, None)
                    continue
                since = self.free_since.setdefault(p, now)
                if preferred(p, members) == self.me or now - since >= self.ttl_s:
                    plan.claim.append(p)
                continue
            # Ours (a restart under the same id adopts its predecessor's claim: that process is gone).
            self.free_since.pop(p, None)
            if preferred(p, members) != self.me:
                plan.release.append((p, claim.revision))
            else:
                plan.renew.append((p, claim.revision))
        return plan

    # ---- outcomes reported by the shell --------------------------------------------------

    def claimed(self, partition: int, revision: int, sent_at: float | None = None) -> None:
        """A claim we created at `revision` (the write sent at `sent_at`): a new epoch."""
        self.owned[partition] = self.epochs[partition] = revision
        self._confirm(partition, sent_at)

    def renewed(self, partition: int, revision: int, sent_at: float | None = None) -> None:
        """Our claim rewritten at `revision`; its epoch stays (a restart adopting a predecessor's
        claim takes the revision it found as its epoch: nothing older than it is ours)."""
        self.owned[partition] = revision
        self.epochs.setdefault(partition, revision)
        self._confirm(partition, sent_at)

    def _confirm(self, partition: int, sent_at: float | None) -> None:
        self.free_since.pop(partition, None)
        if sent_at is not None:
            self.confirmed[partition] = sent_at

    def current(self, partition: int, now: float) -> bool:
        """May we still decide for the partition? Its key expires ttl_s after our last write
        reached the bucket, which was after we sent it: until then no other router can hold
        it. We decide only in the first CONFIDENT_SHARE of that time, so a dispatch decided
        at its end still reaches its agent (which checks the claim) long before another router
        can claim the partition. Past it (we stalled: SIGSTOP, a long pause, an unreachable
        bucket) we decide nothing for it until a round renews the claim or finds it lost;
        renewals every ttl_s / RENEWALS_PER_TTL keep a live owner inside it."""
        at = self.confirmed.get(partition)
        return partition in self.owned and (at is None or now < at + CONFIDENT_SHARE * self.ttl_s)

    def lost(self, partition: int) -> None:
        self.owned.pop(partition, None)
        self.epochs.pop(partition, None)
        self.confirmed.pop(partition, None)

    released = lost

    def fenced(self, owned, count: int) -> Partitioning:
        """The Partitioning of the partitions in `owned`, each dispatch fenced by our epoch on it."""
        return Partitioning(count, frozenset(owned), self.me,
                            tuple(sorted((p, e) for p, e in self.epochs.items() if p in owned)))
