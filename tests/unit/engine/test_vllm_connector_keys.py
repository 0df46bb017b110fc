"""The vLLM connector's page keys (engine/vllm_connector.py `block_keys`) are the router's
tenant-scoped block hashes: a vLLM block's key is the cumulative 16-token hash at its end, so
the connector, the router's prefix index and HKVR name the same KV the same way. Pure: runs
without vLLM."""

import pytest

from talaria.services.instance_agent.engine.vllm_connector import block_keys
from talaria.shared.tokenizer import HASH_BLOCK_TOKENS, block_hashes

TOKENS = [(i * 37 + 11) % 4000 for i in range(1000)]


@pytest.mark.parametrize("block", [16, 32, 128])
def test_a_blocks_key_is_the_routers_hash_at_its_end(block):
    keys = block_keys(TOKENS, block, "tenant-a")
    router = block_hashes(TOKENS, HASH_BLOCK_TOKENS, scope="tenant-a")
    per = block // HASH_BLOCK_TOKENS
    assert len(keys) == len(TOKENS) // block
    assert keys == [router[(j + 1) * per - 1] for j in range(len(keys))]


def test_keys_are_scoped_per_tenant_and_cover_the_whole_prefix():
    a, b = block_keys(TOKENS, 128, "tenant-a"), block_keys(TOKENS, 128, "tenant-b")
    assert not set(a) & set(b)  # the same tokens never hit across tenants
    changed = list(TOKENS)
    changed[3] += 1  # a change in the first block changes every later key (cumulative)
    assert not set(block_keys(changed, 128, "tenant-a")) & set(a)


def test_a_block_size_off_the_hash_grid_is_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        block_keys(TOKENS, 24, "")
