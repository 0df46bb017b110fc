"""What a model is held and computed in (engine/dtypes.py): a bf16 checkpoint runs in bf16 where
the hardware computes it natively and in float32 (with the reason) where it does not;
TALARIA_DTYPE overrides; the torch engine's weights and KV pages then are that type."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from talaria.services.instance_agent.engine import Sequence, TorchEngine
from talaria.services.instance_agent.engine.dtypes import BadDtype, choose
from talaria.shared.catalog import BUILTIN_MODELS
from talaria.shared.hf_config import _dtype
from talaria.shared.settings import Settings

BF16 = replace(BUILTIN_MODELS["qwen3-tiny"], dtype="bfloat16")
BUILTIN = BUILTIN_MODELS["qwen3-tiny"]


def test_a_bf16_checkpoint_runs_in_bf16_only_where_the_hardware_has_it():
    assert choose(BF16, "cpu", bf16_native=True).dtype == torch.bfloat16
    slow = choose(BF16, "cpu", bf16_native=False)
    assert slow.dtype == torch.float32 and "no native bf16" in slow.reason
    assert choose(BUILTIN, "cpu", bf16_native=True).dtype == torch.float32  # saved float32: kept
    assert choose(replace(BUILTIN, dtype="float16"), "cpu", bf16_native=True).dtype == torch.float32


def test_talaria_dtype_overrides_every_model():
    assert choose(BF16, "cpu", "float32", bf16_native=True).dtype == torch.float32
    forced = choose(BUILTIN, "cpu", "bfloat16", bf16_native=False)
    assert forced.dtype == torch.bfloat16 and "emulates" in forced.reason
    with pytest.raises(BadDtype, match="TALARIA_DTYPE='fp8'"):
        choose(BF16, "cpu", "fp8")
    assert Settings.from_env({"TALARIA_DTYPE": "bfloat16"}).agent.engine_options()["dtype"] == "bfloat16"
    assert "dtype" not in Settings.from_env({}).agent.engine_options()


def test_the_checkpoint_dtype_is_read_from_either_transformers_field():
    assert _dtype(json.loads('{"dtype": "bfloat16"}')) == "bfloat16"  # transformers 5
    assert _dtype(json.loads('{"torch_dtype": "bfloat16"}')) == "bfloat16"  # transformers 4
    assert _dtype({}) == "float32"


def test_a_bf16_engine_holds_weights_and_kv_in_bf16_and_restores_host_kv(data_dir):
    engine = TorchEngine(data_dir, ["qwen3-tiny", "gpt2-tiny"], kv_pages=256, host_kv_pages=512, dtype="bfloat16")
    try:
        engine.switch_to("qwen3-tiny")
        assert engine.params["layers.0.q"].dtype == torch.bfloat16 and engine.kv.dtype == torch.bfloat16
        half = TorchEngine(data_dir, ["qwen3-tiny"], kv_pages=256, host_kv_pages=8, dtype="float32")
        assert engine.layouts["qwen3-tiny"].nbytes < 0.55 * half.layouts["qwen3-tiny"].nbytes
        assert engine.page_bytes("qwen3-tiny") * 2 == half.page_bytes("qwen3-tiny")
        half.close()
        prompt = list(range(5, 90))
        fresh = engine.generate(Sequence("a", "s", "qwen3-tiny", prompt, 12))
        engine.switch_to("gpt2-tiny")  # the session's bf16 pages go to the host registry ...
        assert engine.kv_state("s", "qwen3-tiny") == "host"
        back = engine.generate(Sequence("b", "s", "qwen3-tiny", prompt, 12))
        assert back.kv_source == "host" and back.cached_tokens >= 64  # ... and come back
        assert back.token_ids == fresh.token_ids
    finally:
        engine.close()

