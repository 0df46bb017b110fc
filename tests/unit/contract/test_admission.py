"""Admission control (issue 25 item 6), the pure policy: a standing queue shrinks the limit on
calls in flight, a tenant over its fair share is refused 429 while others still get in, and
the limit lifts when the queue is gone."""

from __future__ import annotations

import math

from talaria.services.gateway.admission import Admission, DiskCheck
from talaria.shared.messages import CallResult, ErrorReply, Timings, Usage

TARGET = 1.0


def answered(queue_s: float, work_s: float = 0.1) -> tuple[CallResult, float]:
    """A reply whose call did `work_s` of engine work and so waited `queue_s`."""
    reply = CallResult(call_id="c", session_id="s", call_index=0, model="m", instance_id="a", text="x",
                       finish_reason="length", usage=Usage(1, 1, 2, 0),
                       timings=Timings(prefill_s=work_s / 2, decode_s=work_s / 2))
    return reply, queue_s + work_s


def test_no_limit_until_a_standing_queue_then_it_sheds_with_retry_after():
    a = Admission(TARGET)
    for _ in range(50):
        assert a.admit("t", 0.0) is None  # unlimited while no queue has been seen
    reply, elapsed = answered(queue_s=0.1)
    a.done("t", reply, elapsed, now=1.5)
    assert a.limit == math.inf  # short queues: nothing changes
    reply, elapsed = answered(queue_s=3.0)  # every call answered in the interval waited 3 s
    a.done("t", reply, elapsed, now=3.0)
    assert a.limit < 49  # cut below what is in flight
    refused = a.admit("t", 3.1)
    assert isinstance(refused, ErrorReply) and refused.status == 503 and refused.retry_after_s >= 1


def test_a_tenant_over_its_fair_share_is_refused_while_another_gets_in():
    a = Admission(TARGET, limit=10)
    for _ in range(10):
        assert a.admit("heavy", 0.0) is None
    assert a.admit("heavy", 0.0).status == 503  # alone at the limit: the stack is full
    assert a.admit("light", 0.0) is None  # under its share (10 / 2 tenants)
    refused = a.admit("heavy", 0.0)
    assert isinstance(refused, ErrorReply) and refused.status == 429 and refused.code == "over_fair_share"
    assert a.in_flight == {"heavy": 10, "light": 1}


def test_the_limit_lifts_once_the_queue_is_gone():
    a = Admission(TARGET, limit=4)
    for _ in range(4):
        a.admit("t", 0.0)
    now = 0.0
    for _ in range(20):  # calls answered without waiting, one per interval
        now += TARGET * 1.01
        reply, elapsed = answered(queue_s=0.0)
        a.done("t", reply, elapsed, now)
        a.admit("t", now)
    assert a.limit == math.inf


def test_errors_do_not_count_as_queueing():
    a = Admission(TARGET)
    a.admit("t", 0.0)
    a.done("t", ErrorReply(503, "no_capacity", "x"), 30.0, now=5.0)
    assert a.limit == math.inf and not a.in_flight


def test_a_disk_under_its_reserve_refuses_new_calls(tmp_path):
    assert DiskCheck(tmp_path, 0).refusal() is None
    refused = DiskCheck(tmp_path, 1 << 62).refusal()
    assert refused.status == 503 and refused.code == "insufficient_storage" and "MiB free" in refused.message


async def test_every_stream_is_capped_and_drops_its_oldest_first(tmp_path, monkeypatch):
    """Issue 25: nothing bounded storage. Each stream keeps at most a share of the data
    directory's disk, discarding the oldest messages past it."""
    import shutil

    from nats.js.api import DiscardPolicy

    from talaria.shared import bus
    from talaria.shared.bus import ensure_stream

    seen = []

    class Js:
        async def add_stream(self, config):
            seen.append(config)

    js = Js()
    bus.bind(js, bus.Link(data_dir=tmp_path / "not-yet"))  # its nearest existing parent
    await ensure_stream(js)
    [config] = seen
    assert config.discard == DiscardPolicy.OLD
    assert 0 < config.max_bytes <= shutil.disk_usage(tmp_path).free // 8 + (1 << 20)
