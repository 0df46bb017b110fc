"""The built-in models' tokenizer: a byte-level BPE trained with `tokenizers` on a fixed corpus
shipped in the repo (shared/data/demo_bpe_corpus.txt: this project's docs and code and a tool
schema, the kind of text coding agents send), built the same way in every process on first use.

Ids keep the byte tokenizer's layout, so BOS/EOS and single bytes mean what they did: 0..255
are the bytes, 256 BOS, 257 EOS, 258-259 reserved, then the learned merges in order, then the
chat template's markers as whole tokens. About 3.4 bytes per token on code and prose, so a
coding agent's 60-100 KB first request is 20-30k tokens.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from talaria.shared.catalog import DEMO_VOCAB_SIZE
from talaria.shared.tokenizer import BOS, EOS

MERGES_VOCAB = 4096  # trainer target: 256 byte symbols + merges
SPECIALS = {"<|bos|>": BOS, "<|eos|>": EOS, "<|reserved0|>": 258, "<|reserved1|>": 259}
MARKERS = ["<|system|>", "<|developer|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>",
           "<tool_call>", "</tool_call>"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def corpus() -> str:
    return resources.files("talaria.shared").joinpath("data/demo_bpe_corpus.txt").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def demo_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=MERGES_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trained.train_from_iterator(corpus().splitlines(keepends=True), trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(trained.to_str())["model"]["merges"]]
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()} | SPECIALS
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, normalized=False) for s in SPECIALS])
    tok.add_tokens([AddedToken(m, normalized=False) for m in MARKERS])
    if tok.get_vocab_size() > DEMO_VOCAB_SIZE:
        raise RuntimeError(f"demo tokenizer has {tok.get_vocab_size()} ids, the models {DEMO_VOCAB_SIZE}")
    return tok
