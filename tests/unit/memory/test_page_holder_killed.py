"""The holding process SIGKILLed in the middle of a pull (issue 40): a real holder process (torch
engine, page server, Mooncake or plain TCP) is killed after some pages left it, and the moved
return still completes, from the verified prefix plus a recompute, with the same greedy tokens
as a return computed from scratch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

from talaria.services.instance_agent.engine import Sequence
from talaria.services.instance_agent.memory.page_client import pull
from talaria.shared.tokenizer import block_hashes, encode

M = "qwen3-tiny"
PROMPT = encode("<|system|>You are a careful coding agent. Read before you edit, run the tests after every "
                "change.<|end|><|user|>parse('a,b') returns ['a,b']. Fix it.<|end|><|assistant|>")
SENT = 3  # pages that leave the holder before it is killed (one Mooncake chunk of three)

# The holder: runs s1's first call, serves its pages, says where, and stops dead (its loop
# blocked) as it is about to send page SENT + 1, until the test kills it.
HOLDER = """
import asyncio, json, sys, time
from concurrent.futures import ThreadPoolExecutor
from talaria.services.instance_agent.engine import Sequence, TorchEngine
from talaria.services.instance_agent.memory import page_server
from talaria.services.instance_agent.memory.mooncake_transport import open_transport
data_dir, transport, prompt, sent = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
import torch; torch.set_num_threads(1)
engine = TorchEngine(data_dir, ["qwen3-tiny"], kv_pages=96, host_kv_pages=512)
owner = ThreadPoolExecutor(1)
first = owner.submit(engine.generate, Sequence("c1", "s1", "qwen3-tiny", prompt, 8)).result()
side = open_transport("127.0.0.1", slot_bytes=sent * engine.page_bytes("qwen3-tiny"))[0] if transport == "mooncake" else None
real, sent_pages = page_server.digest, []
def digest(slabs):
    sent_pages.append(1)
    if len(sent_pages) == sent + 1:
        print("HOLDER MID", flush=True)
        time.sleep(600)
    return real(slabs)
page_server.digest = digest
async def main():
    async def export(model, session, hashes, limit):
        return await asyncio.get_running_loop().run_in_executor(owner, engine.export_pages, model, session, hashes, limit)
    server = page_server.PageServer(export, transport=side)
    print("HOLDER", json.dumps({"address": await server.start(), "first": first.token_ids}), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def said(holder) -> str:
    """The holder's next line for the test (its logs go to the same stdout)."""
    for line in holder.stdout:
        if line.startswith("HOLDER "):
            return line.removeprefix("HOLDER ").strip()
    raise AssertionError(f"the holder exited: {holder.wait()}")


@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
def test_a_holder_killed_mid_transfer_leaves_a_prefix_and_the_call_completes_with_the_same_tokens(
        make_engine, data_dir, transport):
    mover = make_engine([M])  # also writes the catalogue's weights the holder loads
    mover_side = None
    if transport == "mooncake":
        from talaria.services.instance_agent.memory.mooncake_transport import open_transport

        mover_side, why = open_transport("127.0.0.1")
        if mover_side is None:
            pytest.skip(f"no Mooncake transfer engine here: {why}")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(data_dir), transport, json.dumps(PROMPT), str(SENT)],
                              stdout=subprocess.PIPE, text=True)
    try:
        hello = json.loads(said(holder))
        follow = PROMPT + hello["first"] + encode("<|tool|>3 passed<|end|><|assistant|>", bos=False)
        hashes = block_hashes(follow[:-1], mover.page_size)

        async def go():
            moving = asyncio.create_task(pull(hello["address"], "s1", M, hashes, timeout_s=60, max_bytes=1 << 30,
                                              transport=mover_side))
            assert await asyncio.get_running_loop().run_in_executor(None, said, holder) == "MID"
            os.kill(holder.pid, signal.SIGKILL)  # mid-transfer: SENT pages left it, the rest never will
            return await moving

        got = asyncio.run(go())
    finally:
        holder.kill()
        holder.wait()
    assert got.transport == transport and len(got.hashes) == SENT < len(hashes)
    assert "broke" in got.why
    lay = got.layout
    tokens = mover.import_pages(M, "s1", got.hashes, got.slabs, lay.dtype, tuple(lay.shape), lay.ranks)
    out = mover.generate(Sequence("c2", "s1", M, follow, 8, migrated_tokens=tokens))
    expected = make_engine([M], hkvr=False, staging=False).generate(Sequence("ref", "ref", M, follow, 8)).token_ids
    assert out.kv_source == "migrated" and out.cached_tokens >= tokens == SENT * mover.page_size
    assert out.token_ids == expected
