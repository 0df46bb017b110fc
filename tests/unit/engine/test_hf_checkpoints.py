"""Hugging Face checkpoints in the torch engine match transformers: for each architecture,
logits within 1e-4 of transformers' forward, and 64 greedy tokens identical, both computed
from scratch and after the session's KV was restored from the host registry. A bf16
checkpoint loads as bf16 (where the CPU computes it natively; forced otherwise) and matches
transformers in bf16: logits within one bf16 step, greedy tokens equal up to a bf16 near-tie. The chat
template renders (tools, tool calls, tool results) and tokenises exactly as transformers does."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from talaria.services.instance_agent.engine import Sequence, TorchEngine  # noqa: E402
from talaria.services.instance_agent.engine.dtypes import native_bf16  # noqa: E402
from talaria.services.instance_agent.engine.model import reference_logits  # noqa: E402
from talaria.shared.catalog import BUILTIN_MODELS  # noqa: E402
from talaria.shared.hf_config import CheckpointError, load_spec  # noqa: E402
from talaria.shared.messages import ChatMessage, ToolCallMsg, ToolSpec  # noqa: E402
from talaria.shared.model_text import HfText, text_for  # noqa: E402
from tests.unit.engine.hf_checkpoints import make_checkpoint  # noqa: E402

FAMILIES = ["qwen3", "qwen3_moe", "llama", "gpt2"]
GREEDY = 64
TOOL = ToolSpec("read_file", "Read a file", {"type": "object", "properties": {"path": {"type": "string"}}})
CONVERSATION = [
    ChatMessage("system", "You are a careful coding agent."),
    ChatMessage("user", "Fix the failing test in parser.py"),
    ChatMessage("assistant", "", tool_calls=[ToolCallMsg("read_file", '{"path": "parser.py"}', "call_1")]),
    ChatMessage("tool", "def parse(s): return s.split(',')", tool_call_id="call_1"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: make_checkpoint(f, root / f) for f in FAMILIES}


def hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompt_ids(family: str, path) -> list[int]:
    text = text_for(load_spec(family, path))
    if family == "gpt2":
        return text.encode("Talaria routes each agent session to the instance holding its KV.", chat=False)
    return text.encode(text.render(CONVERSATION, [TOOL]), chat=True)


def hf_greedy(model, ids: list[int], n: int, eos: set[int]) -> list[int]:
    out, ids = [], list(ids)
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok in eos:
                break
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_and_tokenizer_match_transformers(family, checkpoints):
    import transformers

    if family == "gpt2":
        pytest.skip("GPT-2 has no chat template")
    path = checkpoints[family]
    ours = HfText(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "system", "content": CONVERSATION[0].content}, {"role": "user", "content": CONVERSATION[1].content},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call_1", "function": {
                "name": "read_file", "arguments": {"path": "parser.py"}}}]},
            {"role": "tool", "content": CONVERSATION[3].content, "tool_call_id": "call_1"}]
    tools = [{"type": "function", "function": {"name": TOOL.name, "description": TOOL.description,
                                               "parameters": TOOL.parameters}}]
    expected = theirs.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.render(CONVERSATION, [TOOL]) == expected
    assert ours.encode(expected, chat=True) == theirs(expected, add_special_tokens=False)["input_ids"]
    assert ours.encode("plain text", chat=False) == theirs("plain text")["input_ids"]
    assert ours.tool_format == ("hermes" if family.startswith("qwen") else "json")
    # A trailing assistant message is continued (Anthropic prefill), as continue_final_message does.
    prefill = [{"role": "user", "content": "Fix it"}, {"role": "assistant", "content": "Sure, first"}]
    expected = theirs.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert ours.render([ChatMessage("user", "Fix it"), ChatMessage("assistant", "Sure, first")]) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_match_transformers_with_and_without_kv_restore(family, checkpoints, data_dir):
    path = checkpoints[family]
    spec = load_spec(f"hf-{family}", path)
    ids = prompt_ids(family, path)
    model = hf_model(path)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]

    engine = TorchEngine(data_dir, [spec.name, "qwen3-tiny"], catalogue=BUILTIN_MODELS.with_(spec), kv_pages=128,
                         host_kv_pages=1024)
    try:
        params = engine.layouts[spec.name].views(engine.models.host_image(spec.name))
        ours = reference_logits(spec, params, ids)
        assert (ours - theirs).abs().max().item() < 1e-4

        eos = set(spec.eos_ids)
        first = engine.generate(Sequence("c1", "s1", spec.name, ids, 8))
        follow = ids + first.token_ids
        expected = hf_greedy(model, follow, GREEDY, eos)
        assert len(expected) == GREEDY or expected[-1] in eos

        fresh = engine.generate(Sequence("fresh", "s-fresh", spec.name, follow, GREEDY))
        assert fresh.token_ids == expected
        engine.switch_to("qwen3-tiny")  # the session's KV leaves the device; HKVR keeps it on the host
        assert engine.kv_state("s1", spec.name) == "host"
        restored = engine.generate(Sequence("c2", "s1", spec.name, follow, GREEDY))
        assert restored.kv_source == "host" and restored.cached_tokens >= 16
        assert restored.token_ids == expected
    finally:
        engine.close()


def bf16_step(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def assert_bf16_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Logits [positions, vocab] equal to bf16's resolution: at 97 % of the positions within two
    bf16 steps of the largest logit. Not at every one: where the CPU has no native bf16 (some CI
    hosts; .ci/run also forces it with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2), torch
    emulates it and the engine's and transformers' op sequences round differently; seen: one llama position of 492 at 1.1 steps, and a MoE router's near-tie
    picking another expert at 8 of 450 positions (a logit 1.6 off)."""
    step = bf16_step(theirs.abs().max().item())
    off = (ours - theirs).abs().max(dim=-1).values > 2 * step
    assert off.float().mean().item() <= 0.03, f"{int(off.sum())} of {len(off)} positions beyond two bf16 steps"


