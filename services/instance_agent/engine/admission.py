"""Admitting a call into the paged KV pool: validate it, match the prefix it can reuse
(the session's own device entry, then the prefix index, then host pages via HKVR), reserve
the pages it will need, and give them back when it leaves.

Reserved: prompt + the output the router expects (`kv_output_tokens`, a high quantile of
what the session and model produced; services/router/output_estimate.py), not prompt +
max_tokens, a cap most calls never use (a 32,000-token cap would hold a quarter of a 131K
pool per call). A call that outgrows its reservation grows page by page into pages nobody
reserved (`grow_page`: free ones, then idle prefixes and sessions, whose KV HKVR keeps on
host); when none is left it waits a step while the others decode and finish; only when no
call can go on does the latest admitted finish with what it generated, finish reason
"length" (TorchEngine.decode), as at the context limit: never a crash or a lost call.

A part of `TorchEngine` (torch_engine.py), called on its one worker thread: it works on the
active `DeviceModel` and the engine's running sequences, both handed in.
"""

from __future__ import annotations

import math
import time
from functools import partial

import torch

from talaria.services.instance_agent.engine.device_model import DeviceModel, Rates
from talaria.services.instance_agent.engine.engine_errors import (
    ContextTooLong, InvalidRequest, OutOfKvPages, UnknownCall,
)
from talaria.services.instance_agent.engine.sampling import make_generator
from talaria.services.instance_agent.engine.sequence import Sequence
from talaria.services.instance_agent.memory.hkvr import HostKvRegistry
from talaria.services.instance_agent.memory.staging import StagingExecutor
from talaria.shared.catalog import ModelSpec
from talaria.shared.limits import logprob_problem
from talaria.shared.model_text import text_for
from talaria.shared.tokenizer import block_hashes


