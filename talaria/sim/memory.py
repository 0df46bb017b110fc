"""The simulated instance's memory: device KV of the active model, the host KV registry
(the agent's own `HkvrCore`) and the D2D staging of the next model (the agent's own
`StagingPlanner`). The executor (executor.py) moves no bytes; these track how many there
would be, which the cost profile prices.

- One model's weights are on device at a time; switching releases the active model's device
  KV (its host copy survives only with HKVR), except its running calls' KV, which the
  executor parks through the agent's `ParkedKv` (memory/parked_kv.py).
- Staging: while a model serves, the next model in rotation is pre-staged in the background
  at the H2D rate into the KV pool's free tail (pool less the KV high-water mark since the
  last switch). At the switch, staged bytes move by D2D, the rest by H2D.
"""

from __future__ import annotations

from collections import OrderedDict

from talaria.services.instance_agent.memory.hkvr_core import HkvrCore
from talaria.services.instance_agent.memory.host_pages import LayoutDescriptor, RankReport
from talaria.services.instance_agent.memory.staging_plan import StagingPlanner
from talaria.shared.snapshots import SessionKv
from talaria.sim.profiles import ServerProfile

# The simulated host KV registry is the instance agent's own bookkeeping (memory/hkvr_core.py),
# driven with synthetic page hashes: a session's prefix is unique to it, so page j of session s
# hashes to (s, j), cumulative by construction. Pages are coarser than the engine's (the
# simulator moves no bytes): a restore covers whole pages, the tail is recomputed. [asm]
# A profile may set its own (ServerProfile.kv_page_tokens: the torch engine's 16 for local-torch).
SIM_PAGE_TOKENS = 512
STAGE_CHUNK_BYTES = 4 << 30  # staging chunk in the simulator: 4 GiB (the engine uses 256 KiB) [asm]


def _page_hash(session: str, index: int) -> int:
    return hash((session, index)) & ((1 << 63) - 1)


class _HostView:
    """`host.get((model, session))` / `host.items()` over the registry: published tokens only
    (both answered from the registry's own restorable-prefix index, no page walk)."""

    def __init__(self, core: HkvrCore, page: int = SIM_PAGE_TOKENS) -> None:
        self.core = core
        self.page = page
        core.changes = set()
        self._entries: dict[tuple[str, str], SessionKv] = {}
        self._list: list[SessionKv] | None = None

    def get(self, key: tuple[str, str], default: int = 0) -> int:
        model, session = key
        return self.core.session_tokens(session, model, self.page) or default

    def items(self):
        return (((m, s), t) for s, m, t in self.core.session_prefixes(self.page))

    def entries(self) -> list[SessionKv]:
        """Snapshot entries of every restorable session, kept current from the registry's
        change feed (only sessions whose restorable length changed are rebuilt)."""
        core, entries = self.core, self._entries
        if core.changes:
            for sid, model in core.changes:
                pre = core.sessions.get((sid, model))
                if pre is not None and pre.published:
                    entries[(model, sid)] = SessionKv(sid, model, "host", pre.published * self.page)
                else:
                    entries.pop((model, sid), None)
            core.changes.clear()
            self._list = None
        if self._list is None:
            self._list = list(entries.values())
        return self._list


