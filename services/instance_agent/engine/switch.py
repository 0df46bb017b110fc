"""The model-switch procedure, in the paper's five phases (App. D).

    P1 save/teardown  drain the outgoing model's D2H copies (scoped barrier), drop its
                      session entries and prefix index: the KV region is released
    P2 open weights   wait for staging writes, then D2D the clean staged chunks and H2D
                      the rest from the host image into the resized weight region
    P3 KV shell       rebind the cached KV-pool view if the pointer check passes, else rebuild
    P4 runtime        RoPE tables in the runtime region (kept when the signature matches)
    P5 publish        swap params, KV view, page pool, index and session cache

No tensor is allocated on this path except the small page-pool bookkeeping lists: every
region is a view of the bump buffer. A part of `TorchEngine` (torch_engine.py): it owns the
views it caches across switches (KV shells, weight views, the RoPE tables' owner) and turns
the active `DeviceModel` into the next one.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from talaria.services.instance_agent.engine.contract import SWITCHES_KEPT, SwitchRecord
from talaria.services.instance_agent.engine.device_model import DeviceModel
from talaria.services.instance_agent.engine.kv_cache import DevicePrefixIndex, PagePool, SessionCache
from talaria.services.instance_agent.engine.model import rope_tables
from talaria.services.instance_agent.engine.model_store import ModelStore
from talaria.services.instance_agent.memory.bump import BumpBuffer
from talaria.services.instance_agent.memory.hkvr import HostKvRegistry
from talaria.services.instance_agent.memory.staging import StagingExecutor


class ModelSwitcher:
    def __init__(self, models: ModelStore, bump: BumpBuffer, hkvr: HostKvRegistry | None,
                 staging: StagingExecutor | None) -> None:
        self.models, self.bump, self.hkvr, self.staging = models, bump, hkvr, staging
        self.records: deque[SwitchRecord] = deque(maxlen=SWITCHES_KEPT)
        self._shells: dict[str, torch.Tensor] = {}
        self._views: dict[str, dict[str, torch.Tensor]] = {}
        self._runtime_owner: tuple | None = None

    def switch(self, current: DeviceModel | None, model: str) -> DeviceModel:
        """The five phases; the record is appended to `records`."""
        rec = SwitchRecord(current.name if current else None, model, "host_only")
        t0 = time.perf_counter()
        self._teardown(current, rec)
        t1 = time.perf_counter()
        self._open_weights(model, rec)
        t2 = time.perf_counter()
        kv = self._kv_shell(model, rec)
        t3 = time.perf_counter()
        params, rope = self._runtime(model, rec)
        t4 = time.perf_counter()
        published = self._publish(model, params, kv, rope)
        t5 = time.perf_counter()
        rec.save_teardown_s, rec.open_weights_s, rec.kv_shell_s = t1 - t0, t2 - t1, t3 - t2
        rec.runtime_s, rec.publish_s, rec.total_s = t4 - t3, t5 - t4, t5 - t0
        self.records.append(rec)
        return published

    def _teardown(self, current: DeviceModel | None, rec: SwitchRecord) -> None:
        if current is None:
            return
        if self.hkvr is not None:
            rec.drained_d2h_jobs = self.hkvr.drain(current.name)  # before the KV region goes
        current.sessions.clear()
        current.index.clear()

    def _open_weights(self, model: str, rec: SwitchRecord) -> None:
        cold = model not in self.models.host_images
        image = self.models.host_image(model)
        if cold:
            rec.bytes_from_file = image.numel()
        self.bump.resize_weights(image.numel())
        dst = self.bump.weight_region()
        if self.staging is not None:
            res = self.staging.gather(model, image, dst)
            rec.bytes_d2d, rec.bytes_h2d = res.bytes_d2d, res.bytes_h2d
            rec.bytes_staged, rec.bytes_uncovered = res.plan.staged_bytes, res.plan.uncovered_bytes
            rec.dirty_chunks = res.plan.dirty_chunks
            rec.path = res.plan.path  # type: ignore[assignment]
        else:
            dst.copy_(image, non_blocking=True)
            if dst.device.type == "cuda":
                torch.cuda.current_stream(dst.device).synchronize()
            rec.bytes_h2d = rec.bytes_uncovered = image.numel()
        if cold:
            rec.path = "cold"

    def _kv_shell(self, model: str, rec: SwitchRecord) -> torch.Tensor:
        spec = self.models.specs[model]
        shell = self._shells.get(model)
        if shell is not None and shell.data_ptr() == self.bump.bases().kv:
            rec.kv_shell_reused = True
            return shell
        rec.pointer_check_ok = shell is None  # a cached shell whose base moved is rebuilt
        shell = self.bump.kv_view((spec.layers, 2, self.models.page_size, spec.kv_heads, spec.head_dim),
                                  self.models.dtypes[model].dtype)
        self._shells[model] = shell
        return shell

    def _runtime(self, model: str, rec: SwitchRecord):
        spec, layout = self.models.specs[model], self.models.layouts[model]
        views = self._views.get(model)
        base = self.bump.bases().weight
        if views is None or views[layout.slots[0].name].data_ptr() != base:
            rec.pointer_check_ok = rec.pointer_check_ok and views is None
            views = layout.views(self.bump.weight_region())
            self._views[model] = views
        if spec.arch == "gpt2":
            return views, None
        half = spec.head_dim // 2
        n = spec.context_length * half
        region = self.bump.runtime_region()[: 2 * n * 4].view(torch.float32)
        cos, sin = region[:n].view(spec.context_length, half), region[n:].view(spec.context_length, half)
        signature = (spec.context_length, spec.head_dim, spec.rope_theta)
        if self._runtime_owner != signature:
            c, s = rope_tables(spec, self.models.device)
            cos.copy_(c)
            sin.copy_(s)
            self._runtime_owner = signature
        return views, (cos, sin)

    def _publish(self, model: str, params, kv: torch.Tensor, rope) -> DeviceModel:
        pb = self.models.page_bytes(model)
        planner = self.staging.planner if self.staging is not None else None
        bump = self.bump

        def blocked(page: int) -> bool:
            return planner is not None and planner.blocked(*bump.page_range(page, pb))

        def on_alloc(page: int) -> None:
            if planner is not None:
                planner.on_kv_alloc(*bump.page_range(page, pb))

        pool = PagePool(kv.shape[0], is_blocked=blocked, on_alloc=on_alloc)
        return DeviceModel(model, self.models.specs[model], params, kv, rope, pool, DevicePrefixIndex(pool),
                           SessionCache(pool))
