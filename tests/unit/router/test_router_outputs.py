"""services/router/outputs.py: an input is acked only once the outputs ahead of it are stored.
The stream and the input message are test doubles (futures a test resolves by hand): the
ordering they check cannot be staged on a real server deterministically."""

from __future__ import annotations

import asyncio

import structlog
from nats.js.api import PubAck

from talaria.services.router.outputs import RouterOutputs
from talaria.services.router.policy.base import PolicyConfig
from talaria.shared.events import LeaseExpired


class InputMsg:
    """Test double of a JetStream message: records its ack."""

    subject = "talaria.calls.submitted"

    def __init__(self) -> None:
        self.acked = asyncio.Event()

    async def ack(self) -> None:
        self.acked.set()


def outputs() -> RouterOutputs:
    return RouterOutputs(None, None, structlog.get_logger(), PolicyConfig(), on_stored=lambda seq: None)


async def test_an_input_without_outputs_is_acked_only_behind_the_outputs_already_on_their_way():
    """A redelivered copy of a call decided a moment ago makes no outputs: its ack must not
    overtake the first copy's, or a crash before those are stored loses the call."""
    out = outputs()
    first, stored = InputMsg(), asyncio.get_running_loop().create_future()
    out.store_then_ack_soon([LeaseExpired("s1", "m1", "a", 1.0)], [stored], first)
    copy = InputMsg()
    out.ack_after_stored(copy)
    await asyncio.sleep(0)  # the tasks run as far as they can
    await asyncio.sleep(0)
    assert not first.acked.is_set() and not copy.acked.is_set()
    stored.set_result(PubAck(stream="S", seq=5))
    await asyncio.wait_for(copy.acked.wait(), 5)
    assert first.acked.is_set()


async def test_with_nothing_on_its_way_an_input_without_outputs_is_acked_at_once():
    out = outputs()
    msg = InputMsg()
    out.ack_after_stored(msg)
    await asyncio.wait_for(msg.acked.wait(), 5)
