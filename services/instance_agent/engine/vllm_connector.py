"""HKVR as vLLM's host KV tier: a KV connector (vLLM's `KVConnectorBase_V1`) over the host KV
registry's bookkeeping (memory/hkvr_core.py), keyed by the tenant-scoped block hashes the
router sees (shared/tokenizer.py `block_hashes`, salted with the call's `kv_scope`).

It saves write-through (a filled vLLM block is copied to a host page after the step's forward),
so a session's KV is on the host before its engine drops it (a prefix-cache eviction, a sleep, a
release), and loads a new request's next blocks from the host before its first forward. How it
saves and loads, and where each half runs: `TalariaHostKvConnector`. Needs synchronous scheduling
(the agent turns vLLM's async scheduling off with it): a step's saves are complete when the next
step is scheduled.

KV migration (issue 40, docs/migration.md "vLLM"): the agent reaches the scheduler-side
bookkeeping through one engine-core utility (`UTILITY`, `TalariaHostKvConnector.host_kv`) and
moves the page bytes itself through its own mapping of the shared pool.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from talaria.services.instance_agent.memory.hkvr_core import HkvrCore
from talaria.services.instance_agent.memory.host_pages import LayoutDescriptor, RankReport
from talaria.shared.tokenizer import HASH_BLOCK_TOKENS, block_hashes

try:  # importable without vLLM (the config helper and the key rule are used by tests)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
    )
except ImportError:  # pragma: no cover - only the module's pure parts are usable then
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole = object, object, None

# vLLM's request (vllm.v1.request.Request), for annotations only: not imported, so the module
# keeps no import that only a type checker sees (vLLM is optional here).
Request = Any

CONNECTOR = "TalariaHostKvConnector"
# The engine-core utility the agent calls (AsyncLLM.engine_core.call_utility_async) to reach the
# scheduler-side connector: `TalariaHostKvConnector.host_kv`.
UTILITY = "talaria_host_kv"


def transfer_config(model: str, pool: Path, pool_bytes: int):
    """vLLM's KVTransferConfig that loads this connector for `model`'s engine."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR, kv_connector_module_path=__name__, kv_role="kv_both",
        kv_connector_extra_config={"model": model, "pool": str(pool), "pool_bytes": int(pool_bytes)})


def block_keys(tokens: list[int], block_size: int, scope: str) -> list[int]:
    """One key per full vLLM block: the cumulative Talaria hash at the block's end (it covers
    every token before it, scope included). `block_size` is a multiple of the hash block."""
    if block_size % HASH_BLOCK_TOKENS:
        raise ValueError(f"vLLM block size {block_size} is not a multiple of {HASH_BLOCK_TOKENS}")
    per = block_size // HASH_BLOCK_TOKENS
    hashes = block_hashes(tokens[: len(tokens) // block_size * block_size], HASH_BLOCK_TOKENS, scope=scope)
    return hashes[per - 1 :: per]


def _engine_core_host_kv(self, op: str, args: list) -> Any:
    """EngineCore.talaria_host_kv: the scheduler-side connector's `host_kv`. vLLM has no hook for
    a connector's own utility, so the connector adds this one method to the engine core's class
    in its process (`install_utility`). The busy loop runs a utility between steps on the
    scheduler's thread, so the connector's bookkeeping needs no lock."""
    connector = self.scheduler.get_kv_connector()
    if not isinstance(connector, TalariaHostKvConnector):
        raise RuntimeError(f"{UTILITY}: this engine's KV connector is not {CONNECTOR}")
    return connector.host_kv(op, list(args))


def install_utility() -> None:
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, UTILITY, None) is None:
        setattr(EngineCore, UTILITY, _engine_core_host_kv)


def page_shape(layer_bytes: list[int]) -> tuple[int, ...]:
    """A migrated page's layout (its bytes as the pool holds them: each layer's block, layers in
    name order): (layers, bytes per layer) when every layer's block is the same size, else
    (bytes,). Two engines exchange pages only when it is equal (and the block size, by the keys)."""
    if layer_bytes and len(set(layer_bytes)) == 1:
        return (len(layer_bytes), layer_bytes[0])
    return (sum(layer_bytes),)


@dataclass
class TalariaKvMetadata(KVConnectorMetadata):  # type: ignore[misc, valid-type]
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, vLLM block id)
    saves: list[tuple[int, int]] = field(default_factory=list)  # (vLLM block id, host slot)


@dataclass
class _Load:
    first_block: int
    keys: list[int]  # the request's block keys up to the last block to load


