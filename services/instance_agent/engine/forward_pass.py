"""The batched forward pass over paged KV, and the (chunked) prefill built on it.

    run_prefill   forward passes of each call's unmatched suffix, at most `chunk` tokens each
    forward_batch one forward pass: rows of several calls at their positions, last-row logits

A part of `TorchEngine` (torch_engine.py), called on its one worker thread on the active
`DeviceModel` it is handed; pages it needs come from the admission part.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from talaria.services.instance_agent.engine.admission import KvAdmission
from talaria.services.instance_agent.engine.device_model import DeviceModel
from talaria.services.instance_agent.engine.model import SeqSlice, forward, paged_attention
from talaria.services.instance_agent.engine.sequence import Sequence


class ForwardPass:
    def __init__(self, page_size: int, device: torch.device, prefill_chunk: int, admission: KvAdmission) -> None:
        self.page_size, self.device, self.prefill_chunk, self.admission = page_size, device, prefill_chunk, admission

    def run_prefill(self, dev: DeviceModel, running: set[Sequence], seqs: list[Sequence], chunk: int = 0,
                    pass_tokens: int = 0,
                    should_yield: Callable[[], bool] | None = None) -> dict[Sequence, torch.Tensor]:
        """Batched prefill of each sequence's unmatched suffix, at most `chunk` tokens each
        (0: all), in forward passes of at most `pass_tokens` (0: `prefill_chunk`) tokens each;
        last-token logits of the sequences whose prompt is complete. With `chunk`, a true
        `should_yield()` between passes ends the chunk early."""
        left = {s: (chunk if chunk > 0 else len(s.tokens)) for s in seqs}  # tokens this chunk may still take
        per_pass = min(self.prefill_chunk, pass_tokens) if pass_tokens > 0 else self.prefill_chunk
        last: dict[Sequence, torch.Tensor] = {}
        while left:
            parts = [(s, s.kv_len, min(per_pass, len(s.tokens) - s.kv_len, n)) for s, n in left.items()]
            logits = self.forward_batch(dev, running, parts)
            for i, (s, _, n) in enumerate(parts):
                left[s] -= n
                if s.kv_len == len(s.tokens):
                    last[s] = logits[i]
                    del left[s]
                elif left[s] <= 0:
                    del left[s]  # this chunk is done; the call continues in a later one
            if chunk > 0 and left and should_yield is not None and should_yield():
                break  # new work arrived: end the chunk at this forward pass
        return last

    def forward_batch(self, dev: DeviceModel, running: set[Sequence],
                      parts: list[tuple[Sequence, int, int]]) -> torch.Tensor:
        """Compute tokens[p0:p0+n] of each part at positions p0.. ; logits of each part's last row.
        `running`: the engine's sequences (a call growing past its reservation takes only pages
        none of them reserved)."""
        ps, device = self.page_size, self.device
        ids, pos, wpages, woffs, slices, last = [], [], [], [], [], []
        row = 0
        for seq, p0, n in parts:
            while len(seq.pages) * ps < p0 + n:
                seq.pages.append(self.admission.next_page(dev, running, seq))
            ids += seq.tokens[p0 : p0 + n]
            pos += range(p0, p0 + n)
            wpages += [seq.pages[p // ps] for p in range(p0, p0 + n)]
            woffs += [p % ps for p in range(p0, p0 + n)]
            table = torch.tensor(seq.pages[: math.ceil((p0 + n) / ps)], dtype=torch.long, device=device)
            slices.append(SeqSlice(row, n, p0 + n, table))
            row += n
            last.append(row - 1)

        def t(x):
            return torch.tensor(x, dtype=torch.long, device=device)
        attn = paged_attention(dev.kv, slices, t(wpages), t(woffs))
        with torch.inference_mode():
            logits = forward(dev.spec, dev.params, t(ids), t(pos), attn, dev.rope, t(last))
        for seq, p0, n in parts:
            seq.kv_len = p0 + n
        return logits
