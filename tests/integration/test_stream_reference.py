"""A routed call on the stream refers to its submission for the prompt ids (stored once).

The agent usually starts from the fast core-NATS copy, which carries the whole call; when that
copy is lost (a restart, a dropped message) the durable copy is completed from the stream.
"""

import pytest

from talaria.services.instance_agent.agent_service import _with_prompt
from talaria.shared.events import CallRouted, CallSubmitted, EVENT_DECODER
from talaria.shared.wire import encode
from talaria.shared.bus import connect, emit
from talaria.shared.nats_auth import owner_sender, sender_name
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration


class RunnerState:
    """What `_with_prompt` reads of a CallRunner: its connection and which calls it holds."""

    def __init__(self, nc) -> None:
        self.nc, self.calls = nc, {}

    def holds(self, call_id: str) -> bool:
        return call_id in self.calls


def submitted(call_id: str) -> CallSubmitted:
    return CallSubmitted(call_id=call_id, session_id="s1", model="qwen3-tiny", prompt_ids=[5, 6, 7, 8],
                           block_hashes=[11], max_tokens=4, submitted_at=1000.0)


def routed(call: CallSubmitted, seq: int) -> CallRouted:
    return CallRouted(call=call, call_index=0, instance_id="agent-0", policy="talaria",
                        routed_at=1000.1).by_reference(seq)


async def test_the_stream_copy_is_completed_from_the_submission(nats_url):
    nc, js = await connect(nats_url, "talaria-test")
    try:
        call = submitted("c1")
        seq = await emit(js, call, sender=owner_sender(call))
        ref = routed(call, seq)
        assert ref.call.prompt_ids == [] and ref.call.prompt_tokens == 4  # the stream's copy is slim
        assert len(encode(ref)) < len(encode(routed(call, 0))) + 16
        full = await _with_prompt(js, RunnerState(nc), ref)
        assert full.call == call and full.submitted_seq == 0
        # Already running from the fast copy: nothing to fetch.
        runner = RunnerState(nc)
        runner.calls["c1"] = object()
        assert await _with_prompt(js, runner, ref) is ref
    finally:
        await nc.close()


async def test_a_reference_to_anything_but_the_gateways_submission_is_refused(nats_url):
    nc, js = await connect(nats_url, "talaria-test")
    try:
        forged = await emit(js, submitted("c2"), sender=sender_name("router"))  # not the gateway's
        other = await emit(js, submitted("c9"), sender=owner_sender(submitted("c9")))  # another call's
        failures = await js.pull_subscribe(DEP.event("call.failed"), stream=DEP.events_stream)
        assert await _with_prompt(js, RunnerState(nc), routed(submitted("c2"), forged)) is None
        assert await _with_prompt(js, RunnerState(nc), routed(submitted("c3"), other)) is None
        assert await _with_prompt(js, RunnerState(nc), routed(submitted("c4"), 10_000)) is None  # not there
        failed = [EVENT_DECODER.decode(x.data) for x in await failures.fetch(3, timeout=5)]
        assert [(f.call_id, f.status) for f in failed] == [("c2", 400), ("c3", 400), ("c4", 503)]
    finally:
        await nc.close()
