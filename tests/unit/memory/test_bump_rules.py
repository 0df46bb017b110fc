"""Bump layout rules, one per test (services/instance_agent/memory/bump.py), on a CPU buffer:
each region's bounds and their boundaries, the page-first KV view, and the ownership check."""

import pytest
import torch

from talaria.services.instance_agent.engine.weights import ALIGN
from talaria.services.instance_agent.memory.bump import BumpBuffer, RegionBases

SIZE = 64 * ALIGN


def test_the_runtime_region_is_anchored_at_the_aligned_top():
    b = BumpBuffer(SIZE - 5, 3 * ALIGN - 7, "cpu")  # both rounded up to ALIGN
    assert b.size == SIZE and b.runtime_base == SIZE - 3 * ALIGN
    assert b.runtime_region().numel() == 3 * ALIGN and b.buf.numel() == SIZE


def test_a_buffer_that_cannot_hold_its_runtime_is_refused_at_the_boundary():
    with pytest.raises(ValueError, match="cannot hold"):
        BumpBuffer(SIZE, SIZE, "cpu")  # runtime base would be 0
    assert BumpBuffer(SIZE, SIZE - ALIGN, "cpu").runtime_base == ALIGN


def test_weights_may_fill_exactly_up_to_the_runtime_base():
    b = BumpBuffer(SIZE, ALIGN, "cpu")
    b.resize_weights(b.runtime_base)
    assert b.kv_bytes == 0 and b.weight_region().numel() == b.runtime_base
    with pytest.raises(ValueError, match="do not fit"):
        b.resize_weights(b.runtime_base + 1)  # aligned up past the base


def test_the_kv_pool_starts_at_the_aligned_weight_end_and_ends_at_the_runtime_base():
    b = BumpBuffer(SIZE, ALIGN, "cpu")
    b.resize_weights(ALIGN + 1)
    assert b.kv_base == 2 * ALIGN and b.kv_bytes == SIZE - ALIGN - 2 * ALIGN
    assert b.weight_region().numel() == ALIGN + 1
    b.resize_weights(0)
    assert b.kv_base == 0 and b.kv_bytes == b.runtime_base


def test_the_kv_view_holds_only_whole_pages_starting_at_the_kv_base():
    b = BumpBuffer(SIZE, ALIGN, "cpu")
    b.resize_weights(ALIGN)
    page_shape = (3, 5)  # 15 floats: 60 bytes per page
    kv = b.kv_view(page_shape)
    pages = b.kv_bytes // 60
    assert tuple(kv.shape) == (pages, 3, 5) and kv.dtype == torch.float32
    assert kv.data_ptr() == b.buf.data_ptr() + b.kv_base
    half = b.kv_view((4,), torch.float16)  # 8 bytes per page
    assert half.shape[0] == b.kv_bytes // 8
    assert b.page_range(2, 60) == (b.kv_base + 120, b.kv_base + 180)


def test_bases_are_pointers_into_the_buffer():
    b = BumpBuffer(SIZE, ALIGN, "cpu")
    b.resize_weights(10)
    p = b.buf.data_ptr()
    assert b.bases() == RegionBases(weight=p, kv=p + ALIGN, runtime=p + SIZE - ALIGN)
    assert b.raw(5, 9).data_ptr() == p + 5 and b.raw(5, 9).numel() == 4


def test_owns_checks_both_ends_of_a_view():
    b = BumpBuffer(SIZE, ALIGN, "cpu")
    view = b.raw(ALIGN, 2 * ALIGN)
    assert b.owns(view) and b.owns(view, ALIGN, 2 * ALIGN)  # exactly its bounds
    assert not b.owns(view, ALIGN + 1)  # starts before lo
    assert not b.owns(view, 0, 2 * ALIGN - 1)  # ends after hi
    assert not b.owns(torch.empty(4, dtype=torch.uint8))  # another allocation
    wide = b.buf[ALIGN:2 * ALIGN].view(torch.float32)  # element size counts
    assert b.owns(wide, ALIGN, 2 * ALIGN) and not b.owns(wide, ALIGN, 2 * ALIGN - 1)


def test_a_new_buffer_holds_no_weights_and_its_whole_gap_is_kv():
    b = BumpBuffer(SIZE, ALIGN, "cpu")
    assert (b.weight_bytes, b.kv_base, b.kv_bytes) == (0, 0, SIZE - ALIGN)