def router_tie(model, seq: list[int]) -> bool:
    """Whether a MoE model's router, at the last position of `seq`, ranks its k-th and (k+1)-th
    expert within two bf16 steps in some layer: a tie at bf16's resolution, where the engine's
    cached decode and transformers' full recompute may pick different experts (a logit moves by
    a whole expert's output, not by rounding). False for dense models."""
    k = getattr(model.config, "num_experts_per_tok", None)
    if not k:
        return False
    with torch.no_grad():
        layers = model(torch.tensor([seq]), output_router_logits=True).router_logits
    for logits in layers:
        ranked = logits.float().reshape(-1, logits.shape[-1])[-1].sort(descending=True).values
        if float(ranked[k - 1] - ranked[k]) <= 2 * bf16_step(float(ranked[k - 1])):
            return True
    return False


def assert_bf16_greedy(model, ids: list[int], ours: list[int], n: int, eos: set[int]) -> None:
    """Every token the engine chose is transformers' greedy choice on the engine's own prefix,
    to bf16's resolution: its logit within two bf16 steps of the top (assert_bf16_close's
    tolerance), or, for a MoE model, at a position where the router itself ties at bf16's
    resolution (router_tie; seen on a CPU without native bf16: token 46 of 64, a layer's
    top-2 gap 0.008, the logit 0.66 off). Teacher-forced, so a tie may go either way without
    ending the comparison: comparing two free-running sequences stopped at the first such tie,
    and a seeded qwen3_moe checkpoint ties exactly (gap 0.0) at its first token."""
    seq = list(ids)
    with torch.no_grad():
        for i, tok in enumerate(ours):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            top = float(logits.max())
            assert float(logits[tok]) >= top - 2 * bf16_step(top) or router_tie(model, seq), \
                f"token {i}: {tok} at {float(logits[tok])}, transformers' best {int(logits.argmax())} at {top}"
            seq.append(tok)
    assert len(ours) == n or ours[-1] in eos


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_checkpoint_runs_in_bf16_and_matches_transformers_in_bf16(family, tmp_path, data_dir):
    import transformers

    path = make_checkpoint(family, tmp_path / family, dtype="bfloat16")
    spec = load_spec(f"hf-bf16-{family}", path)
    assert spec.dtype == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = prompt_ids(family, path)
    # auto where this CPU computes bf16 natively (AVX512-BF16/AMX); forced elsewhere, so bf16 is tested anyway
    engine = TorchEngine(data_dir, [spec.name, "qwen3-tiny"], catalogue=BUILTIN_MODELS.with_(spec), kv_pages=128,
                         host_kv_pages=1024, dtype="auto" if native_bf16("cpu") else "bfloat16")
    try:
        assert engine.models.dtypes[spec.name].dtype == torch.bfloat16
        params = engine.layouts[spec.name].views(engine.models.host_image(spec.name))
        assert params["embed"].dtype == torch.bfloat16
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0].float()
        ours = reference_logits(spec, params, ids)
        assert_bf16_close(ours, theirs)

        fresh = engine.generate(Sequence("fresh", "s1", spec.name, ids, GREEDY))
        assert_bf16_greedy(model, ids, fresh.token_ids, GREEDY, set(spec.eos_ids))
        engine.switch_to("qwen3-tiny")  # bf16 KV pages through the host registry and back
        assert engine.kv_state("s1", spec.name) == "host"
        again = engine.generate(Sequence("again", "s1", spec.name, ids, GREEDY))
        assert again.kv_source == "host"
        if again.token_ids != fresh.token_ids:
            assert_bf16_greedy(model, ids, again.token_ids, GREEDY, set(spec.eos_ids))
    finally:
        engine.close()


def test_unknown_architectures_fail_naming_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="architectures"):
        load_spec("m", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}))
    with pytest.raises(CheckpointError, match="hidden_act"):
        load_spec("m", tmp_path)
    with pytest.raises(CheckpointError, match="config.json"):
        load_spec("m", tmp_path / "missing")
