"""TorchEngine: small real models served from a bump-managed buffer with paged KV.

One call's path:  prefill(reqs) -> admit (match device session/prefix pages, then host
pages via HKVR, reserve the rest) -> chunked batched prefill of the unmatched suffix ->
first token;  decode(ids) -> one batched step;  finish(id) -> index full pages, keep the
session entry on device, checkpoint full pages to HKVR asynchronously.

Threading: NOT thread-safe. The instance agent calls every method from one worker thread.
Copies run on internal copier threads (CPU) or streams (CUDA), but all bookkeeping —
page refs, HKVR commits, staging chunk states — happens on the caller's thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from talaria.services.instance_agent.engine import switch as switching
from talaria.services.instance_agent.engine.api import EngineStats, GenRequest, GenResult, StepToken, SwitchRecord
from talaria.services.instance_agent.engine.contract import Capabilities
from talaria.services.instance_agent.engine.errors import (
    ContextTooLong, EngineBusy, InvalidRequest, ModelNotActive, OutOfKvPages, UnknownCall, UnknownModel,
)
from talaria.services.instance_agent.engine.kv_cache import PagePool, DevicePrefixIndex, SessionCache, DeviceKvSession
from talaria.services.instance_agent.engine.model import SeqSlice, forward, paged_attention
from talaria.services.instance_agent.engine.sampling import make_generator
from talaria.services.instance_agent.engine.sequence import Sequence
from talaria.services.instance_agent.engine.weights import (
    WeightLayout, align_up, ensure_weights_file, load_host_image, weight_layout,
)
from talaria.services.instance_agent.memory.bump import BumpBuffer
from talaria.services.instance_agent.memory.hkvr import HostKvRegistry
from talaria.services.instance_agent.memory.hkvr_core import LayoutDescriptor, RankReport
from talaria.services.instance_agent.memory.staging import StagingExecutor
from talaria.shared.catalog import CATALOG, ModelSpec
from talaria.shared.limits import logprob_problem
from talaria.shared.model_text import text_for
from talaria.shared.stats import ewma
from talaria.shared.tokenizer import block_hashes

EMA = 0.3  # weight of the newest sample in the measured rates


class TorchEngine:
    def __init__(
        self,
        data_dir: Path,
        models: list[str],
        *,
        device: str = "cpu",
        kv_pages: int | None = None,
        page_size: int = 16,
        tp_ranks: int = 2,
        hkvr: bool = True,
        host_kv_pages: int = 4096,
        staging: bool = True,
        stage_chunk_bytes: int = 256 * 1024,
        auto_stage: bool = True,
        prefill_chunk: int = 1024,
        preload_host: bool = True,
    ) -> None:
        """kv_pages (default: one longest-context call) sizes the KV gap for the model with the largest pages; models with smaller
        pages (or smaller weights) get more. Host images are preloaded (the host model entry)
        unless preload_host=False, in which case a model's first open reads its file ('cold')."""
        unknown = [m for m in models if m not in CATALOG]
        if unknown or not models:
            raise UnknownModel(unknown[0] if unknown else "", sorted(CATALOG))
        self.data_dir = Path(data_dir)
        self.device = torch.device(device)
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        # Chunked prefill: asked between forward passes whether to end the chunk early (a
        # driver sets it when a call arrives); the calls not done continue in a later chunk.
        self.should_yield: Callable[[], bool] | None = None
        self.auto_stage = auto_stage
        self.specs: dict[str, ModelSpec] = {m: CATALOG[m] for m in models}
        if kv_pages is None:  # room for one call of the longest context
            kv_pages = max(1024, max(math.ceil(s.context_length / page_size) for s in self.specs.values()))
        self.layouts: dict[str, WeightLayout] = {m: weight_layout(s) for m, s in self.specs.items()}
        for m, s in self.specs.items():
            if s.kv_heads % tp_ranks:
                raise ValueError(f"tp_ranks={tp_ranks} does not divide {m}'s {s.kv_heads} KV heads")
        self.tp_ranks = tp_ranks
        self.ensure_weights()

        runtime = max((s.context_length * s.head_dim * 4 for s in self.specs.values() if s.arch != "gpt2"), default=0)
        max_page = max(self.page_bytes(m) for m in models)
        total = align_up(max(lay.nbytes for lay in self.layouts.values())) + kv_pages * max_page + align_up(runtime)
        self.bump = BumpBuffer(total, max(runtime, 256), self.device)
        self.host_images: dict[str, torch.Tensor] = {}
        if preload_host:
            for m in models:
                self._host_image(m)
        slot = max(self.page_bytes(m) // tp_ranks for m in models)
        self.hkvr = HostKvRegistry(host_kv_pages, slot, self.device, tp_ranks) if hkvr else None
        self.staging = StagingExecutor(self.bump.buf, stage_chunk_bytes, self.device) if staging else None
        # switch_to refuses while calls run (EngineBusy); host KV and staging as configured.
        self.capabilities = Capabilities(switch_with_calls_running=False, host_kv=hkvr, d2d_staging=staging,
                                         chunked_prefill=False)
        self.rank_fault: Callable[[RankReport], RankReport] | None = None  # test hook: a lagging/bad rank
        self.on_logits: Callable[[list[str], torch.Tensor], None] | None = None  # test/debug hook

        self._active: str | None = None
        self.params: dict[str, torch.Tensor] = {}
        self.kv: torch.Tensor | None = None
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pool: PagePool | None = None
        self.index: DevicePrefixIndex | None = None
        self.sessions: SessionCache | None = None
        self.running: dict[str, Sequence] = {}
        self.switches: list[SwitchRecord] = []
        self._shells: dict[str, torch.Tensor] = {}
        self._views: dict[str, dict[str, torch.Tensor]] = {}
        self._runtime_owner: tuple | None = None
        self._rates = {"prefill": 0.0, "decode": 0.0, "restore": 0.0}

    # -- models and weights --------------------------------------------------------------

    @property
    def active_model(self) -> str | None:
        return self._active

    def ensure_weights(self) -> None:
        """Write `<data_dir>/models/<name>.safetensors` (+ json) for every model if missing."""
        for spec in self.specs.values():
            ensure_weights_file(self.data_dir, spec)

    def page_bytes(self, model: str) -> int:
        s = self.specs[model]
        return s.layers * 2 * self.page_size * s.kv_heads * s.head_dim * 4

    def _spec(self, model: str) -> ModelSpec:
        try:
            return self.specs[model]
        except KeyError:
            raise UnknownModel(model, sorted(self.specs)) from None

    def _host_image(self, model: str) -> torch.Tensor:
        img = self.host_images.get(model)
        if img is None:
            pin = self.device.type == "cuda"
            img = load_host_image(self.data_dir, self.specs[model], self.layouts[model], pin=pin)
            self.host_images[model] = img
        return img

    def switch_to(self, model: str) -> SwitchRecord:
        """Make `model` active (paper App. D phases). Refused while calls are running."""
        self._spec(model)
        if model == self._active:
            return SwitchRecord(model, model, "noop")  # type: ignore[arg-type]
        if self.running:
            raise EngineBusy(sorted(self.running))
        previous = self._active
        rec = switching.switch(self, model)
        self.switches.append(rec)
        if self.staging is not None and self.auto_stage and previous is not None:
            self.stage(previous)  # ping-pong default; the round scheduler may stage another
        return rec

    def stage(self, model: str, *, wait: bool = False) -> int:
        """Pre-stage `model`'s weights into the free tail of the KV pool while serving.

        Writes proceed a few chunks at a time from every prefill/decode step; `wait=True`
        runs them to completion now (benchmarks, tests). Returns the clean staged bytes."""
        self._spec(model)
        if self.staging is None or model == self._active or self._active is None:
            return 0
        if self.staging.planner.target != model:
            lo_limit = max(self.bump.kv_base, align_up(self.layouts[model].nbytes))
            self.staging.stage(model, self._host_image(model), lo_limit, self.bump.runtime_base)
        self._pump()
        while wait and self.staging.planner.writing():
            self.staging.wait_all()
            self._pump()
        return self.staging.planner.staged_bytes()

    # -- blocking API --------------------------------------------------------------------

    def generate(self, req: GenRequest, on_token: Callable[[int, str], None] | None = None) -> GenResult:
        t0 = time.perf_counter()
        self._spec(req.model)
        if req.model != self._active:
            self.switch_to(req.model)
        step = self._prefill([req], t0)[0]
        while True:
            if on_token is not None:
                on_token(step.token_id, step.text)
            if step.finished:
                break
            step = self.decode([req.call_id])[0]
        return self.finish(req.call_id)

    # -- stepped API ---------------------------------------------------------------------

    def prefill(self, reqs: list[GenRequest], chunk_tokens: int = 0, more: Iterable[str] = ()) -> list[StepToken]:
        """Admit and prefill `reqs` (all for one model; switches if nothing is running), and
        continue the prefill of running calls `more` (admitted by an earlier chunk).
        `chunk_tokens` > 0 computes at most that many prompt tokens per call; only calls
        whose prompt is then complete return their first token."""
        return self._prefill(reqs, time.perf_counter(), chunk_tokens, tuple(more))

    def decode(self, call_ids: list[str]) -> list[StepToken]:
        """One batched decode step for each listed running, unfinished call."""
        seqs = [self._running_seq(c) for c in call_ids]
        if not seqs:
            return []
        self._poll()
        t0 = time.perf_counter()
        logits = self._forward([(s, s.kv_len, 1) for s in seqs])
        if self.on_logits is not None:
            self.on_logits(call_ids, logits)
        now = time.perf_counter()
        out = [s.take(logits[i], now) for i, s in enumerate(seqs)]
        for s in seqs:
            s.decode_s += now - t0
        self._rate("decode", len(seqs), now - t0)
        self._pump()
        return out

    def finish(self, call_id: str) -> GenResult:
        """Release the call's running state; keep its KV as the session's device entry and
        checkpoint its full pages to HKVR. An unfinished call is ended with 'abort'."""
        seq = self.running.pop(call_id, None)
        if seq is None:
            raise UnknownCall(call_id)
        ps, model = self.page_size, self._active
        committed = seq.tokens[: seq.kv_len]
        pages = seq.pages[: math.ceil(seq.kv_len / ps)]
        for extra in seq.pages[len(pages):]:
            self.pool.unuse(extra)
        hashes = block_hashes(committed, ps, scope=seq.req.kv_scope)
        for h, page in zip(hashes, pages):
            self.index.insert(h, page)
        self.sessions.put(DeviceKvSession(seq.req.session_id, model, committed, list(pages)))
        if self.hkvr is not None and hashes:
            self._checkpoint(seq.req.session_id, committed, pages[: len(hashes)], hashes)
        for page in pages:
            self.pool.unuse(page)
        return seq.result(model)

    def prompt_left(self, call_ids: Iterable[str]) -> dict[str, int]:
        """Prompt tokens each running call still has to prefill (0 once it has its first token)."""
        out = {}
        for c in call_ids:
            seq = self.running.get(c)
            if seq is not None:
                out[c] = 0 if seq.t_first is not None else max(0, len(seq.tokens) - seq.kv_len)
        return out

    # -- state for telemetry -------------------------------------------------------------

    def kv_state(self, session_id: str, model: str) -> str:
        if model == self._active and self.sessions is not None and self.sessions.get(session_id):
            return "device"
        if self.hkvr is not None and model in self.specs:
            if self.hkvr.core.session_tokens(session_id, model, self.page_size) > 0:
                return "host"
        return "none"

    def device_prefix(self, session_id: str, model: str, prompt_ids: list[int]) -> int:
        """Leading tokens of `prompt_ids` the session's device KV holds (what admission reuses
        from it), 0 when it holds none for `model`. A prompt that does not extend the session's
        last one (a re-rendered turn) reuses only the common prefix."""
        entry = self.sessions.get(session_id) if model == self._active and self.sessions is not None else None
        if entry is None or entry.model != model:
            return 0
        return _common_prefix(entry.tokens, prompt_ids)

    def session_states(self) -> list[tuple[str, str, str, int]]:
        out = []
        if self.sessions is not None:
            out = [(e.session_id, e.model, "device", len(e.tokens)) for e in self.sessions.entries()]
        on_device = {(s, m) for s, m, _, _ in out}
        if self.hkvr is not None:
            out += [(s, m, "host", n) for s, m, n in self.hkvr.core.session_prefixes(self.page_size)
                    if (s, m) not in on_device]
        return out

    def stats(self) -> EngineStats:
        ps = self.page_size
        cap = used = free_tail = pinned = 0
        if self.pool is not None:
            cap = self.pool.num_pages * ps
            used = (self.pool.num_pages - self.pool.num_free) * ps
            to_come = sum(s.pages_to_come() for s in list(self.running.values()))
            pinned = min(cap, (self.pool.num_pages - self.pool.num_unused() + to_come) * ps)
            pb = self.page_bytes(self._active)
            top = self.bump.kv_base + (self.pool.highest_used() + 1) * pb
            free_tail = self.bump.runtime_base - top
        core = self.hkvr.core if self.hkvr is not None else None
        weights = self.layouts[self._active].nbytes if self._active else 0
        used_bytes = weights + (used // ps) * (self.page_bytes(self._active) if self._active else 0)
        return EngineStats(
            active_model=self._active, kv_capacity_tokens=cap, kv_used_tokens=used,
            prefill_tok_s=self._rates["prefill"], decode_tok_s=self._rates["decode"],
            restore_tok_s=self._rates["restore"],
            last_switch_s=self.switches[-1].total_s if self.switches else 0.0,
            hbm_bytes=self.bump.size, hbm_used_bytes=used_bytes + (self.bump.size - self.bump.runtime_base),
            staging_free_bytes=free_tail if self.staging is not None else 0,
            staged_bytes=self.staging.planner.staged_bytes() if self.staging is not None else 0,
            running_calls=len(self.running),
            host_kv_capacity_pages=core.capacity if core else 0,
            host_kv_used_pages=core.used_pages if core else 0,
            host_hits=core.counters.hits if core else 0, host_misses=core.counters.misses if core else 0,
            host_evictions=core.counters.evictions if core else 0,
            weight_bytes={m: lay.nbytes for m, lay in self.layouts.items()},
            kv_pinned_tokens=pinned,
        )

    def close(self) -> None:
        if self.hkvr is not None:
            self.hkvr.close()
        if self.staging is not None:
            self.staging.close()

    # -- admission -----------------------------------------------------------------------

    def _prefill(self, reqs: list[GenRequest], t0: float, chunk: int = 0, more: tuple[str, ...] = ()) -> list[StepToken]:
        if not reqs and not more:
            return []
        cont = []
        for call_id in more:
            seq = self.running.get(call_id)
            if seq is None or seq.kv_len >= len(seq.tokens):
                raise UnknownCall(call_id, "not a call with prefill left")
            cont.append(seq)
        for r in reqs:
            self._validate(r)
        models = {r.model for r in reqs}
        if len(models) > 1:
            raise ModelNotActive(sorted(models)[1], self._active)
        if reqs and reqs[0].model != self._active:
            if self.running:
                raise ModelNotActive(reqs[0].model, self._active)
            self.switch_to(reqs[0].model)
        self._poll()
        seqs: list[Sequence] = []
        try:
            for r in reqs:
                seqs.append(self._admit(r, t0))
        except Exception:
            for s in seqs:
                self._release(s)
            raise
        for s in seqs:
            self.running[s.req.call_id] = s
        seqs = cont + seqs
        before = sum(s.kv_len for s in seqs)
        try:
            t1 = time.perf_counter()
            last = self._run_prefill(seqs, chunk)
            now = time.perf_counter()
            done = [s for s in seqs if s.req.call_id in last]
            if self.on_logits is not None and done:
                self.on_logits([s.req.call_id for s in done], torch.stack([last[s.req.call_id] for s in done]))
            self._rate("prefill", sum(s.kv_len for s in seqs) - before, now - t1)
            out = []
            for s in seqs:
                s.prefill_s += now - t1
            for s in done:
                out.append(s.take(last[s.req.call_id], now))
        except Exception:  # nothing of a failed batch stays running or holds pages
            for s in seqs:
                self._release(s)
            raise
        self._pump()
        return out

    def _validate(self, r: GenRequest) -> None:
        spec = self._spec(r.model)
        if r.call_id in self.running:
            raise InvalidRequest(r.call_id, "call_id", "a call with this id is already running")
        if not r.prompt_ids:
            raise InvalidRequest(r.call_id, "prompt_ids", "empty prompt")
        if any((not isinstance(t, int)) or t < 0 or t >= spec.vocab_size for t in r.prompt_ids):
            raise InvalidRequest(r.call_id, "prompt_ids", f"token ids must be ints in [0, {spec.vocab_size})")
        if len(r.prompt_ids) > spec.context_length:
            raise ContextTooLong(r.model, len(r.prompt_ids), spec.context_length)
        if r.max_tokens < 1:
            raise InvalidRequest(r.call_id, "max_tokens", "must be >= 1")
        if not r.temperature >= 0.0:
            raise InvalidRequest(r.call_id, "temperature", "must be >= 0")
        if not 0.0 < r.top_p <= 1.0:
            raise InvalidRequest(r.call_id, "top_p", "must be in (0, 1]")
        problem = logprob_problem(r.logit_bias, r.logprobs, r.top_logprobs, r.max_tokens, spec.vocab_size)
        if problem is not None:
            raise InvalidRequest(r.call_id, *problem)

    def _admit(self, req: GenRequest, t0: float) -> Sequence:
        """Match device pages, then host pages; reserve the rest. Only the suffix is computed."""
        spec, ps, prompt = self.specs[req.model], self.page_size, list(req.prompt_ids)
        max_match = len(prompt) - 1  # the last prompt token is always computed (its logits)
        hashes = block_hashes(prompt[:max_match], ps, scope=req.kv_scope)
        shared, cow_src, cached = self._match_device(req.session_id, prompt, hashes, max_match)
        for p in shared:
            self.pool.use(p)
        kv_tokens = min(len(prompt) + req.max_tokens - 1, spec.context_length)
        total_pages = math.ceil(kv_tokens / ps)
        new_pages = total_pages - len(shared)
        available = self.pool.num_unused() - sum(s.pages_to_come() for s in self.running.values())
        if new_pages > available:
            for p in shared:
                self.pool.unuse(p)
            raise OutOfKvPages(req.model, new_pages, max(0, available))
        pages, host_tokens = list(shared), 0
        if cow_src is not None:  # partial page: copy, never write into a shared page
            self.pool.use(cow_src)  # so the allocator's eviction cannot hand it out meanwhile
            page = self._alloc_page()
            self.kv[page].copy_(self.kv[cow_src])
            self.pool.unuse(cow_src)
            pages.append(page)
        elif self.hkvr is not None and len(shared) < len(hashes):
            t = time.perf_counter()
            restored = self.hkvr.restore(req.model, hashes[len(shared):], self.kv, self._alloc_page)
            pages += restored
            host_tokens = len(restored) * ps
            cached += host_tokens
            if restored:
                self._rate("restore", host_tokens, time.perf_counter() - t)
        self.sessions.drop(req.session_id)  # its pages are now held by this call
        gen = make_generator(req.seed, self.device) if req.temperature > 0 else None
        return Sequence(req, spec.context_length, prompt, pages, cached, host_tokens, total_pages, t0, gen,
                        text=text_for(spec))

    def _match_device(
        self, session_id: str, prompt: list[int], hashes: list[int], max_match: int
    ) -> tuple[list[int], int | None, int]:
        """(shared full pages, page to copy-on-write for a partial tail, cached tokens).
        The session's own entry is matched first; the prefix index may extend it."""
        ps = self.page_size
        from_index = self.index.match(hashes)
        entry = self.sessions.get(session_id)
        if entry is not None and entry.model == self._active:
            n = min(_common_prefix(entry.tokens, prompt), max_match)
            if n > len(from_index) * ps:
                full = n // ps
                cow = entry.pages[full] if n % ps else None
                return list(entry.pages[:full]), cow, n
        return from_index, None, len(from_index) * ps

    def _release(self, seq: Sequence) -> None:
        self.running.pop(seq.req.call_id, None)
        for p in seq.pages:
            self.pool.unuse(p)

    def _running_seq(self, call_id: str) -> Sequence:
        seq = self.running.get(call_id)
        if seq is None:
            raise UnknownCall(call_id)
        if seq.finished:
            raise UnknownCall(call_id, f"already finished ({seq.finish_reason}); call finish()")
        if seq.t_first is None and seq.kv_len < len(seq.tokens):
            raise UnknownCall(call_id, "still prefilling (chunked); it cannot decode yet")
        return seq

    # -- forward -------------------------------------------------------------------------

    def _run_prefill(self, seqs: list[Sequence], chunk: int = 0) -> dict[str, torch.Tensor]:
        """Batched prefill of each sequence's unmatched suffix, at most `chunk` tokens each
        (0: all); last-token logits of the sequences whose prompt is complete."""
        todo = {s.req.call_id: s for s in seqs}
        left = {i: (chunk if chunk > 0 else len(s.tokens)) for i, s in todo.items()}
        last: dict[str, torch.Tensor] = {}
        while todo:
            parts = [(s, s.kv_len, min(self.prefill_chunk, len(s.tokens) - s.kv_len, left[i]))
                     for i, s in todo.items()]
            logits = self._forward(parts)
            for i, (s, _, n) in enumerate(parts):
                cid = s.req.call_id
                left[cid] -= n
                if s.kv_len == len(s.tokens):
                    last[cid] = logits[i]
                    del todo[cid]
                elif left[cid] <= 0:
                    del todo[cid]  # this chunk is done; the call continues in a later one
            if chunk > 0 and todo and self.should_yield is not None and self.should_yield():
                break  # new work arrived: end the chunk at this forward pass
        return last

    def _forward(self, parts: list[tuple[Sequence, int, int]]) -> torch.Tensor:
        """Compute tokens[p0:p0+n] of each part at positions p0.. ; logits of each part's last row."""
        ps, dev = self.page_size, self.device
        ids, pos, wpages, woffs, slices, last = [], [], [], [], [], []
        row = 0
        for seq, p0, n in parts:
            while len(seq.pages) * ps < p0 + n:
                seq.pages.append(self._alloc_page())
            ids += seq.tokens[p0 : p0 + n]
            pos += range(p0, p0 + n)
            wpages += [seq.pages[p // ps] for p in range(p0, p0 + n)]
            woffs += [p % ps for p in range(p0, p0 + n)]
            table = torch.tensor(seq.pages[: math.ceil((p0 + n) / ps)], dtype=torch.long, device=dev)
            slices.append(SeqSlice(row, n, p0 + n, table))
            row += n
            last.append(row - 1)
        def t(x):
            return torch.tensor(x, dtype=torch.long, device=dev)
        attn = paged_attention(self.kv, slices, t(wpages), t(woffs))
        spec = self.specs[self._active]
        with torch.inference_mode():
            logits = forward(spec, self.params, t(ids), t(pos), attn, self.rope, t(last))
        for seq, p0, n in parts:
            seq.kv_len = p0 + n
        return logits

    def _alloc_page(self) -> int:
        """Lowest free page; evicts index-only prefixes, then LRU sessions, if it must."""
        while True:
            page = self.pool.alloc()
            if page is not None:
                return page
            if self.index.evict_one() or self.sessions.evict_lru():
                continue
            if self.staging is not None and self.staging.planner.writing():
                self.staging.wait_all()  # pages were only blocked by writes in flight
                continue
            raise OutOfKvPages(self._active or "", 1, 0)

    # -- HKVR and staging plumbing ---------------------------------------------------------

    def _checkpoint(self, session_id: str, committed: list[int], pages: list[int], hashes: list[int]) -> None:
        spec, ps = self.specs[self._active], self.page_size
        reports = [RankReport(r, len(committed), tuple(hashes)) for r in range(self.tp_ranks)]
        if self.rank_fault is not None:
            reports = [self.rank_fault(r) for r in reports]
        template = LayoutDescriptor(
            model=self._active, rank=0, prefix_hash=0, committed_tokens=0, page_size=ps, dtype="float32",
            attention="gqa" if spec.kv_heads < spec.heads else "mha",
            shape=(spec.layers, 2, ps, spec.kv_heads // self.tp_ranks, spec.head_dim),
        )
        for p in pages:
            self.pool.use(p)  # transfer pin: the source page outlives any eviction until copied
        pool = self.pool

        def unpin() -> None:
            for p in pages:
                pool.unuse(p)

        self.hkvr.save(self._active, session_id, self.kv, pages, reports, template, unpin)

    def _poll(self) -> None:
        if self.hkvr is not None:
            self.hkvr.poll()

    def _pump(self) -> None:
        if self.staging is None or self.pool is None:
            return
        pb, base, pool = self.page_bytes(self._active), self.bump.kv_base, self.pool

        def slot_is_free(lo: int, hi: int) -> bool:
            first, last = (lo - base) // pb, min((hi - 1 - base) // pb, pool.num_pages - 1)
            return all(pool.cache_refs[p] == 0 and pool.use_refs[p] == 0 for p in range(max(first, 0), last + 1))

        self.staging.pump(slot_is_free)

    def _rate(self, kind: str, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        r = tokens / seconds
        old = self._rates[kind]
        self._rates[kind] = ewma(old or None, r, EMA)


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i, block = 0, 256
    while i < n and a[i:i + block] == b[i:i + block]:  # slices compare in C: a long session is cheap
        i += block
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)
