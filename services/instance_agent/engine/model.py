"""Functional forward passes for the three catalogue architectures, over paged KV.

Parameters are a dict of tensors (views into the bump buffer), so a model switch
rebinds views instead of rebuilding modules. Attention is pluggable: the engine's paged
attention writes K/V into pool pages and attends over the gathered pages; the reference
attention is plain causal attention over one contiguous sequence (tests compare them).

    dense : RMSNorm, RoPE, GQA, per-head q/k RMSNorm, SwiGLU        (Qwen3)
    moe   : as dense, MLP = top-k routed SwiGLU experts              (Qwen3-MoE)
    llama : as dense without q/k norm; Llama 3 RoPE scaling          (Llama 3, Mistral)
    gpt2  : LayerNorm, learned absolute positions, MHA with biases, GELU
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import math

import torch
import torch.nn.functional as F

from talaria.shared.catalog import ModelSpec

RMS_EPS = 1e-6
LN_EPS = 1e-5

# attn(layer, q[T, nh, hd], k[T, kvh, hd], v[T, kvh, hd]) -> [T, nh*hd]
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a batched forward: rows [q_start, q_start+q_len) of the batch,
    attending to KV positions [0, ctx_len) stored in `pages` (page table, in order)."""

    q_start: int
    q_len: int
    ctx_len: int
    pages: torch.Tensor  # long, on device


def rope_tables(spec: ModelSpec, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [context_length, head_dim/2] (float32)."""
    hd = spec.head_dim
    if spec.path is not None:
        return _hf_rope_tables(spec, device)
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.arange(spec.context_length, dtype=torch.float64)[:, None] * inv[None, :]
    return freqs.cos().float().to(device), freqs.sin().float().to(device)


def _hf_rope_tables(spec: ModelSpec, device) -> tuple[torch.Tensor, torch.Tensor]:
    """As transformers computes them (float32 inverse frequencies, Llama 3 scaling), so a
    checkpoint's logits match its reference implementation."""
    hd = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if spec.rope_scaling:
        factor, low, high, old_len = spec.rope_scaling
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv = torch.where(medium, smoothed, scaled)
    freqs = torch.arange(spec.context_length, dtype=torch.float32)[:, None] * inv[None, :]
    return freqs.cos().to(device), freqs.sin().to(device)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = RMS_EPS) -> torch.Tensor:
    """In float32 and back, as transformers does for a bf16 model (the same float32 result)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate) * (x @ up)) @ down


def _moe(x: torch.Tensor, p: dict[str, torch.Tensor], pre: str, top_k: int, renorm: bool = True) -> torch.Tensor:
    probs = torch.softmax(x @ p[pre + "router"], dim=-1, dtype=torch.float32)
    top_w, top_i = probs.topk(top_k, dim=-1)
    if renorm:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    top_w = top_w.to(x.dtype)
    out = torch.zeros_like(x)
    gate, up, down = p[pre + "experts.gate"], p[pre + "experts.up"], p[pre + "experts.down"]
    for e in range(gate.shape[0]):
        rows, which = (top_i == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        y = _swiglu(x[rows], gate[e], up[e], down[e]) * top_w[rows, which][:, None]
        out.index_add_(0, rows, y)
    return out


def forward(
    spec: ModelSpec,
    p: dict[str, torch.Tensor],
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    attn: AttnFn,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    logit_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits (float32) for `logit_rows` of the flat batch (all rows when None). The
    parameters' dtype is the compute type; a bf16 model follows transformers' mixed
    precision (norms and router softmax in float32, RoPE tables cast to bf16)."""
    if spec.arch == "gpt2":
        x = _gpt2_body(spec, p, token_ids, positions, attn)
    else:
        x = _qwen_body(spec, p, token_ids, positions, attn, rope)
    if logit_rows is not None:
        x = x[logit_rows]
    if spec.arch == "gpt2":
        x = F.layer_norm(x, (spec.hidden,), p["final_norm"], p["final_norm.b"], spec.norm_eps or LN_EPS)
    else:
        x = _rms(x, p["final_norm"], spec.norm_eps or RMS_EPS)
    return (x @ p["lm_head"]).float()


