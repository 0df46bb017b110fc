"""Ablation switches change timing only: greedy answers are identical with every mechanism
on and with all three off (the paper's Round-only), across interleaved sessions and models."""

from __future__ import annotations

import asyncio

import nats
import pytest

from talaria.services.instance_agent.agent_service import run as run_agent
from talaria.shared.messages import CallRequest, CallResult, REPLY_DECODER
from talaria.shared.wire import encode
from talaria.shared.health import wait_for_router
from talaria.shared.settings import Settings
from talaria.embedded import free_port
from tests.integration.harness import Services
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration
MODELS = ("qwen3-tiny", "gpt2-tiny")


async def session(nc, run: str, sid: int) -> list[str]:
    """Three calls, each prompt = previous prompt + previous answer + a tool result."""
    model = MODELS[sid % 2]
    prompt, answers = f"task {sid}: make the tests pass\n", []
    for i in range(3):
        req = CallRequest(model=model, prompt=prompt, session_id=f"{run}-{sid}", max_tokens=6, temperature=0)
        reply = REPLY_DECODER.decode((await nc.request(DEP.api_call, encode(req), timeout=120)).data)
        assert isinstance(reply, CallResult), reply
        answers.append(reply.text)
        prompt += reply.text + f"\n[tool {i}] ok\n"
    return answers


async def run_workload(settings: Settings, run: str, **agent_flags) -> list[list[str]]:
    services = Services()
    nc = await nats.connect(settings.common.nats_url)
    try:
        await services.start_control_plane(settings)
        await services.start("agent", run_agent, settings.with_(instance_id=f"agent-{run}", models=MODELS,
                                                                 **agent_flags))
        await wait_for_router(nc, instances=1)
        return list(await asyncio.gather(*(session(nc, run, s) for s in range(4))))
    finally:
        await nc.close()
        await services.close()


async def test_round_only_and_full_talaria_give_the_same_greedy_answers(nats_url, database_url, tmp_path):
    settings = Settings.of(nats_url=nats_url, database_url=database_url, data_dir=tmp_path, policy="talaria",
                        http_port=free_port(), session_idle_s=3600, call_timeout_s=120)
    full = await run_workload(settings, "full")
    round_only = await run_workload(settings, "ro", ablation="round-only")
    assert full == round_only
    assert all(len(a) == 3 for a in full)
