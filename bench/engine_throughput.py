"""Prefill and decode throughput of the torch engine and vLLM side by side, on a real model's
shape (not a test).

    python bench/engine_throughput.py [--shape qwen3-0.6b] [--prompt 512] [--decode 32] [--batch 1 8]
        [--engines torch vllm] [--device cpu] [--dtype float32] [--compute auto] [--out results/vllm_engine.md]

A random-weight checkpoint with Qwen3-0.6B's config (28 layers, hidden 1024, 16 query / 8 KV
heads of 128, SwiGLU 3072, vocabulary 151,936, tied embeddings) is written once with
transformers (nothing is downloaded); both engines load the same directory. Per engine and
batch size: prefill tokens/s (a fresh prompt per call, timed to the first token) and decode
tokens/s (generated tokens after the first over the time from first to last). Both engines
compute in the type engine/dtypes.py chooses (`--compute auto`: a bf16 checkpoint in bf16 where
the hardware has native bf16), printed per row. Run with the
vLLM venv's python to include vLLM; an engine that cannot be built is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.run_record import publish  # noqa: E402

SHAPES = {  # the real models' config fields (their Hugging Face config.json)
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def checkpoint(root: Path, shape: str, dtype: str) -> Path:
    import torch
    import transformers

    from tests.unit.engine.hf_checkpoints import TEMPLATES, train_tokenizer

    out = root / f"{shape}-{dtype}"
    if (out / "config.json").exists():
        return out
    tok = train_tokenizer("qwen3")
    eos = tok.token_to_id("<|im_end|>")
    cfg = transformers.Qwen3Config(**SHAPES[shape], eos_token_id=eos, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.Qwen3ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = (TEMPLATES / "qwen.jinja").read_text()
    fast.save_pretrained(out)
    return out


def prompts(n: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    return [[(salt * 7919 + j * 104729 + i * 31) % min(vocab, 600) for i in range(length)] for j in range(n)]


def run_batch(engine, model: str, batch: list[list[int]], decode: int, tag: str) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) for one batch admitted together."""
    from talaria.services.instance_agent.engine import Sequence

    reqs = [Sequence(f"{tag}.{i}", f"{tag}.{i}", model, p, decode) for i, p in enumerate(batch)]
    t0 = time.perf_counter()
    steps = engine.prefill(reqs)
    t1 = time.perf_counter()
    live = [r for r in reqs if not r.finished]
    made = 0
    while live:
        made += len(engine.decode(live))
        live = [r for r in live if not r.finished]
    t2 = time.perf_counter()
    for r in reqs:
        engine.finish(r)
    return sum(map(len, batch)) / (t1 - t0), made / (t2 - t1) if made else 0.0


def build(name: str, data: Path, spec, device: str, tokens: int, batch: int, dtype: str):
    from talaria.services.instance_agent.engine.engine_registry import build_engine
    from talaria.shared.catalog import BUILTIN_MODELS

    catalogue = BUILTIN_MODELS.with_(spec)
    if name == "torch":
        return build_engine("torch", data, [spec.name], catalogue=catalogue, device=device, hkvr=False,
                            staging=False, kv_pages=(tokens // 16 + 2) * batch + 16, dtype=dtype)
    return build_engine("vllm", data, [spec.name], catalogue=catalogue, device=device, hkvr=False,
                        max_model_len=tokens + 16, dtype=dtype, kv_cache_bytes=2 << 30)


def compute_dtype(engine, model: str) -> str:
    """What the engine computes `model` in (both engines keep engine/dtypes.py's choice)."""
    choices = engine.models.dtypes if hasattr(engine, "models") else engine.dtypes
    return choices[model].name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=["torch", "vllm"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="the checkpoint's dtype")
    ap.add_argument("--compute", default="auto", help="TALARIA_DTYPE for both engines: auto | float32 | bfloat16")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="the torch engine's threads (vLLM's CPU worker uses one here); 0: torch's default")
    ap.add_argument("--data", default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from talaria.shared.hf_config import load_spec

    # vLLM's CPU worker computes on one OpenMP thread bound to a core (the other is its
    # scheduler's): the torch engine gets the same, so the two are compared per compute thread
    if args.device == "cpu":
        torch.set_num_threads(args.torch_threads or torch.get_num_threads())
    data = Path(args.data or tempfile.mkdtemp(prefix="throughput-"))
    t0 = time.perf_counter()
    path = checkpoint(data, args.shape, args.dtype)
    made_s = time.perf_counter() - t0
    spec = load_spec(args.shape, path)
    rows, notes = [], []
    for name in args.engines:
        t0 = time.perf_counter()
        try:
            engine = build(name, data, spec, args.device, args.prompt + args.decode, max(args.batch), args.compute)
        except Exception as exc:  # noqa: BLE001 - reported: the other engine still runs
            notes.append(f"{name}: not run ({type(exc).__name__}: {str(exc)[:200]})")
            continue
        start_s = time.perf_counter() - t0
        computed = compute_dtype(engine, spec.name)
        try:
            run_batch(engine, spec.name, prompts(1, 64, spec.vocab_size, 999), 4, f"{name}-warm")
            for b in args.batch:
                pre, dec = [], []
                for r in range(args.reps):
                    p, d = run_batch(engine, spec.name, prompts(b, args.prompt, spec.vocab_size, 10 * b + r),
                                     args.decode, f"{name}-{b}-{r}")
                    pre.append(p)
                    dec.append(d)
                rows.append((name, computed, b, statistics.median(pre), statistics.median(dec), start_s))
                print(f"{name} ({computed}) batch {b}: prefill {rows[-1][3]:.0f} tok/s, decode {rows[-1][4]:.1f} tok/s",
                      flush=True)
        finally:
            engine.close()
    lines = [f"{args.shape} shape, random weights ({args.dtype} checkpoint), device {args.device}, prompt "
             f"{args.prompt} tokens, {args.decode} generated per call, median of {args.reps}, torch engine on "
             f"{torch.get_num_threads()} thread(s); checkpoint "
             f"written in {made_s:.0f} s.", "",
             "| engine | computes in | batch | prefill tok/s | decode tok/s | engine start s |",
             "|---|---|---|---|---|---|"]
    for name, computed, b, pre, dec, start_s in rows:
        lines.append(f"| {name} | {computed} | {b} | {pre:.0f} | {dec:.1f} | {start_s:.0f} |")
    by = {(n, b): (p, d) for n, _, b, p, d, _ in rows}
    for b in args.batch:
        if ("torch", b) in by and ("vllm", b) in by:
            (tp, td), (vp, vd) = by[("torch", b)], by[("vllm", b)]
            lines.append(f"\nbatch {b}: vLLM / torch = {vp / tp:.2f}x prefill, {vd / td:.2f}x decode")
    lines += [f"\n{n}" for n in notes]
    text = "\n".join(lines) + "\n"
    publish(text, args.out, "Throughput")
    json.dump([dict(engine=n, dtype=c, batch=b, prefill_tok_s=p, decode_tok_s=d) for n, c, b, p, d, _ in rows],
              sys.stderr)


if __name__ == "__main__":
    main()