class KvAdmission:
    def __init__(self, page_size: int, device: torch.device, hkvr: HostKvRegistry | None,
                 staging: StagingExecutor | None, rates: Rates) -> None:
        self.page_size, self.device, self.hkvr, self.staging, self.rates = page_size, device, hkvr, staging, rates

    @staticmethod
    def validate(spec: ModelSpec, running: set[Sequence], r: Sequence) -> None:
        if any(s.call_id == r.call_id for s in running):
            raise InvalidRequest(r.call_id, "call_id", "a call with this id is already running")
        if r.admitted:  # its engine state is spent: a copy of the request runs it again
            raise InvalidRequest(r.call_id, "call_id", "this sequence already ran")
        if not r.prompt_ids:
            raise InvalidRequest(r.call_id, "prompt_ids", "empty prompt")
        if any((not isinstance(t, int)) or t < 0 or t >= spec.vocab_size for t in r.prompt_ids):
            raise InvalidRequest(r.call_id, "prompt_ids", f"token ids must be ints in [0, {spec.vocab_size})")
        if len(r.prompt_ids) > spec.context_length:
            raise ContextTooLong(r.model, len(r.prompt_ids), spec.context_length)
        if r.max_tokens < 1:
            raise InvalidRequest(r.call_id, "max_tokens", "must be >= 1")
        if not r.params.temperature >= 0.0:
            raise InvalidRequest(r.call_id, "temperature", "must be >= 0")
        if not 0.0 < r.params.top_p <= 1.0:
            raise InvalidRequest(r.call_id, "top_p", "must be in (0, 1]")
        p = r.params
        problem = logprob_problem(p.logit_bias, p.logprobs, p.top_logprobs, r.max_tokens, spec.vocab_size)
        if problem is not None:
            raise InvalidRequest(r.call_id, *problem)

    def admit(self, dev: DeviceModel, running: set[Sequence], seq: Sequence, t0: float) -> Sequence:
        """Match device pages, then host pages; reserve the rest (`seq` is admitted only when
        all of it succeeded). Only the suffix is computed."""
        spec, ps, prompt = dev.spec, self.page_size, list(seq.prompt_ids)
        max_match = len(prompt) - 1  # the last prompt token is always computed (its logits)
        hashes = block_hashes(prompt[:max_match], ps, scope=seq.kv_scope)
        shared, cow_src, cached = self.match_device(dev, seq.session_id, prompt, hashes, max_match)
        for p in shared:
            dev.pool.use(p)
        kv_tokens = min(len(prompt) + reserved_output(seq) - 1, spec.context_length)
        total_pages = math.ceil(kv_tokens / ps)
        new_pages = total_pages - len(shared)
        available = dev.pool.num_unused() - sum(s.pages_to_come() for s in running)
        if new_pages > available:
            for p in shared:
                dev.pool.unuse(p)
            raise OutOfKvPages(seq.model, new_pages, max(0, available))
        pages, host_tokens = list(shared), 0
        if cow_src is not None:  # partial page: copy, never write into a shared page
            dev.pool.use(cow_src)  # so the allocator's eviction cannot hand it out meanwhile
            page = self.alloc_page(dev)
            dev.kv[page].copy_(dev.kv[cow_src])
            dev.pool.unuse(cow_src)
            pages.append(page)
        elif self.hkvr is not None and len(shared) < len(hashes):
            t = time.perf_counter()
            restored = self.hkvr.restore(seq.model, hashes[len(shared):], dev.kv, partial(self.alloc_page, dev))
            pages += restored
            host_tokens = len(restored) * ps
            cached += host_tokens
            if restored:
                self.rates.measured("restore", host_tokens, time.perf_counter() - t)
        dev.sessions.drop(seq.session_id)  # its pages are now held by this call
        gen = make_generator(seq.params.seed, self.device) if seq.params.temperature > 0 else None
        return seq.admit(spec.context_length, text_for(spec), t0, cached_tokens=cached,
                         host_restored_tokens=host_tokens, pages=pages, total_pages=total_pages, gen=gen)

    def next_page(self, dev: DeviceModel, running: set[Sequence], seq: Sequence) -> int:
        """A page for `seq`'s next tokens: within its reservation, or grown past it."""
        if len(seq.pages) < seq.total_pages:
            return self.alloc_page(dev)
        page = self.grow_page(dev, running, seq)
        if page is None:
            raise OutOfKvPages(dev.name, 1, 0)
        return page

    def grow_page(self, dev: DeviceModel, running: set[Sequence], seq: Sequence) -> int | None:
        """One page past `seq`'s reservation, taken only where no other running call reserved
        it (free pages, then idle prefixes and sessions, evicted by alloc_page); None if none."""
        others = sum(s.pages_to_come() for s in running if s is not seq)
        if dev.pool.num_unused() - others < 1:
            return None
        page = self.alloc_page(dev)
        seq.total_pages += 1
        return page

    def grow_into(self, dev: DeviceModel, running: set[Sequence], seq: Sequence) -> bool:
        """Give `seq` one page past its reservation if one is unreserved; whether it got it."""
        page = self.grow_page(dev, running, seq)
        if page is not None:
            seq.pages.append(page)
        return page is not None

    def needs_page(self, seq: Sequence) -> bool:
        """Whether `seq`'s next decode step writes past its pages and its reservation."""
        return seq.kv_len + 1 > len(seq.pages) * self.page_size and len(seq.pages) >= seq.total_pages

    def match_device(self, dev: DeviceModel, session_id: str, prompt: list[int], hashes: list[int],
                     max_match: int) -> tuple[list[int], int | None, int]:
        """(shared full pages, page to copy-on-write for a partial tail, cached tokens).
        The session's own entry is matched first; the prefix index may extend it."""
        ps = self.page_size
        from_index = dev.index.match(hashes)
        entry = dev.sessions.get(session_id)
        if entry is not None and entry.model == dev.name:
            n = min(common_prefix(entry.tokens, prompt), max_match)
            if n > len(from_index) * ps:
                full = n // ps
                cow = entry.pages[full] if n % ps else None
                return list(entry.pages[:full]), cow, n
        return from_index, None, len(from_index) * ps

    @staticmethod
    def release(dev: DeviceModel, running: set[Sequence], seq: Sequence) -> None:
        running.discard(seq)
        for p in seq.pages:
            dev.pool.unuse(p)

    @staticmethod
    def decodable(running: set[Sequence], seq: Sequence) -> Sequence:
        """`seq`, checked to be running with a first token and not finished."""
        if seq not in running:
            raise UnknownCall(seq.call_id)
        if seq.finished:
            raise UnknownCall(seq.call_id, f"already finished ({seq.finish_reason}); call finish()")
        if seq.t_first is None and seq.kv_len < len(seq.tokens):
            raise UnknownCall(seq.call_id, "still prefilling (chunked); it cannot decode yet")
        return seq

    def alloc_page(self, dev: DeviceModel) -> int:
        """Lowest free page; evicts index-only prefixes, then LRU sessions, if it must."""
        while True:
            page = dev.pool.alloc()
            if page is not None:
                return page
            if dev.index.evict_one() or dev.sessions.evict_lru():
                continue
            if self.staging is not None and self.staging.planner.writing():
                self.staging.wait_all()  # pages were only blocked by writes in flight
                continue
            raise OutOfKvPages(dev.name, 1, 0)


def reserved_output(seq: Sequence) -> int:
    """Output tokens a call's pages are reserved for: the router's estimate, never above
    max_tokens; max_tokens when the router sent none."""
    k = seq.kv_output_tokens
    return min(seq.max_tokens, k) if k > 0 else seq.max_tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i, block = 0, 256
    while i < n and a[i:i + block] == b[i:i + block]:  # slices compare in C: a long session is cheap
        i += block
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)