def _qwen_body(spec, p, token_ids, positions, attn, rope) -> torch.Tensor:
    nh, kvh, hd, eps = spec.heads, spec.kv_heads, spec.head_dim, spec.norm_eps or RMS_EPS
    x = p["embed"][token_ids]
    cos, sin = rope[0][positions].to(x.dtype), rope[1][positions].to(x.dtype)
    t = x.shape[0]
    for layer in range(spec.layers):
        pre = f"layers.{layer}."
        h = _rms(x, p[pre + "attn_norm"], eps)
        q = (h @ p[pre + "q"]).view(t, nh, hd)
        k = (h @ p[pre + "k"]).view(t, kvh, hd)
        if spec.arch != "llama":  # Qwen3's per-head q/k norm
            q, k = _rms(q, p[pre + "q_norm"], eps), _rms(k, p[pre + "k_norm"], eps)
        v = (h @ p[pre + "v"]).view(t, kvh, hd)
        x = x + attn(layer, _rope(q, cos, sin), _rope(k, cos, sin), v) @ p[pre + "o"]
        h = _rms(x, p[pre + "mlp_norm"], eps)
        if spec.arch == "moe":
            x = x + _moe(h, p, pre, spec.experts_per_token, spec.norm_topk_prob)
        else:
            x = x + _swiglu(h, p[pre + "gate"], p[pre + "up"], p[pre + "down"])
    return x


def _gpt2_body(spec, p, token_ids, positions, attn) -> torch.Tensor:
    nh, kvh, hd, hid = spec.heads, spec.kv_heads, spec.head_dim, spec.hidden
    eps = spec.norm_eps or LN_EPS
    x = p["embed"][token_ids] + p["wpe"][positions]
    t = x.shape[0]
    for layer in range(spec.layers):
        pre = f"layers.{layer}."
        h = F.layer_norm(x, (hid,), p[pre + "ln1.w"], p[pre + "ln1.b"], eps)
        qkv = torch.addmm(p[pre + "qkv.b"], h, p[pre + "qkv.w"])  # one rounding, as transformers' Conv1D
        q, k, v = qkv.split([nh * hd, kvh * hd, kvh * hd], dim=-1)
        o = attn(layer, q.view(t, nh, hd), k.view(t, kvh, hd), v.view(t, kvh, hd))
        x = x + torch.addmm(p[pre + "o.b"], o, p[pre + "o.w"])
        h = F.layer_norm(x, (hid,), p[pre + "ln2.w"], p[pre + "ln2.b"], eps)
        x = x + torch.addmm(p[pre + "proj.b"], _gelu_new(torch.addmm(p[pre + "fc.b"], h, p[pre + "fc.w"])),
                            p[pre + "proj.w"])
    return x


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU written out as transformers' `gelu_new` computes it: each operation
    rounds in the model's dtype (F.gelu rounds once, which differs in bf16)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [L, nh, hd], k/v [S, kvh, hd] -> [L, nh*hd]; GQA by head grouping."""
    # 4-D inputs: 3-D ones fall off the fused CPU kernel onto a path several times slower
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def causal_mask(q_len: int, ctx_len: int, device) -> torch.Tensor | None:
    """Bool mask for the last q_len positions of a ctx_len sequence (None for one query)."""
    if q_len == 1:
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    return torch.arange(ctx_len, device=device)[None, :] <= q_pos[:, None]


def paged_attention(
    kv: torch.Tensor, seqs: list[SeqSlice], write_pages: torch.Tensor, write_offsets: torch.Tensor
) -> AttnFn:
    """Attention over a page-first KV pool kv[page, layer, k|v, slot, kvh, hd].

    Writes this batch's K/V rows into their slots first, then each sequence attends over
    its gathered pages. Correct and simple; a fused kernel would replace the gather.
    """

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv[write_pages, layer, 0, write_offsets] = k
        kv[write_pages, layer, 1, write_offsets] = v
        outs = []
        for s in seqs:
            kk = kv[s.pages, layer, 0].reshape(-1, *k.shape[1:])[: s.ctx_len]
            vv = kv[s.pages, layer, 1].reshape(-1, *v.shape[1:])[: s.ctx_len]
            qq = q[s.q_start : s.q_start + s.q_len]
            outs.append(_sdpa(qq, kk, vv, causal_mask(s.q_len, s.ctx_len, q.device)))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    return attn


def reference_logits(spec: ModelSpec, p: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Unpaged, unbatched full forward: logits for every position [T, V]. For tests."""
    device = p["embed"].device
    token_ids = torch.tensor(ids, dtype=torch.long, device=device)
    positions = torch.arange(len(ids), device=device)

    def attn(layer, q, k, v):
        return _sdpa(q, k, v, causal_mask(len(ids), len(ids), device))

    rope = None if spec.arch == "gpt2" else rope_tables(spec, device)
    return forward(spec, p, token_ids, positions, attn, rope)
