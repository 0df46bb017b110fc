"""shared/bus.py `stored`: what is sent again through a stream leader's failover. The
JetStream context is a test double (a failover's unanswered publish cannot be staged
deterministically on a real server); the integration test of the rule is
tests/integration/test_nats_cluster.py."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import PubAck
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from talaria.shared import bus


class ScriptedJetStream:
    """Test double: answers each publish with the next outcome of `script` (an exception to
    raise, or a PubAck)."""

    def __init__(self, script) -> None:
        self.script, self.sent = list(script), []

    async def publish(self, subject, data, timeout=None, headers=None):
        self.sent.append(timeout)
        outcome = self.script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(bus, "RECONNECT_WAIT_S", 0.01)


async def test_no_responders_is_sent_again_until_a_leader_answers():
    js = ScriptedJetStream([NoStreamResponseError(), NoStreamResponseError(), PubAck(stream="S", seq=7)])
    ack = await bus.stored(js, "s", b"x", {})  # no message id: still safe, nothing was stored
    assert ack.seq == 7 and len(js.sent) == 3


async def test_jetstream_temporarily_unavailable_is_sent_again():
    """A 503 API error (err_code 10008, "JetStream system temporarily unavailable") during an
    election stored nothing: CI saw it reach a client as a 503 before this was retried."""
    js = ScriptedJetStream([ServiceUnavailableError(code=503, err_code=10008), PubAck(stream="S", seq=9)])
    ack = await bus.stored(js, "s", b"x", {})
    assert ack.seq == 9 and not ack.duplicate and len(js.sent) == 2


async def test_an_unanswered_publish_is_sent_again_only_with_a_message_id():
    js = ScriptedJetStream([asyncio.TimeoutError(), PubAck(stream="S", seq=7, duplicate=True)])
    ack = await bus.stored(js, "s", b"x", {"Nats-Msg-Id": "CallCompleted:c1"})
    assert ack.seq == 7 and not ack.duplicate  # the duplicate is our own first attempt, stored
    assert js.sent[0] == bus.ATTEMPT_S
    bare = ScriptedJetStream([asyncio.TimeoutError(), PubAck(stream="S", seq=8)])
    with pytest.raises(asyncio.TimeoutError):  # it may be stored: a second copy would be a second event
        await bus.stored(bare, "s", b"x", {})
    assert bare.sent == [bus.PUBLISH_TIMEOUT_S]


async def test_a_duplicate_on_the_first_attempt_stays_a_duplicate():
    js = ScriptedJetStream([PubAck(stream="S", seq=3, duplicate=True)])
    assert (await bus.stored(js, "s", b"x", {"Nats-Msg-Id": "CallSubmitted:c1"})).duplicate


async def test_a_stream_made_while_the_cluster_elects_is_tried_until_a_leader_answers():
    script = [asyncio.TimeoutError(), ServiceUnavailableError(), "made"]

    async def call():
        outcome = script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    assert await bus.elected(call, within_s=5.0) == "made"
    assert not script


async def test_a_cluster_that_never_answers_raises_once_the_failover_time_is_spent():
    calls = 0

    async def call():
        nonlocal calls
        calls += 1
        raise asyncio.TimeoutError()

    with pytest.raises(asyncio.TimeoutError):
        await bus.elected(call, within_s=0.2)
    assert calls > 1
