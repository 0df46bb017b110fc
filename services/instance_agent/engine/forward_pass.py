"""The batched forward pass over paged KV, and the (chunked) prefill step built on it.

    prefill_step  validate + admit new calls, continue running ones, run_prefill, first tokens
    run_prefill   forward passes of each call's unmatched suffix, at most `chunk` tokens each
    forward_batch one forward pass: rows of several calls at their positions, last-row logits

Functions of the engine (`eng`), called on its one worker thread; split out of engine.py.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from talaria.services.instance_agent.engine import admission
from talaria.services.instance_agent.engine.api import GenRequest, StepToken
from talaria.services.instance_agent.engine.errors import ModelNotActive, UnknownCall
from talaria.services.instance_agent.engine.model import SeqSlice, forward, paged_attention
from talaria.services.instance_agent.engine.sequence import Sequence

if TYPE_CHECKING:
    from talaria.services.instance_agent.engine.engine import TorchEngine


def prefill_step(eng: TorchEngine, reqs: list[GenRequest], t0: float, chunk: int = 0,
                 more: tuple[str, ...] = (), pass_tokens: int = 0) -> list[StepToken]:
    """Admit `reqs` and prefill them with the running calls `more` that have prompt left;
    first tokens of the calls whose prompt is now complete (see TorchEngine.prefill)."""
    if not reqs and not more:
        return []
    cont = []
    for call_id in more:
        seq = eng.running.get(call_id)
        if seq is None or seq.kv_len >= len(seq.tokens):
            raise UnknownCall(call_id, "not a call with prefill left")
        cont.append(seq)
    for r in reqs:
        admission.validate(eng, r)
    models = {r.model for r in reqs}
    if len(models) > 1:
        raise ModelNotActive(sorted(models)[1], eng.active_model)
    if reqs and reqs[0].model != eng.active_model:
        if eng.running:
            raise ModelNotActive(reqs[0].model, eng.active_model)
        eng.switch_to(reqs[0].model)
    eng._poll()
    seqs: list[Sequence] = []
    try:
        for r in reqs:
            seqs.append(admission.admit(eng, r, t0))
    except Exception:
        for s in seqs:
            admission.release(eng, s)
        raise
    for s in seqs:
        eng.running[s.req.call_id] = s
    seqs = cont + seqs
    before = sum(s.kv_len for s in seqs)
    try:
        t1 = time.perf_counter()
        last = run_prefill(eng, seqs, chunk, pass_tokens)
        now = time.perf_counter()
        done = [s for s in seqs if s.req.call_id in last]
        if eng.on_logits is not None and done:
            eng.on_logits([s.req.call_id for s in done], torch.stack([last[s.req.call_id] for s in done]))
        eng._rate("prefill", sum(s.kv_len for s in seqs) - before, now - t1)
        out = []
        for s in seqs:
            s.prefill_s += now - t1
        for s in done:
            out.append(s.take(last[s.req.call_id], now))
    except Exception:  # nothing of a failed batch stays running or holds pages
        for s in seqs:
            admission.release(eng, s)
        raise
    eng._pump()
    return out


def run_prefill(eng: TorchEngine, seqs: list[Sequence], chunk: int = 0, pass_tokens: int = 0) -> dict[str, torch.Tensor]:
    """Batched prefill of each sequence's unmatched suffix, at most `chunk` tokens each
    (0: all), in forward passes of at most `pass_tokens` (0: `prefill_chunk`) tokens each;
    last-token logits of the sequences whose prompt is complete."""
    todo = {s.req.call_id: s for s in seqs}
    left = {i: (chunk if chunk > 0 else len(s.tokens)) for i, s in todo.items()}
    per_pass = min(eng.prefill_chunk, pass_tokens) if pass_tokens > 0 else eng.prefill_chunk
    last: dict[str, torch.Tensor] = {}
    while todo:
        parts = [(s, s.kv_len, min(per_pass, len(s.tokens) - s.kv_len, left[i]))
                 for i, s in todo.items()]
        logits = forward_batch(eng, parts)
        for i, (s, _, n) in enumerate(parts):
            cid = s.req.call_id
            left[cid] -= n
            if s.kv_len == len(s.tokens):
                last[cid] = logits[i]
                del todo[cid]
            elif left[cid] <= 0:
                del todo[cid]  # this chunk is done; the call continues in a later one
        if chunk > 0 and todo and eng.should_yield is not None and eng.should_yield():
            break  # new work arrived: end the chunk at this forward pass
    return last


def forward_batch(eng: TorchEngine, parts: list[tuple[Sequence, int, int]]) -> torch.Tensor:
    """Compute tokens[p0:p0+n] of each part at positions p0.. ; logits of each part's last row."""
    ps, dev = eng.page_size, eng.device
    ids, pos, wpages, woffs, slices, last = [], [], [], [], [], []
    row = 0
    for seq, p0, n in parts:
        while len(seq.pages) * ps < p0 + n:
            seq.pages.append(admission.next_page(eng, seq))
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
    attn = paged_attention(eng.kv, slices, t(wpages), t(woffs))
    spec = eng.specs[eng.active_model]
    with torch.inference_mode():
        logits = forward(spec, eng.params, t(ids), t(pos), attn, eng.rope, t(last))
    for seq, p0, n in parts:
        seq.kv_len = p0 + n
    return logits