class TalariaHostKvConnector(KVConnectorBase_V1):  # type: ignore[misc, valid-type]
    """HKVR as vLLM's host KV tier (vLLM's `KVConnectorBase_V1`):

        save  write-through: when a vLLM block of a request fills (prompt or decode), the worker
              copies it to a host page after the step's forward (`wait_for_save`); the page is
              published (restorable) once that step is over. A session's KV is thus on the host
              before its engine drops it: a prefix-cache eviction, or a switch that sleeps the
              engine (GPU) or releases its KV (TALARIA_VLLM_SWITCH=release).
        load  a new request whose prompt's next blocks are on the host (beyond vLLM's own prefix
              cache hit) gets them copied into its freshly allocated blocks before its first
              forward (`start_load_kv`); vLLM computes only the rest.

    Where it runs: the scheduler-side instance (slots, LRU, publication: `HkvrCore`) in vLLM's
    engine-core process, the worker-side instance (byte copies) in its worker process; the host
    pages are one shared-memory file both map (`pool`), created by the agent (vllm_engine.py).
    A page is one vLLM block of every layer, keyed (model, rank 0, Talaria hash of the block's
    last 16-token hash block), so the same tokens under the same scope hit whoever computed them.
    The agent learns what a call loaded from its last output (`kv_transfer_params`).

    Needs synchronous scheduling (the agent turns vLLM's async scheduling off with it): a step's
    saves are complete when the next step is scheduled.
    """

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.model = extra["model"]
        self.block_size = vllm_config.cache_config.block_size
        self.page_bytes = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                              for g in kv_cache_config.kv_cache_groups)
        self.capacity = int(extra["pool_bytes"]) // self.page_bytes
        self.pool_path = extra["pool"]
        # bytes of one block of each layer, in the pool's (name) order
        self.layer_bytes = [size for _, size in sorted(
            (name, g.kv_cache_spec.page_size_bytes) for g in kv_cache_config.kv_cache_groups for name in g.layer_names)]
        if role == KVConnectorRole.SCHEDULER:
            install_utility()
            self.leases: dict[int, Any] = {}  # an export's pinned pages (HkvrCore.lease_shareable), by lease id
            self.imports: dict[int, str] = {}  # an import's reserved pages (HkvrCore.plan_save): job id -> session
            self.core = HkvrCore(max(self.capacity, 1), ranks=1)
            self._lease_ids = itertools.count(1)
            self.requests: dict[str, Request] = {}
            self.pending_loads: dict[str, _Load] = {}
            self.loaded_tokens: dict[str, int] = {}
            self.local_hit: dict[str, int] = {}
            self.saved_blocks: dict[str, int] = {}  # leading blocks of a request already on the host
            self.inflight_jobs: list[int] = []  # saves of the step being executed
            self.inflight_restores: list = []
            self.manager = None
        else:
            self.pool = None
            self.layers: list[torch.Tensor] = []
            self.host_layers: list[torch.Tensor] = []  # per layer: the pool as [slot, *block]

    # -- scheduler side -------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self.manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        self.requests[request.request_id] = request

    def _keys(self, request: Request, upto: int) -> list[int]:
        return block_keys(list(request.all_token_ids[:upto]), self.block_size, request.cache_salt or "")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.capacity <= 0:
            return 0, False
        keys = self._keys(request, request.num_tokens - 1)  # the last token is always computed
        hit = self.core.match(self.model, keys) * self.block_size
        self.local_hit[request.request_id] = num_computed_tokens  # block-aligned: what vLLM holds
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        local = self.local_hit.pop(request.request_id, 0)
        first = local // self.block_size
        last = (local + num_external_tokens) // self.block_size
        self.pending_loads[request.request_id] = _Load(first, self._keys(request, last * self.block_size))
        self.loaded_tokens[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> TalariaKvMetadata:
        self._retire()  # synchronous scheduling: the previous step (its copies) has finished
        meta = TalariaKvMetadata()
        for req_id, load in self.pending_loads.items():
            blocks = self.manager.get_block_ids(req_id)[0]
            plan = self.core.begin_restore(self.model, load.keys)
            self.inflight_restores.append(plan)
            for j in range(load.first_block, len(plan.slots)):
                meta.loads.append((plan.slots[j][0].slot, blocks[j]))
            self.saved_blocks[req_id] = len(plan.slots)
        self.pending_loads.clear()
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, done in computed.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            full = (done + scheduler_output.num_scheduled_tokens.get(req_id, 0)) // self.block_size
            if full <= self.saved_blocks.get(req_id, 0):
                continue
            meta.saves += self._plan_save(request, full)
            self.saved_blocks[req_id] = full
        return meta

    def _plan_save(self, request: Request, full: int) -> list[tuple[int, int]]:
        keys = self._keys(request, full * self.block_size)
        blocks = self.manager.get_block_ids(request.request_id)[0]
        template = LayoutDescriptor(self.model, 0, 0, 0, self.block_size, "uint8", "gqa", (self.page_bytes,), 1)
        session = request.session_id or request.request_id
        plan = self.core.plan_save(self.model, session, [RankReport(0, full * self.block_size, tuple(keys))], template)
        self.inflight_jobs.append(plan.job_id)
        return [(blocks[c.page_index], c.slot) for c in plan.copies]

    def _retire(self) -> None:
        for job in self.inflight_jobs:
            self.core.complete(job)
        self.inflight_jobs.clear()
        for plan in self.inflight_restores:
            self.core.end_restore(plan)
        self.inflight_restores.clear()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self.requests.pop(rid, None)
        self.pending_loads.pop(rid, None)
        self.local_hit.pop(rid, None)
        saved = self.saved_blocks.pop(rid, 0) * self.block_size
        return False, {"host_tokens": self.loaded_tokens.pop(rid, 0), "host_saved_tokens": saved}

    # -- KV migration: the agent's side of the pool (engine-core utility, `UTILITY`) -------

    def host_kv(self, op: str, args: list) -> Any:
        """One step of a migration, asked by the agent (vllm_engine.py); the page bytes move
        through the agent's own mapping of the pool, between `lease`/`release` and between
        `reserve`/`publish`:

            layout               {block_size, page_bytes, capacity, layer_bytes}
            lease session keys   pin the leading `keys` the session's own published prefix holds:
                                 [lease id, [[key, slot], ...]]
            release lease        unpin them (the agent has copied them out)
            hashes session       the keys of the session's published prefix (a drain's listing)
            reserve session keys slots for `keys`' pages not held yet (pinned, unpublished):
                                 [job id, [[index in keys, slot], ...]]
            publish job          the agent wrote them: publish; the session's restorable tokens
        """
        if op == "layout":
            return {"block_size": self.block_size, "page_bytes": self.page_bytes, "capacity": self.capacity,
                    "layer_bytes": self.layer_bytes}
        # No step runs while a utility does (synchronous scheduling): the last step's saves have
        # landed, so they publish now rather than at the next step (an idle engine has none).
        self._retire()
        if op == "lease":
            session, keys = str(args[0]), [int(k) for k in args[1]]
            plan = self.core.lease_shareable(session, self.model, keys)
            lease = next(self._lease_ids) if plan.slots else 0
            if lease:
                self.leases[lease] = plan
            return [lease, [[int(row[0].key[2]), row[0].slot] for row in plan.slots]]
        if op == "release":
            plan = self.leases.pop(int(args[0]), None)
            if plan is not None:
                self.core.end_restore(plan)
            return None
        if op == "hashes":
            return self.core.session_hashes(str(args[0]), self.model)
        if op == "reserve":
            session, keys = str(args[0]), [int(k) for k in args[1]]
            template = LayoutDescriptor(self.model, 0, 0, 0, self.block_size, "uint8", "gqa", (self.page_bytes,), 1)
            plan = self.core.plan_save(self.model, session, [RankReport(0, len(keys) * self.block_size, tuple(keys))],
                                       template)
            self.imports[plan.job_id] = session
            return [plan.job_id, [[c.page_index, c.slot] for c in plan.copies]]
        if op == "publish":
            job = int(args[0])
            session = self.imports.pop(job)
            self.core.complete(job)
            return self.core.session_tokens(session, self.model, self.block_size)
        raise ValueError(f"{UTILITY}: unknown op {op!r}")

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = [kv_caches[name] for name in sorted(kv_caches)]
        slab = sum(t[0].numel() * t.element_size() for t in self.layers)
        if slab != self.page_bytes:
            raise ValueError(f"KV layout: a block is {slab} bytes across layers, the config says {self.page_bytes}")
        size = self.capacity * self.page_bytes
        if not size:
            return
        self.pool = torch.from_file(self.pool_path, shared=True, size=size, dtype=torch.uint8).view(self.capacity, -1)
        # Touch every page once now: a first write into the shared file costs a page fault
        # per 4 KiB, which would otherwise land in the steps that save.
        self.pool.zero_()
        off = 0
        for t in self.layers:  # a strided view per layer, so a step copies one indexed op per layer
            n = t[0].numel() * t.element_size()
            self.host_layers.append(self.pool[:, off:off + n].view(t.dtype).view(self.capacity, *t[0].shape))
            off += n

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if meta.loads:
            slots, blocks = (torch.tensor(x, dtype=torch.long) for x in zip(*meta.loads))
            for layer, host in zip(self.layers, self.host_layers):
                layer[blocks.to(layer.device)] = host[slots].to(layer.device)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks are copied after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not meta.saves:
            return
        blocks, slots = (torch.tensor(x, dtype=torch.long) for x in zip(*meta.saves))
        for layer, host in zip(self.layers, self.host_layers):
            host[slots] = layer[blocks.to(layer.device)].cpu()

