"""The model-switch procedure, in the paper's five phases (App. D).

    P1 save/teardown  drain the outgoing model's D2H copies (scoped barrier), drop its
                      session entries and prefix index: the KV region is released
    P2 open weights   wait for staging writes, then D2D the clean staged chunks and H2D
                      the rest from the host image into the resized weight region
    P3 KV shell       rebind the cached KV-pool view if the pointer check passes, else rebuild
    P4 runtime        RoPE tables in the runtime region (kept when the signature matches)
    P5 publish        swap params, KV view, page pool, index and session cache

No tensor is allocated on this path except the small page-pool bookkeeping lists: every
region is a view of the bump buffer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from talaria.services.instance_agent.engine.contract import SwitchRecord
from talaria.services.instance_agent.engine.kv_cache import PagePool, DevicePrefixIndex, SessionCache
from talaria.services.instance_agent.engine.model import rope_tables

if TYPE_CHECKING:
    from talaria.services.instance_agent.engine.torch_engine import TorchEngine


def switch(eng: TorchEngine, model: str) -> SwitchRecord:
    rec = SwitchRecord(eng.active_model, model, "host_only")
    t0 = time.perf_counter()
    _teardown(eng, rec)
    t1 = time.perf_counter()
    _open_weights(eng, model, rec)
    t2 = time.perf_counter()
    kv = _kv_shell(eng, model, rec)
    t3 = time.perf_counter()
    params, rope = _runtime(eng, model, rec)
    t4 = time.perf_counter()
    _publish(eng, model, params, kv, rope)
    t5 = time.perf_counter()
    rec.save_teardown_s, rec.open_weights_s, rec.kv_shell_s = t1 - t0, t2 - t1, t3 - t2
    rec.runtime_s, rec.publish_s, rec.total_s = t4 - t3, t5 - t4, t5 - t0
    return rec


def _teardown(eng: TorchEngine, rec: SwitchRecord) -> None:
    if eng.active_model is None:
        return
    if eng.hkvr is not None:
        rec.drained_d2h_jobs = eng.hkvr.drain(eng.active_model)  # before the KV region goes
    eng.sessions.clear()
    eng.index.clear()
    eng.pool = eng.index = eng.sessions = None
    eng.kv = None


def _open_weights(eng: TorchEngine, model: str, rec: SwitchRecord) -> None:
    cold = model not in eng.host_images
    image = eng._host_image(model)
    if cold:
        rec.bytes_from_file = image.numel()
    eng.bump.resize_weights(image.numel())
    dst = eng.bump.weight_region()
    if eng.staging is not None:
        res = eng.staging.gather(model, image, dst)
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


def _kv_shell(eng: TorchEngine, model: str, rec: SwitchRecord) -> torch.Tensor:
    spec = eng.specs[model]
    shell = eng._shells.get(model)
    if shell is not None and shell.data_ptr() == eng.bump.bases().kv:
        rec.kv_shell_reused = True
        return shell
    rec.pointer_check_ok = shell is None  # a cached shell whose base moved is rebuilt
    shell = eng.bump.kv_view((spec.layers, 2, eng.page_size, spec.kv_heads, spec.head_dim))
    eng._shells[model] = shell
    return shell


def _runtime(eng: TorchEngine, model: str, rec: SwitchRecord):
    spec, layout = eng.specs[model], eng.layouts[model]
    views = eng._views.get(model)
    base = eng.bump.bases().weight
    if views is None or views[layout.slots[0].name].data_ptr() != base:
        rec.pointer_check_ok = rec.pointer_check_ok and views is None
        views = layout.views(eng.bump.weight_region())
        eng._views[model] = views
    if spec.arch == "gpt2":
        return views, None
    half = spec.head_dim // 2
    n = spec.context_length * half
    region = eng.bump.runtime_region()[: 2 * n * 4].view(torch.float32)
    cos, sin = region[:n].view(spec.context_length, half), region[n:].view(spec.context_length, half)
    signature = (spec.context_length, spec.head_dim, spec.rope_theta)
    if eng._runtime_owner != signature:
        c, s = rope_tables(spec, eng.device)
        cos.copy_(c)
        sin.copy_(s)
        eng._runtime_owner = signature
    return views, (cos, sin)


def _publish(eng: TorchEngine, model: str, params, kv: torch.Tensor, rope) -> None:
    pb = eng.page_bytes(model)
    planner = eng.staging.planner if eng.staging is not None else None

    def blocked(page: int) -> bool:
        return planner is not None and planner.blocked(*eng.bump.page_range(page, pb))

    def on_alloc(page: int) -> None:
        if planner is not None:
            planner.on_kv_alloc(*eng.bump.page_range(page, pb))

    eng.params, eng.kv, eng.rope = params, kv, rope
    eng.pool = PagePool(kv.shape[0], is_blocked=blocked, on_alloc=on_alloc)
    eng.index = DevicePrefixIndex(eng.pool)
    eng.sessions = SessionCache(eng.pool)
    eng._active = model
