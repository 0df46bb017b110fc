"""Bump layout: regions in one buffer, parameters are views, bases stable across switches."""

import pytest
import torch

from talaria.services.instance_agent.engine.weights import align_up
from talaria.services.instance_agent.memory.bump import BumpBuffer


def test_regions_partition_the_buffer():
    b = BumpBuffer(1 << 20, 4096, "cpu")
    b.resize_weights(1000)
    assert b.kv_base == align_up(1000)
    assert b.kv_base + b.kv_bytes == b.runtime_base == b.size - 4096
    kv = b.kv_view((2, 16, 8))
    assert b.owns(kv, b.kv_base, b.runtime_base)
    with pytest.raises(ValueError):
        b.resize_weights(b.size)


def test_engine_weights_and_kv_live_in_the_buffer(make_engine):
    eng = make_engine(["qwen3-tiny", "gpt2-tiny"])
    eng.switch_to("qwen3-tiny")
    b = eng.bump
    base = b.buf.data_ptr()
    for slot in eng.layouts["qwen3-tiny"].slots:
        t = eng.params[slot.name]
        assert t.data_ptr() == base + slot.offset  # a view at its layout offset, not a copy
    assert eng.kv.data_ptr() == base + b.kv_base and b.owns(eng.kv, b.kv_base, b.runtime_base)
    assert b.owns(eng.rope[0], b.runtime_base)


def test_bases_stable_across_switches(make_engine):
    eng = make_engine(["qwen3-tiny", "gpt2-tiny", "qwen3-moe-tiny"])
    eng.switch_to("qwen3-tiny")
    before = eng.bump.bases()
    ptrs = {k: v.data_ptr() for k, v in eng.params.items()}
    kv_ptr, buf_ptr = eng.kv.data_ptr(), eng.bump.buf.data_ptr()
    for m in ("gpt2-tiny", "qwen3-moe-tiny", "qwen3-tiny"):
        rec = eng.switch_to(m)
        assert rec.pointer_check_ok
        assert eng.bump.buf.data_ptr() == buf_ptr  # no re-allocation on the switch path
        assert eng.bump.bases().weight == before.weight and eng.bump.bases().runtime == before.runtime
    assert rec.kv_shell_reused
    assert eng.bump.bases() == before
    assert {k: v.data_ptr() for k, v in eng.params.items()} == ptrs
    assert eng.kv.data_ptr() == kv_ptr
    # the rebound views hold the right model's bytes
    assert torch.equal(eng.bump.weight_region(), eng.host_images["qwen3-tiny"])
