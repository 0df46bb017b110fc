"""A model's prefill timed at start: one pass of PROBE_TOKENS at no context, one as deep in
context as attention's work is PROBE_DEPTH times the linear layers' (by the architecture,
shared/attention_prior.py), and two at no context again (the first pass pays one-off costs,
and is left out; of two, a load spike rarely slows both). The agent folds them into its prefill curve (scheduler/prefill_curve.py) like chunks:
they give the linear rate without a step's fixed cost before any long prompt ran, which the
slope's prior multiplies, and a first point of the slope itself.

Run on the engine's worker thread when a model first becomes active, on free pages of its KV
pool (given back after: the probe's K/V rows are never indexed, so nobody reads them).
About 8 passes' work of PROBE_TOKENS at no context: ~100 ms for the built-ins on one core.
"""

from __future__ import annotations

import math
import time

import torch

from talaria.services.instance_agent.engine.device_model import DeviceModel
from talaria.services.instance_agent.engine.model import SeqSlice, forward, paged_attention
from talaria.shared.attention_prior import attention_ratio

PROBE_TOKENS = 256  # a forward pass big enough that its per-token work outweighs its fixed cost
# The deep pass's context: attention's work there is this many times the linear work, so the
# two passes' difference (what gives the slope) is most of the deep one's time, not its noise.
PROBE_DEPTH = 4.0


def probe_context(dev: DeviceModel, page_size: int) -> int:
    """The deep pass's context: PROBE_DEPTH / the attention ratio, within the model's context
    and the free pages of its pool (0: no room for a deep pass)."""
    want = math.ceil(PROBE_DEPTH / attention_ratio(dev.spec))
    room = dev.pool.num_free * page_size - PROBE_TOKENS
    return max(0, min(want, dev.spec.context_length - PROBE_TOKENS, room))


def probe(dev: DeviceModel, page_size: int, device: torch.device) -> list[tuple[int, int, float]]:
    """(tokens, context, seconds) of the probe's passes at no context and deep in it."""
    depth = probe_context(dev, page_size)
    pages: list[int] = []
    try:
        for _ in range(math.ceil((depth + PROBE_TOKENS) / page_size)):
            page = dev.pool.alloc()
            if page is None:
                break
            pages.append(page)
        depth = min(depth, len(pages) * page_size - PROBE_TOKENS)
        out = []
        for context in (0, depth, 0, 0) if depth > 0 else (0, 0, 0):
            out.append((PROBE_TOKENS, context, _pass(dev, pages, page_size, context, device)))
        return out[1:]  # the first pass at no context paid one-off costs: it warmed the rest
    finally:
        for page in pages:
            dev.pool.unuse(page)


def _pass(dev: DeviceModel, pages: list[int], ps: int, context: int, device: torch.device) -> float:
    """Seconds of one forward pass of PROBE_TOKENS at positions context.. over `pages`."""
    n = PROBE_TOKENS

    def t(x):
        return torch.tensor(x, dtype=torch.long, device=device)
    table = t(pages[: math.ceil((context + n) / ps)])
    attn = paged_attention(dev.kv, [SeqSlice(0, n, context + n, table)],
                           t([pages[p // ps] for p in range(context, context + n)]),
                           t([p % ps for p in range(context, context + n)]))
    ids = t([i % dev.spec.vocab_size for i in range(n)])  # any ids: the work does not depend on them
    start = time.perf_counter()
    with torch.inference_mode():
        forward(dev.spec, dev.params, ids, torch.arange(context, context + n, device=device), attn, dev.rope,
                t([n - 1]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
