"""An agent completing a routed call from the stream (its submission, by reference) asks again
through a leader election instead of refusing the call. The stream is a test double: a read
that an election leaves unanswered cannot be staged deterministically on a real server; the
read itself runs against NATS in tests/integration/test_stream_reference.py."""

from __future__ import annotations

import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import ServiceUnavailableError

from talaria.services.instance_agent import agent_service
from talaria.shared import bus
from talaria.shared.events import CallRouted, CallSubmitted
from talaria.shared.nats_auth import SENDER_HEADER, owner_sender
from talaria.shared.wire import encode


class Raw:
    def __init__(self, call: CallSubmitted) -> None:
        self.data, self.headers = encode(call), {SENDER_HEADER: owner_sender(call)}


class ScriptedStream:
    """Test double: answers each read with the next outcome of `script` (an exception to raise,
    or a message); records each context's timeout."""

    def __init__(self, script) -> None:
        self.script, self.reads, self.timeouts = list(script), 0, []

    def jetstream(self, timeout=None):  # the connection's side: a context per timeout
        self.timeouts.append(timeout)
        return self

    async def get_msg(self, stream, seq):
        self.reads += 1
        outcome = self.script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


class Runner:
    def __init__(self, nc) -> None:
        self.nc = nc

    def holds(self, call_id: str) -> bool:
        return False


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(bus, "RECONNECT_WAIT_S", 0.01)


async def test_a_read_back_during_an_election_is_asked_again_not_refused():
    call = CallSubmitted(call_id="c1", session_id="s1", model="qwen3-tiny", prompt_ids=[5, 6, 7],
                         block_hashes=[], max_tokens=4, submitted_at=1000.0)
    ref = CallRouted(call=call, call_index=0, instance_id="agent-0", policy="talaria",
                     routed_at=1000.1).by_reference(42)
    stream = ScriptedStream([NatsTimeout(), ServiceUnavailableError(code=503, err_code=10008), Raw(call)])
    full = await agent_service._with_prompt(stream, Runner(stream), ref)
    assert full is not None and full.call == call and full.submitted_seq == 0
    assert stream.reads == 3 and stream.timeouts == [bus.ATTEMPT_S]  # each try short
