"""The `sglang` engine (`TALARIA_ENGINE=sglang`): the agent's models on SGLang's offline
`sglang.Engine`, behind the engine contract (contract.py); the calls it makes: `SglangEngine`.
NEVER RUN: SGLang cannot run on this project's machines (its CPU backend needs a source build with
AMX, its PyPI kernels are CUDA-only, its wheels are too large for the lent GPU machine). What it
calls is checked against SGLang's own source by tests/unit/engine/test_sglang_source.py (the wheel
is downloaded without dependencies and parsed, never imported), so it fails when either side
drifts; whether it serves correctly is unknown until it runs on a GPU.

SGLang's offline Engine is driven through its own event loop (`Engine.loop`) from the
thread that made it, as its synchronous methods are: this adapter does every call on the
agent's engine thread and runs the loop only while it waits for tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from talaria.services.instance_agent.engine.admission import common_prefix
from talaria.services.instance_agent.engine.contract import EngineStats
from talaria.services.instance_agent.engine.contract import Capabilities
from talaria.services.instance_agent.engine.dtypes import choose
from talaria.services.instance_agent.engine.engine_errors import EngineError
from talaria.services.instance_agent.engine.hf_export import hf_dir
from talaria.services.instance_agent.engine.sequence import Sequence, StepToken
from talaria.services.instance_agent.engine.streaming import StreamingEngine
from talaria.shared.catalog import BUILTIN_MODELS, Catalogue, ModelSpec
from talaria.shared.model_text import text_for

RELEASE_TAGS = ["kv_cache", "weights"]  # sglang.srt.constants GPU_MEMORY_TYPE_*
RESUME_TAGS = ["weights", "kv_cache"]
HICACHE_MODULE = "talaria.services.instance_agent.engine.sglang_hicache"
HICACHE_CLASS = "TalariaHiCacheStorage"


class SglangUnavailable(EngineError, RuntimeError):
    def __str__(self) -> str:
        return "TALARIA_ENGINE=sglang needs SGLang on a CUDA machine: pip install 'talaria[sglang]'"


def engine_kwargs(model_path: str, spec: ModelSpec, *, mem_fraction: float, hkvr: bool,
                  host_pages: int, dtype: str = "auto", device: str = "cuda") -> dict[str, Any]:
    """`sglang.Engine(**kwargs)`: every key is a ServerArgs field (checked against SGLang's source)."""
    kwargs = {
        "model_path": model_path,
        "skip_tokenizer_init": True,  # token ids in and out; text is decided here (sequence.py)
        "context_length": spec.context_length,
        "device": device,
        "dtype": choose(spec, device, dtype).name,  # as the other engines (dtypes.py), for its device
        "mem_fraction_static": mem_fraction,
        "enable_memory_saver": True,  # release/resume_memory_occupation
        "incremental_streaming_output": True,  # each streamed chunk carries only its new ids
        "random_seed": 0,
        "log_level": "error",
    }
    if hkvr:
        kwargs.update({
            "enable_hierarchical_cache": True,
            "hicache_write_policy": "write_through",
            "hicache_storage_backend": "dynamic",
            "hicache_storage_backend_extra_config": json.dumps({
                "backend_name": "talaria-hkvr", "module_path": HICACHE_MODULE, "class_name": HICACHE_CLASS,
                "model": spec.name, "host_pages": host_pages}),
        })
    return kwargs


def sampling_params(r: Sequence, text, room: int) -> dict[str, Any]:
    """SGLang's sampling parameters (sglang.srt.sampling.sampling_params.SamplingParams fields)."""
    p = r.params
    params: dict[str, Any] = {
        "max_new_tokens": max(1, min(r.max_tokens, room)),
        "temperature": p.temperature,
        "top_p": p.top_p,
        "stop_token_ids": list(text.eos_ids),
        "ignore_eos": True,  # EOS is the model text side's (stop_token_ids), not the tokenizer's
    }
    if p.seed is not None:
        params["sampling_seed"] = p.seed
    if p.logit_bias:
        params["logit_bias"] = {str(k): float(v) for k, v in p.logit_bias.items()}
    return params


class SglangEngine(StreamingEngine):
    """SGLang's `sglang.Engine` behind the engine contract:

        prefill(seqs)  `Engine.async_generate(input_ids=..., sampling_params=..., stream=True,
                       rid=call_id, cache_salt=kv_scope, ...)` per call, its stream kept on the
                       call's `Sequence`; returns each first token
        decode(seqs)   the next token each call's stream delivered (incremental streaming output)
        finish(seq)    an unfinished call is aborted (`tokenizer_manager.abort_request(rid=...)`;
                       `sglang.Engine` has no abort of its own)
        switch_to      `memory` (default): one Engine per model, started with the memory saver;
                       the outgoing one `release_memory_occupation(tags=["kv_cache", "weights"])`,
                       the incoming one `resume_memory_occupation(tags=["weights", "kv_cache"])`.
                       `weights`: one Engine, `update_weights_from_disk(model_path=...)` to the
                       next model's directory (same architecture and shapes only) and
                       `flush_cache()`.
        host KV        SGLang's hierarchical cache with HKVR as its storage backend
                       (sglang_hicache.py, loaded by SGLang's `dynamic` backend factory), written
                       through, so a session's pages survive the KV release of a switch.
    """

    name = "SGLang"

    def __init__(self, data_dir: Path, models: list[str], *, catalogue: Catalogue = BUILTIN_MODELS,
                 device: str = "cuda", hkvr: bool = True, staging: bool = True, switch_mode: str | None = None,
                 host_kv_pages: int = 4096, dtype: str = "auto", **_torch_only: Any) -> None:
        self._serve(data_dir, models, catalogue, "sglang", SglangUnavailable)
        self.switch_mode = switch_mode or "memory"
        if self.switch_mode not in ("memory", "weights"):
            raise ValueError(f"TALARIA_SGLANG_SWITCH={self.switch_mode!r}: 'memory' or 'weights'")
        self.hkvr, self.host_kv_pages, self.dtype, self.device = hkvr, host_kv_pages, dtype, device
        self.capabilities = Capabilities(switch_with_calls_running=False, host_kv=hkvr, d2d_staging=False,
                                         chunked_prefill=True)
        self.sessions: dict[tuple[str, str], list[int]] = {}
        self._engines: dict[str, Any] = {}
        self.ensure_weights()
        share = 0.85 if self.switch_mode == "weights" else 0.85 / len(models)
        try:
            for m in (models[:1] if self.switch_mode == "weights" else models):
                self._engines[m] = self._start(m, share)
            self._active = models[0]
            for m in models[1:]:
                if self.switch_mode == "memory":
                    self._engines[m].release_memory_occupation(tags=RELEASE_TAGS)
        except BaseException:
            self.close()
            raise

    def ensure_weights(self) -> None:
        self.dirs = {m: hf_dir(self.data_dir, s) for m, s in self.specs.items()}

    def _start(self, model: str, share: float):
        import sglang

        return sglang.Engine(**engine_kwargs(str(self.dirs[model]), self.specs[model], mem_fraction=share,
                                             hkvr=self.hkvr, host_pages=self.host_kv_pages, dtype=self.dtype,
                                             device=self.device))

    def _engine(self, model: str):
        return self._engines[model if self.switch_mode == "memory" else next(iter(self._engines))]

    def _leave(self, model: str) -> None:
        if self.switch_mode == "memory":
            self._engines[model].release_memory_occupation(tags=RELEASE_TAGS)
        self.sessions = {k: v for k, v in self.sessions.items() if k[1] != model}

    def _enter(self, model: str) -> None:
        if self.switch_mode == "memory":
            self._engines[model].resume_memory_occupation(tags=RESUME_TAGS)
        else:
            engine = self._engine(model)
            engine.update_weights_from_disk(model_path=str(self.dirs[model]))
            engine.flush_cache()  # the previous model's KV means nothing to this one

    def _switch_path(self) -> str:
        return "host_only"

    def prefill(self, seqs: list[Sequence], chunk_tokens: int = 0, more: Iterable[Sequence] = (),
                pass_tokens: int = 0) -> list[StepToken]:
        self._admit(seqs, busy=lambda model: bool(self.running))
        t0 = time.perf_counter()
        for call in seqs:
            spec = self.specs[call.model]
            text = text_for(spec)
            call.admit_streamed(spec.context_length, text, t0)
            engine = self._engine(call.model)
            p = call.params
            call.stream = engine.loop.run_until_complete(engine.async_generate(
                input_ids=list(call.prompt_ids),
                sampling_params=sampling_params(call, text, spec.context_length - len(call.prompt_ids)),
                stream=True, rid=call.call_id, cache_salt=call.kv_scope or None, session_id=None,
                return_logprob=p.logprobs, top_logprobs_num=p.top_logprobs if p.logprobs else None))
            self.running.add(call)
        return [self._next(c, prefill=True) for c in seqs]

    def decode(self, seqs: list[Sequence]) -> list[StepToken]:
        return [self._next(c) for c in self._decoding(seqs)]

    def _fetch(self, call: Sequence) -> None:
        """Run SGLang's loop until the call's stream yields its next chunk."""
        try:
            out = self._engine(call.model).loop.run_until_complete(call.stream.__anext__())
        except StopAsyncIteration:
            call.engine_done = True
            return
        meta = out.get("meta_info", {})
        ids = list(out.get("output_ids", ()))
        if call.t_first is None and not call.pending:
            call.cached_tokens = int(meta.get("cached_tokens", 0) or 0)
        call.pending += list(zip(ids, _logprobs(meta, len(ids))))
        call.engine_done = call.engine_done or meta.get("finish_reason") is not None

    def _abort(self, call: Sequence, wait: bool = True) -> None:  # abort_request returns at once
        self._engine(call.model).tokenizer_manager.abort_request(rid=call.call_id)

    def finish(self, seq: Sequence) -> Sequence:
        call = self._end(seq)
        self.sessions[(call.session_id, call.model)] = call.tokens[:-1]
        return call

    def kv_state(self, session_id: str, model: str) -> str:
        return "device" if (session_id, model) in self.sessions else "none"

    def device_prefix(self, session_id: str, model: str, prompt_ids: list[int]) -> int:
        """Leading prompt tokens the session's radix-cache entry covers."""
        held = self.sessions.get((session_id, model))
        return 0 if held is None else common_prefix(held, prompt_ids)

    def device_tokens(self) -> dict[tuple[str, str], list[int]]:
        return dict(self.sessions)

    def session_states(self) -> list[tuple[str, str, str, int]]:
        return [(s, m, "device", len(t)) for (s, m), t in self.sessions.items()]

    def stats(self) -> EngineStats:
        return EngineStats(active_model=self._active, kv_capacity_tokens=0, kv_used_tokens=0, prefill_tok_s=0.0,
                           decode_tok_s=0.0, restore_tok_s=0.0,
                           last_switch_s=self.switches[-1].total_s if self.switches else 0.0, hbm_bytes=0,
                           hbm_used_bytes=0, staging_free_bytes=0, running_calls=len(self.running))

    def close(self) -> None:
        for engine in self._engines.values():
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - closing: the others still get shut down
                pass
        self._engines.clear()


def _logprobs(meta: dict, n: int) -> list[dict | None]:
    """SGLang's per-token (logprob, id, text) tuples and top lists as {id: logprob} maps."""
    own = meta.get("output_token_logprobs") or []
    top = meta.get("output_top_logprobs") or []
    if not own:
        return [None] * n
    out = []
    for i, (lp, tok, *_rest) in enumerate(own[-n:]):
        d = {tok: lp}
        for t_lp, t_id, *_ in (top[-n:][i] if i < len(top[-n:]) and top[-n:][i] else []):
            d.setdefault(t_id, t_lp)
        out.append(d)
    return out
