"""A durable pull consumer made again from its ack floor (shared/durable_pull.py) hands back at
once what it had delivered to a pull request that died (a broker node killed under load, CI:
an agent's routed call then came back only after its 60 s ack_wait, the call's deadline), and
never replays the stream's history when a failed earlier try left no consumer."""

from __future__ import annotations

import nats
import pytest
import structlog
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig

from talaria.shared.durable_pull import DurablePull, from_ack_floor

pytestmark = pytest.mark.integration

STREAM, SUBJECT = "DURABLE_PULL_TEST", "durable-pull-test.calls"
LONG_ACK_WAIT_S = 60.0  # far beyond the test's waits: a redelivery by ack_wait would fail it


@pytest.fixture
async def js(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await js.delete_stream(STREAM)
    except Exception:
        pass
    await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT]))
    yield js
    await js.delete_stream(STREAM)
    await nc.close()


def _config() -> ConsumerConfig:
    return ConsumerConfig(durable_name="reader", ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                          filter_subject=SUBJECT, ack_wait=LONG_ACK_WAIT_S)


async def _payloads(sub, n: int) -> list[bytes]:
    msgs = await sub.fetch(n, timeout=2.0)
    return [m.data for m in msgs]


async def test_rebuilt_consumer_delivers_what_a_dead_pull_held_at_once(js):
    log = structlog.get_logger()
    for i in range(3):
        await js.publish(SUBJECT, f"call-{i}".encode())
    sub, _ = await from_ack_floor(js, STREAM, _config(), log)
    first = await sub.fetch(3, timeout=2.0)
    await first[0].ack_sync()  # call-0 done; call-1 and call-2 handed to a pull request nobody reads

    again, start = await from_ack_floor(js, STREAM, _config(), log)

    assert start == 2  # the ack floor was call-0's sequence
    assert await _payloads(again, 3) == [b"call-1", b"call-2"]


async def test_a_consumer_gone_resumes_at_the_last_start_not_the_head(js):
    log = structlog.get_logger()
    for i in range(3):
        await js.publish(SUBJECT, f"call-{i}".encode())
    await js.add_consumer(STREAM, config=_config())
    await js.delete_consumer(STREAM, "reader")  # a failed try deleted it and could not add it back

    sub, start = await from_ack_floor(js, STREAM, _config(), log, start=3)

    assert start == 3
    assert await _payloads(sub, 3) == [b"call-2"]


async def test_durable_pull_rebuilds_after_a_reconnect(js):
    log = structlog.get_logger()
    await js.publish(SUBJECT, b"call-0")
    sub, _ = await from_ack_floor(js, STREAM, _config(), log)
    pull = DurablePull(js._nc, js, STREAM, _config(), sub, log, retry_wait_s=0.0)
    lost = await pull.fetch(1, timeout=2.0)
    assert [m.data for m in lost] == [b"call-0"]  # delivered, never acked: as if its connection died
    js._nc.stats["reconnects"] += 1  # what the client counts when it reconnects to another node

    got = []
    for _ in range(20):  # each fetch waits on the server, no sleeps
        got = await pull.fetch(1, timeout=0.5)
        if got:
            break
    await pull.close()

    assert [m.data for m in got] == [b"call-0"]  # at once, not after the 60 s ack_wait