class KvStore:
    """Device KV of the active model (LRU by session, in tokens; calls in flight are never
    evicted) and the host KV registry: the real `HkvrCore`, one slot per page of the model
    with the largest pages, capacity = host bytes / slot bytes."""

    def __init__(self, server: ServerProfile) -> None:
        self.server = server
        self.device: OrderedDict[str, int] = OrderedDict()
        self.device_tokens = 0
        self.page = page = getattr(server, "kv_page_tokens", SIM_PAGE_TOKENS)
        slot_bytes = max(m.kv_bytes_per_token for m in server.models.values()) * page
        self.core = HkvrCore(max(1, server.host_bytes // slot_bytes), ranks=1)
        self.host = _HostView(self.core, page)
        self._page_hashes: dict[str, tuple[int, ...]] = {}
        self.device_evictions = 0
        self.version = 0  # bumped on every change; snapshots cache on it

    @property
    def host_evictions(self) -> int:
        return self.core.counters.evictions

    def clear_device(self) -> None:
        self.device.clear()
        self.device_tokens = 0
        self.version += 1

    def drop_device(self, session: str) -> None:
        """Free a session's device KV (a call ended on an engine that keeps none after it)."""
        self.device_tokens -= self.device.pop(session, 0)
        self.version += 1

    def put_device(self, session: str, tokens: int, capacity: int, pinned: set[str]) -> None:
        old = self.device.pop(session, 0)
        self.device_tokens += tokens - old
        self.device[session] = tokens
        if self.device_tokens > capacity:
            for victim in list(self.device):
                if self.device_tokens <= capacity:
                    break
                if victim in pinned or victim == session:
                    continue
                self.device_tokens -= self.device.pop(victim)
                self.device_evictions += 1
        self.version += 1

    def put_host(self, model: str, session: str, tokens: int) -> None:
        """Checkpoint the session's committed pages (the D2H copy is charged no time here and
        completes at once; pages already held are shared, not copied again)."""
        page = self.page
        pages = tokens // page
        report = RankReport(0, pages * page, self._hashes(session, pages))
        template = LayoutDescriptor(model, 0, 0, 0, page, "bf16", "gqa", (page,))
        plan = self.core.plan_save(model, session, [report], template)
        self.core.complete(plan.job_id)
        self.version += 1

    def _hashes(self, session: str, pages: int) -> tuple[int, ...]:
        """The session's first `pages` page hashes (a session only grows: cached, extended)."""
        have = self._page_hashes.get(session, ())
        if len(have) < pages:
            have = self._page_hashes[session] = have + tuple(_page_hash(session, j) for j in range(len(have), pages))
        return have[:pages]

    def touch_host(self, model: str, session: str) -> int:
        """A restore: pins, counts the hit and refreshes LRU order through the registry."""
        pages = self.core.session_tokens(session, model, self.page) // self.page
        plan = self.core.begin_restore(model, self._hashes(session, pages))
        self.core.end_restore(plan)
        return len(plan.hashes) * self.page


class StagingState:
    """Background staging of the model the rotation opens next, from the agent's own
    `StagingPlanner`: chunks placed from the top of the KV pool downward, written at
    host-to-device bandwidth while their slot is above the KV high-water mark, dirtied when
    KV grows over them."""

    def __init__(self, server: ServerProfile) -> None:
        self.server = server
        self.planner = StagingPlanner(STAGE_CHUNK_BYTES)
        self.target: str | None = None
        self.start = 0.0
        self._key: tuple | None = None
        self._written = 0
        self._memo: tuple = (None, 0)

    def retarget(self, target: str | None, now: float) -> None:
        if target != self.target:
            self.target, self.start = target, now

    def staged_bytes(self, now: float, model: str, active: str | None, peak_kv: int) -> int:
        """Clean staged bytes of `model` by `now` while `active` serves with `peak_kv` KV bytes."""
        if self.target != model or active is None:
            return 0
        planner = self.planner
        w = self.server.model(model).weight_bytes
        streamed = int(self.server.h2d_bytes_s * max(0.0, now - self.start) // STAGE_CHUNK_BYTES)
        memo = (model, active, self.start, peak_kv, streamed)
        if memo == self._memo[0]:
            return self._memo[1]  # nothing the planner sees has changed since the last ask
        if planner.target != model or self._key != (active, self.start):
            planner.plan(model, w, 0, self.server.kv_pool_bytes(active))
            self._key, self._written = (active, self.start), 0
        planner.on_kv_alloc(0, peak_kv)  # KV pages handed out over staged slots
        # lazily: the writes the bandwidth allowed by `now`, all complete by now
        self._written += planner.write_through(lambda lo, hi: lo >= peak_kv, max(0, streamed - self._written))
        staged = planner.staged_bytes()  # == gather_plan(model, w).staged_bytes: no write in flight
        self._memo = (memo, staged)
        return staged
