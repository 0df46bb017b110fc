"""Hugging Face checkpoints made here, never downloaded: transformers builds each architecture
with random weights from a config shaped like the real one (its fields and ratios, smaller
sizes), a byte-level BPE tokenizer is trained locally with `tokenizers` on this repository's
docs, and the real chat template of the family (Qwen2.5-style Hermes tools; Llama 3.1 JSON
tools) is attached. transformers is a test extra; tests that need it skip without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TEMPLATES = Path(__file__).parent / "hf_templates"
VOCAB = 600

# name -> (special tokens, eos, bos, template)
FAMILIES = {
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None, "qwen.jinja"),
    "qwen3_moe": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None, "qwen.jinja"),
    "llama": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
              "<|eot_id|>", "<|begin_of_text|>", "llama3.jinja"),
    "gpt2": (["<|endoftext|>"], "<|endoftext|>", None, None),
}


def corpus() -> list[str]:
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "design.md").read_text()
    return [line for line in text.splitlines() if line.strip()]


def train_tokenizer(family: str):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials, _, bos, _ = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    if family.startswith("qwen"):  # as in Qwen's tokenizer: added tokens, not special (kept in text)
        tok.add_tokens([AddedToken("<tool_call>", normalized=False), AddedToken("</tool_call>", normalized=False)])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def config(family: str, vocab: int, eos: int, bos: int | None, head_dim: int | None = None):
    """`head_dim` overrides the family's (vLLM's CPU attention takes head sizes 32, 64, ...,
    not 16: tests/unit/engine/test_vllm_engine.py uses a head-64 Qwen3)."""
    import transformers as tf

    common = dict(vocab_size=vocab, eos_token_id=eos, bos_token_id=bos, initializer_range=0.2)
    if family == "qwen3":  # Qwen3-0.6B's fields: tied embeddings, head_dim 128 over 16 heads, theta 1e6
        return tf.Qwen3Config(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=head_dim or 32, max_position_embeddings=2048,
                              rope_theta=1e6,
                              rms_norm_eps=1e-6, tie_word_embeddings=True, **common), tf.Qwen3ForCausalLM
    if family == "qwen3_moe":  # Qwen3-30B-A3B's fields: 128 experts top-8, normalised top-k
        return tf.Qwen3MoeConfig(hidden_size=64, intermediate_size=192, moe_intermediate_size=32,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 max_position_embeddings=2048, rope_theta=1e6, rms_norm_eps=1e-6,
                                 tie_word_embeddings=False, **common), tf.Qwen3MoeForCausalLM
    if family == "llama":  # Llama-3.2-1B's fields: theta 5e5, llama3 RoPE scaling, tied embeddings
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
        return tf.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                              rope_parameters=rope, tie_word_embeddings=True, **common), tf.LlamaForCausalLM
    return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **common), tf.GPT2LMHeadModel


TOOL_CALL_BODY = '\n{"name": "read_file", "arguments": {"path": "parser.py"}}\n'


def make_tool_caller(out: Path) -> Path:
    """A Qwen3 checkpoint whose greedy answer to any chat is forced to one tool call,
    `<tool_call>{"name": "read_file", ...}</tool_call>` then EOS: its layers add nothing
    (o_proj and down_proj are zero), so the next token depends on the current one only, and
    the LM head maps the prompt's last token -> <tool_call> -> body -> </tool_call> -> EOS."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken, Tokenizer

    make_checkpoint("qwen3", out, tie=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken(TOOL_CALL_BODY, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((out / "config.json").read_text())
    vocab = cfg["vocab_size"] = tok.get_vocab_size()
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    w = load_file(str(out / "model.safetensors"))
    hidden = w["model.embed_tokens.weight"].shape[1]
    gen = torch.Generator().manual_seed(1)
    w["model.embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    w["lm_head.weight"] = torch.randn(vocab, hidden, generator=gen) * 0.01
    w["model.norm.weight"] = torch.ones(hidden)
    for k in list(w):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = torch.zeros_like(w[k])
    ids = tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    chain = [ids[-1], *(tok.token_to_id(t) for t in ("<tool_call>", TOOL_CALL_BODY, "</tool_call>", "<|im_end|>"))]
    emb = w["model.embed_tokens.weight"]
    for a, b in zip(chain, chain[1:]):
        w["lm_head.weight"][b] = 20 * emb[a] / emb[a].norm()
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make_checkpoint(family: str, out: Path, tie: bool | None = None, head_dim: int | None = None,
                    dtype: str = "float32") -> Path:
    """Write config.json, model.safetensors, tokenizer files, chat template, generation_config.json.
    `dtype` "bfloat16" saves the weights (and config.json's dtype) in bf16, as hub checkpoints are."""
    tf = pytest.importorskip("transformers")
    import torch

    specials, eos_tok, bos_tok, template = FAMILIES[family]
    tok = train_tokenizer(family)
    eos, bos = tok.token_to_id(eos_tok), tok.token_to_id(bos_tok) if bos_tok else None
    cfg, cls = config(family, tok.get_vocab_size(), eos, bos, head_dim)
    if tie is not None:
        cfg.tie_word_embeddings = tie
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # norms start at ones; perturb them so their weights are really read
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_tok, bos_token=bos_tok)
    if template:
        fast.chat_template = (TEMPLATES / template).read_text()
    fast.save_pretrained(out)
    return out
