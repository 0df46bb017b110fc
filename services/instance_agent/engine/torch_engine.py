"""TorchEngine: small real models served from a bump-managed buffer with paged KV.

prefill -> admit (device pages, then host pages via HKVR) -> chunked batched prefill of the
unmatched suffix -> first token; decode -> one batched step; finish -> index full pages, keep
the session on device, checkpoint to HKVR. NOT thread-safe: the agent calls it from one
worker thread. Its parts and threading are `TorchEngine`'s docstring.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from talaria.services.instance_agent.engine import engine_report as report
from talaria.services.instance_agent.engine.admission import KvAdmission
from talaria.services.instance_agent.engine.contract import Capabilities, EngineStats, SwitchRecord
from talaria.services.instance_agent.engine.device_model import DeviceModel, Rates
from talaria.services.instance_agent.engine.engine_errors import EngineBusy, ModelNotActive, UnknownCall, UnknownModel
from talaria.services.instance_agent.engine.forward_pass import ForwardPass
from talaria.services.instance_agent.engine.prefill_probe import probe
from talaria.services.instance_agent.engine.kv_cache import DeviceKvSession
from talaria.services.instance_agent.engine.model_store import ModelStore
from talaria.services.instance_agent.engine.sequence import Sequence, StepToken
from talaria.services.instance_agent.engine.switch import ModelSwitcher
from talaria.services.instance_agent.engine.weights import align_up
from talaria.services.instance_agent.memory.bump import BumpBuffer
from talaria.services.instance_agent.memory.hkvr import HostKvRegistry
from talaria.services.instance_agent.memory.host_pages import LayoutDescriptor, RankReport
from talaria.services.instance_agent.memory.staging import StagingExecutor
from talaria.shared.catalog import BUILTIN_MODELS, Catalogue
from talaria.shared.tokenizer import block_hashes


class TorchEngine:
    """One call's path (its `Sequence`, sequence.py, handed in by the caller):  prefill(seqs) ->
    admit (admission.py: match device session/prefix pages, then host pages via HKVR, reserve
    the rest) -> chunked batched prefill of the unmatched suffix (forward_pass.py) -> first
    token;  decode(seqs) -> one batched step;  finish(seq) -> index full pages, keep the
    session entry on device, checkpoint full pages to HKVR asynchronously; the sequence comes
    back finished. Model switches: switch.py; what it reports: engine_report.py.

    Parts, each owning its state and handed its collaborators: `ModelStore` (specs, layouts,
    host images), `ModelSwitcher` (switch.py: the views it caches across switches),
    `KvAdmission` (admission.py), `ForwardPass` (forward_pass.py) and `Rates`. The engine owns
    the active `DeviceModel` (device_model.py: replaced whole by each switch) and its running
    sequences.

    Threading: NOT thread-safe. The instance agent calls every method from one worker thread.
    Copies run on internal copier threads (CPU) or streams (CUDA), but all bookkeeping —
    page refs, HKVR commits, staging chunk states — happens on the caller's thread.
    """

    def __init__(
        self,
        data_dir: Path,
        models: list[str],
        *,
        catalogue: Catalogue = BUILTIN_MODELS,
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
        dtype: str = "auto",
    ) -> None:
        """kv_pages (default: one longest-context call) sizes the KV gap for the model with the largest pages; models with smaller
        pages (or smaller weights) get more. Host images are preloaded (the host model entry)
        unless preload_host=False, in which case a model's first open reads its file ('cold').
        dtype (TALARIA_DTYPE): auto | float32 | bfloat16, what each model is held in (dtypes.py).
        `models` are names in `catalogue` (the deployment's: CommonSettings.catalogue)."""
        unknown = [m for m in models if m not in catalogue]
        if unknown or not models:
            raise UnknownModel(unknown[0] if unknown else "", sorted(catalogue))
        self.device = torch.device(device)
        self.page_size = page_size
        # Chunked prefill: asked between forward passes whether to end the chunk early (a
        # driver sets it when a call arrives); the calls not done continue in a later chunk.
        self.should_yield: Callable[[], bool] | None = None
        self.auto_stage = auto_stage
        self.models = ModelStore(data_dir, {m: catalogue[m] for m in models}, self.device, page_size, dtype)
        self.specs = self.models.specs
        self.layouts = self.models.layouts
        self.host_images = self.models.host_images
        if kv_pages is None:  # room for one call of the longest context
            kv_pages = max(1024, max(math.ceil(s.context_length / page_size) for s in self.specs.values()))
        for m, s in self.specs.items():
            if s.kv_heads % tp_ranks:
                raise ValueError(f"tp_ranks={tp_ranks} does not divide {m}'s {s.kv_heads} KV heads")
        self.tp_ranks = tp_ranks
        self.ensure_weights()

        runtime = max((s.context_length * s.head_dim * 4 for s in self.specs.values() if s.arch != "gpt2"), default=0)
        max_page = max(self.page_bytes(m) for m in models)
        total = align_up(max(lay.nbytes for lay in self.layouts.values())) + kv_pages * max_page + align_up(runtime)
        self.bump = BumpBuffer(total, max(runtime, 256), self.device)
        if preload_host:
            for m in models:
                self.models.host_image(m)
        slot = max(self.page_bytes(m) // tp_ranks for m in models)
        self.hkvr = HostKvRegistry(host_kv_pages, slot, self.device, tp_ranks) if hkvr else None
        self.staging = StagingExecutor(self.bump.buf, stage_chunk_bytes, self.device) if staging else None
        # switch_to refuses while calls run (EngineBusy); host KV and staging as configured.
        self.capabilities = Capabilities(switch_with_calls_running=False, host_kv=hkvr, d2d_staging=staging,
                                         chunked_prefill=False, kv_migration=hkvr)
        self.rank_fault: Callable[[RankReport], RankReport] | None = None  # test hook: a lagging/bad rank
        self.on_logits: Callable[[list[str], torch.Tensor], None] | None = None  # test/debug hook

        self.rates = Rates()
        self.switcher = ModelSwitcher(self.models, self.bump, self.hkvr, self.staging)
        self.admission = KvAdmission(page_size, self.device, self.hkvr, self.staging, self.rates)
        self.forward = ForwardPass(page_size, self.device, prefill_chunk, self.admission)
        self.dev: DeviceModel | None = None  # the active model on the device
        # The sequences admitted and not finished: for the pages they reserved and the switch
        # they block; callers hand each step its sequences, so none is looked up by id.
        self.running: set[Sequence] = set()
        self.probed: set[str] = set()  # models whose prefill was timed (probe_prefill)

    # -- models and weights --------------------------------------------------------------

    @property
    def active_model(self) -> str | None:
        return self.dev.name if self.dev is not None else None

    @property
    def switches(self) -> deque[SwitchRecord]:
        return self.switcher.records

    # The active model's device tables (None while no model is active), for tests and tools.
    pool = property(lambda self: self.dev.pool if self.dev else None)
    index = property(lambda self: self.dev.index if self.dev else None)
    sessions = property(lambda self: self.dev.sessions if self.dev else None)
    kv = property(lambda self: self.dev.kv if self.dev else None)
    params = property(lambda self: self.dev.params if self.dev else {})
    rope = property(lambda self: self.dev.rope if self.dev else None)

    def ensure_weights(self) -> None:
        """Write `<data_dir>/models/<name>.safetensors` (+ json) for every model if missing."""
        self.models.ensure_weights()

    def page_bytes(self, model: str) -> int:
        return self.models.page_bytes(model)

    def switch_to(self, model: str) -> SwitchRecord:
        """Make `model` active (paper App. D phases). Refused while calls are running."""
        self.models.spec(model)
        if model == self.active_model:
            return SwitchRecord(model, model, "noop")  # type: ignore[arg-type]
        if self.running:
            raise EngineBusy(list(self.running))
        previous, self.dev = self.dev, None  # a switch that fails leaves no model active
        self.dev = self.switcher.switch(previous, model)
        if self.staging is not None and self.auto_stage and previous is not None:
            self.stage(previous.name)  # ping-pong default; the round scheduler may stage another
        return self.switcher.records[-1]

    def probe_prefill(self) -> tuple[str, list[tuple[int, int, float]]] | None:
        """The active model's prefill timed once, the first time it is active (prefill_probe.py):
        (model, [(tokens, context, seconds)]); None when there is nothing to probe."""
        dev = self.dev
        if dev is None or dev.name in self.probed:
            return None
        self.probed.add(dev.name)
        return dev.name, probe(dev, self.page_size, self.device)

    def stage(self, model: str, *, wait: bool = False) -> int:
        """Pre-stage `model`'s weights into the free tail of the KV pool while serving.

        Writes proceed a few chunks at a time from every prefill/decode step; `wait=True`
        runs them to completion now (benchmarks, tests). Returns the clean staged bytes."""
        self.models.spec(model)
        if self.staging is None or model == self.active_model or self.dev is None:
            return 0
        if self.staging.planner.target != model:
            lo_limit = max(self.bump.kv_base, align_up(self.layouts[model].nbytes))
            self.staging.stage(model, self.models.host_image(model), lo_limit, self.bump.runtime_base)
        self._pump()
        while wait and self.staging.planner.writing():
            self.staging.wait_all()
            self._pump()
        return self.staging.planner.staged_bytes()

    # -- blocking API --------------------------------------------------------------------

    def generate(self, seq: Sequence, on_token: Callable[[int, str], None] | None = None) -> Sequence:
        t0 = time.perf_counter()
        self.models.spec(seq.model)
        if seq.model != self.active_model:
            self.switch_to(seq.model)
        step = self._prefill_step([seq], t0)[0]
        while True:
            if on_token is not None:
                on_token(step.token_id, step.text)
            if step.finished:
                break
            step = self.decode([seq])[0]
        return self.finish(seq)

    # -- stepped API ---------------------------------------------------------------------

    def prefill(self, seqs: list[Sequence], chunk_tokens: int = 0, more: Iterable[Sequence] = (),
                pass_tokens: int = 0) -> list[StepToken]:
        """Admit and prefill `seqs` (all for one model; switches if nothing is running), and
        continue the prefill of running calls `more` (admitted by an earlier chunk).
        `chunk_tokens` > 0 computes at most that many prompt tokens per call; only calls
        whose prompt is then complete return their first token. `pass_tokens` > 0 caps a
        forward pass below `prefill_chunk` (`should_yield` is asked between passes)."""
        return self._prefill_step(seqs, time.perf_counter(), chunk_tokens, tuple(more), pass_tokens)

    def _prefill_step(self, new: list[Sequence], t0: float, chunk: int = 0, more: tuple[Sequence, ...] = (),
                      pass_tokens: int = 0) -> list[StepToken]:
        """Admit `new` and prefill them with the running calls `more` that have prompt left;
        first tokens of the calls whose prompt is now complete."""
        if not new and not more:
            return []
        for seq in more:
            if seq not in self.running or seq.kv_len >= len(seq.tokens):
                raise UnknownCall(seq.call_id, "not a call with prefill left")
        for r in new:
            self.admission.validate(self.models.spec(r.model), self.running, r)
        models = {r.model for r in new}
        if len(models) > 1:
            raise ModelNotActive(sorted(models)[1], self.active_model)
        if new and new[0].model != self.active_model:
            if self.running:
                raise ModelNotActive(new[0].model, self.active_model)
            self.switch_to(new[0].model)
        dev = self.dev
        self._poll()
        admitted: list[Sequence] = []
        try:
            for r in new:
                admitted.append(self.admission.admit(dev, self.running, r, t0))
        except BaseException:
            for s in admitted:
                self.admission.release(dev, self.running, s)
            raise
        self.running.update(admitted)
        seqs = list(more) + admitted
        before = sum(s.kv_len for s in seqs)
        try:
            t1 = time.perf_counter()
            last = self.forward.run_prefill(dev, self.running, seqs, chunk, pass_tokens, self.should_yield)
            now = time.perf_counter()
            done = [s for s in seqs if s in last]
            if self.on_logits is not None and done:
                self.on_logits([s.call_id for s in done], torch.stack([last[s] for s in done]))
            self.rates.measured("prefill", sum(s.kv_len for s in seqs) - before, now - t1)
            out = []
            for s in seqs:
                s.prefill_s += now - t1
            for s in done:
                out.append(s.take(last[s], now))
        except BaseException:  # nothing of a failed batch stays running or holds pages
            for s in seqs:
                self.admission.release(dev, self.running, s)
            raise
        self._pump()
        return out

    def decode(self, seqs: list[Sequence]) -> list[StepToken]:
        """One batched decode step for each listed running, unfinished call."""
        seqs = [self.admission.decodable(self.running, s) for s in seqs]
        if not seqs:
            return []
        self._poll()
        # A call past its reserved pages grows into unreserved ones. With none left it waits
        # (no token this step: it is not in the result) while the others decode and free
        # pages as they finish; when no call of the step can go on, the latest admitted ends
        # with what it has ("length", as at the context limit) so the rest can. Never a
        # failed step.
        stalled = [s for s in seqs
                   if self.admission.needs_page(s) and not self.admission.grow_into(self.dev, self.running, s)]
        ended = []
        if stalled and len(stalled) == len(seqs):
            latest = max(stalled, key=lambda s: s.t_start)
            ended.append(latest.end_for_kv())
            stalled.remove(latest)
        if ended or stalled:
            seqs = [s for s in seqs if not s.finished and s not in stalled]
            if not seqs:
                return ended
        t0 = time.perf_counter()
        logits = self.forward.forward_batch(self.dev, self.running, [(s, s.kv_len, 1) for s in seqs])
        if self.on_logits is not None:
            self.on_logits([s.call_id for s in seqs], logits)
        now = time.perf_counter()
        out = ended + [s.take(logits[i], now) for i, s in enumerate(seqs)]
        for s in seqs:
            s.decode_s += now - t0
        self.rates.measured("decode", len(seqs), now - t0)
        self._pump()
        return out

    def finish(self, seq: Sequence) -> Sequence:
        """Release the call's running state; keep its KV as the session's device entry and
        checkpoint its full pages to HKVR. An unfinished call is ended with 'abort'."""
        if seq not in self.running:
            raise UnknownCall(seq.call_id)
        self.running.discard(seq)
        dev, ps = self.dev, self.page_size
        committed = seq.tokens[: seq.kv_len]
        pages = seq.pages[: math.ceil(seq.kv_len / ps)]
        for extra in seq.pages[len(pages):]:
            dev.pool.unuse(extra)
        hashes = block_hashes(committed, ps, scope=seq.kv_scope)
        for h, page in zip(hashes, pages):
            dev.index.insert(h, page)
        dev.sessions.put(DeviceKvSession(seq.session_id, dev.name, committed, list(pages)))
        if self.hkvr is not None and hashes:
            self._checkpoint(dev, seq.session_id, committed, pages[: len(hashes)], hashes)
        for page in pages:
            dev.pool.unuse(page)
        return seq.released()

    # -- state for telemetry (engine_report.py) ----------------------------------------------

    def kv_state(self, session_id: str, model: str) -> str:
        return report.kv_state(self.dev, self.hkvr, self.models, session_id, model)

    def device_prefix(self, session_id: str, model: str, prompt_ids: list[int]) -> int:
        return report.device_prefix(self.dev, session_id, model, prompt_ids)

    def session_states(self) -> list[tuple[str, str, str, int]]:
        return report.session_states(self.dev, self.hkvr, self.page_size)

    def device_tokens(self) -> dict[tuple[str, str], list[int]]:
        return report.device_tokens(self.dev)

    def stats(self) -> EngineStats:
        return report.stats(self.dev, self.running, self.models, self.bump, self.hkvr, self.staging, self.rates,
                            self.switcher.records)

    def close(self) -> None:
        if self.hkvr is not None:
            self.hkvr.close()
        if self.staging is not None:
            self.staging.close()

    # -- KV migration (issue 40): the page server's and the puller's side ------------------

    def kv_bytes_per_token(self, model: str) -> int:
        return self.page_bytes(model) // self.page_size

    def page_hashes(self, model: str, ids: list[int], scope: str) -> list[int]:
        return block_hashes(ids, self.page_size, scope=scope)

    def kv_layout(self, model: str) -> LayoutDescriptor:
        """How one rank's slab of one of `model`'s KV pages is laid out here."""
        spec, dt = self.models.spec(model), self.models.dtypes[model].dtype
        return LayoutDescriptor(model=model, rank=0, prefix_hash=0, committed_tokens=0, page_size=self.page_size,
                                dtype=str(dt).removeprefix("torch."),
                                attention="gqa" if spec.kv_heads < spec.heads else "mha",
                                shape=(spec.layers, 2, self.page_size, spec.kv_heads // self.tp_ranks, spec.head_dim),
                                itemsize=dt.itemsize)

    def export_pages(self, model: str, session_id: str, hashes: list[int], limit: int) -> list:
        """The session's own host pages of the leading `hashes` (at most `limit`), copied out."""
        if self.hkvr is None or model not in self.specs:
            return []
        self.hkvr.drain(model)  # checkpoints still copying publish first
        return self.hkvr.export_pages(model, session_id, hashes, limit)

    def session_hashes(self, model: str, session_id: str) -> list[int]:
        """The session's own host prefix, by hash (a drain's push lists it, then pulls it)."""
        if self.hkvr is None or model not in self.specs:
            return []
        return self.hkvr.session_hashes(model, session_id)

    def import_pages(self, model: str, session_id: str, hashes: list[int], slabs: list[list[bytes]],
                     dtype: str, shape: tuple[int, ...], ranks: int) -> int:
        """Store pulled pages as the session's host prefix; the tokens now restorable (0 when
        the holder's layout is not this engine's: the call recomputes)."""
        if self.hkvr is None or model not in self.specs or not hashes:
            return 0
        template = self.kv_layout(model)
        if (dtype, tuple(shape), ranks) != (template.dtype, template.shape, self.tp_ranks):
            return 0
        return self.hkvr.import_pages(model, session_id, hashes, slabs, template)

    # -- HKVR and staging plumbing ---------------------------------------------------------

    def _checkpoint(self, dev: DeviceModel, session_id: str, committed: list[int], pages: list[int],
                    hashes: list[int]) -> None:
        spec, ps = dev.spec, self.page_size
        reports = [RankReport(r, len(committed), tuple(hashes)) for r in range(self.tp_ranks)]
        if self.rank_fault is not None:
            reports = [self.rank_fault(r) for r in reports]
        template = LayoutDescriptor(
            model=dev.name, rank=0, prefix_hash=0, committed_tokens=0, page_size=ps, dtype=str(dev.kv.dtype).removeprefix("torch."),
            attention="gqa" if spec.kv_heads < spec.heads else "mha",
            shape=(spec.layers, 2, ps, spec.kv_heads // self.tp_ranks, spec.head_dim), itemsize=dev.kv.element_size(),
        )
        for p in pages:
            dev.pool.use(p)  # transfer pin: the source page outlives any eviction until copied
        pool = dev.pool

        def unpin() -> None:
            for p in pages:
                pool.unuse(p)

        self.hkvr.save(dev.name, session_id, dev.kv, pages, reports, template, unpin)

    def _poll(self) -> None:
        if self.hkvr is not None:
            self.hkvr.poll()

    def _pump(self) -> None:
        if self.staging is None or self.dev is None:
            return
        pb, base, pool = self.page_bytes(self.dev.name), self.bump.kv_base, self.dev.pool

        def slot_is_free(lo: int, hi: int) -> bool:
            first, last = (lo - base) // pb, min((hi - 1 - base) // pb, pool.num_pages - 1)
            return all(pool.cache_refs[p] == 0 and pool.use_refs[p] == 0 for p in range(max(first, 0), last + 1))

        self.staging.pump(slot_is_free)
