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

Functions of the engine (`eng`), called on its one worker thread; split out of engine.py.
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import TYPE_CHECKING

from talaria.services.instance_agent.engine.api import GenRequest
from talaria.services.instance_agent.engine.errors import (
    ContextTooLong, InvalidRequest, OutOfKvPages, UnknownCall,
)
from talaria.services.instance_agent.engine.sampling import make_generator
from talaria.services.instance_agent.engine.sequence import Sequence
from talaria.shared.limits import logprob_problem
from talaria.shared.model_text import text_for
from talaria.shared.tokenizer import block_hashes

if TYPE_CHECKING:
    from talaria.services.instance_agent.engine.engine import TorchEngine


def validate(eng: TorchEngine, r: GenRequest) -> None:
    spec = eng._spec(r.model)
    if r.call_id in eng.running:
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


def admit(eng: TorchEngine, req: GenRequest, t0: float) -> Sequence:
    """Match device pages, then host pages; reserve the rest. Only the suffix is computed."""
    spec, ps, prompt = eng.specs[req.model], eng.page_size, list(req.prompt_ids)
    max_match = len(prompt) - 1  # the last prompt token is always computed (its logits)
    hashes = block_hashes(prompt[:max_match], ps, scope=req.kv_scope)
    shared, cow_src, cached = match_device(eng, req.session_id, prompt, hashes, max_match)
    for p in shared:
        eng.pool.use(p)
    kv_tokens = min(len(prompt) + reserved_output(req) - 1, spec.context_length)
    total_pages = math.ceil(kv_tokens / ps)
    new_pages = total_pages - len(shared)
    available = eng.pool.num_unused() - sum(s.pages_to_come() for s in eng.running.values())
    if new_pages > available:
        for p in shared:
            eng.pool.unuse(p)
        raise OutOfKvPages(req.model, new_pages, max(0, available))
    pages, host_tokens = list(shared), 0
    if cow_src is not None:  # partial page: copy, never write into a shared page
        eng.pool.use(cow_src)  # so the allocator's eviction cannot hand it out meanwhile
        page = alloc_page(eng)
        eng.kv[page].copy_(eng.kv[cow_src])
        eng.pool.unuse(cow_src)
        pages.append(page)
    elif eng.hkvr is not None and len(shared) < len(hashes):
        t = time.perf_counter()
        restored = eng.hkvr.restore(req.model, hashes[len(shared):], eng.kv, partial(alloc_page, eng))
        pages += restored
        host_tokens = len(restored) * ps
        cached += host_tokens
        if restored:
            eng._rate("restore", host_tokens, time.perf_counter() - t)
    eng.sessions.drop(req.session_id)  # its pages are now held by this call
    gen = make_generator(req.seed, eng.device) if req.temperature > 0 else None
    return Sequence(req, spec.context_length, prompt, pages, cached, host_tokens, total_pages, t0, gen,
                    text=text_for(spec))


def reserved_output(req: GenRequest) -> int:
    """Output tokens a call's pages are reserved for: the router's estimate, never above
    max_tokens; max_tokens when the router sent none."""
    k = req.kv_output_tokens
    return min(req.max_tokens, k) if k > 0 else req.max_tokens


def next_page(eng: TorchEngine, seq: Sequence) -> int:
    """A page for `seq`'s next tokens: within its reservation, or grown past it."""
    if len(seq.pages) < seq.total_pages:
        return alloc_page(eng)
    page = grow_page(eng, seq)
    if page is None:
        raise OutOfKvPages(eng.active_model or "", 1, 0)
    return page


def grow_page(eng: TorchEngine, seq: Sequence) -> int | None:
    """One page past `seq`'s reservation, taken only where no other running call reserved
    it (free pages, then idle prefixes and sessions, evicted by alloc_page); None if none."""
    others = sum(s.pages_to_come() for s in eng.running.values() if s is not seq)
    if eng.pool.num_unused() - others < 1:
        return None
    page = alloc_page(eng)
    seq.total_pages += 1
    return page


def grow_into(eng: TorchEngine, seq: Sequence) -> bool:
    """Give `seq` one page past its reservation if one is unreserved; whether it got it."""
    page = grow_page(eng, seq)
    if page is not None:
        seq.pages.append(page)
    return page is not None


def needs_page(eng: TorchEngine, seq: Sequence) -> bool:
    """Whether `seq`'s next decode step writes past its pages and its reservation."""
    return seq.kv_len + 1 > len(seq.pages) * eng.page_size and len(seq.pages) >= seq.total_pages


def match_device(
    eng: TorchEngine, session_id: str, prompt: list[int], hashes: list[int], max_match: int
) -> tuple[list[int], int | None, int]:
    """(shared full pages, page to copy-on-write for a partial tail, cached tokens).
    The session's own entry is matched first; the prefix index may extend it."""
    ps = eng.page_size
    from_index = eng.index.match(hashes)
    entry = eng.sessions.get(session_id)
    if entry is not None and entry.model == eng.active_model:
        n = min(common_prefix(entry.tokens, prompt), max_match)
        if n > len(from_index) * ps:
            full = n // ps
            cow = entry.pages[full] if n % ps else None
            return list(entry.pages[:full]), cow, n
    return from_index, None, len(from_index) * ps


def release(eng: TorchEngine, seq: Sequence) -> None:
    eng.running.pop(seq.req.call_id, None)
    for p in seq.pages:
        eng.pool.unuse(p)


def running_seq(eng: TorchEngine, call_id: str) -> Sequence:
    seq = eng.running.get(call_id)
    if seq is None:
        raise UnknownCall(call_id)
    if seq.finished:
        raise UnknownCall(call_id, f"already finished ({seq.finish_reason}); call finish()")
    if seq.t_first is None and seq.kv_len < len(seq.tokens):
        raise UnknownCall(call_id, "still prefilling (chunked); it cannot decode yet")
    return seq


def alloc_page(eng: TorchEngine) -> int:
    """Lowest free page; evicts index-only prefixes, then LRU sessions, if it must."""
    while True:
        page = eng.pool.alloc()
        if page is not None:
            return page
        if eng.index.evict_one() or eng.sessions.evict_lru():
            continue
        if eng.staging is not None and eng.staging.planner.writing():
            eng.staging.wait_all()  # pages were only blocked by writes in flight
            continue
        raise OutOfKvPages(eng.active_model or "", 1, 0)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i, block = 0, 256
    while i < n and a[i:i + block] == b[i:i + block]:  # slices compare in C: a long session is cheap
        i += block
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)
