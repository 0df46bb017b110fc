"""The router's outputs (services/router/outputs.py) through a stream leader cut off: an output
with a message id whose ack never comes is published again after ATTEMPT_S. A router tick
waits for its outputs (LeaseExpired) holding the router's lock; one waiting out the 10 s publish
timeout froze every decision of a partition (results/multihost.md). The JetStream context is a
test double: a lost ack cannot be staged on a real server."""

import asyncio

from talaria.services.router import outputs as router_outputs
from talaria.services.router.outputs import RouterOutputs
from talaria.shared import logs
from talaria.shared.events import LeaseExpired


async def test_a_lease_expiry_whose_ack_is_lost_is_published_again_after_an_attempt(monkeypatch):
    monkeypatch.setattr(router_outputs, "ATTEMPT_S", 0.05)
    monkeypatch.setattr(router_outputs, "PUBLISH_TIMEOUT_S", 30.0)  # what an output without an id waits
    again, stored = [], []

    async def emit(js, event):
        again.append(event)
        return 7

    monkeypatch.setattr(router_outputs, "emit", emit)
    out = RouterOutputs(None, None, logs.get("test"), None, on_stored=stored.append)
    expiry = LeaseExpired("s1", "qwen3-tiny", "agent-0", 4.0)
    lost = asyncio.get_running_loop().create_future()  # the cut-off leader never answers
    await asyncio.wait_for(out._stored([expiry], [lost]), 5.0)
    assert again == [expiry] and stored == [7]
