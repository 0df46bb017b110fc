"""The live call path's order (issue 11, ask 5): a finished call's reply is written before the
agent's bookkeeping of it, and neither the agent's loop nor the gateway waits on anything a
client's answer does not need."""

import asyncio
import time
from types import SimpleNamespace

import structlog
from talaria.services.gateway.submitter import Submitter
from talaria.services.instance_agent import call_closing, record_sender
from talaria.services.instance_agent.agent_core import StepReport
from talaria.services.instance_agent.engine.contract import Capabilities
from talaria.services.instance_agent.runner import CallRunner
from talaria.shared.events import CallSubmitted, RoundSummary
from talaria.shared.messages import CallResult, Timings, Usage
from talaria.shared.nats_auth import SENDER_HEADER
from talaria.shared.settings import Settings
from talaria.shared.wire import encode
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names


def runner(tmp_path) -> CallRunner:
    """A runner whose steps touch no engine, NATS or tracer: the engine stand-in states
    capabilities and an empty view (engine_view.py)."""
    settings = Settings.of(data_dir=tmp_path, instance_id="agent-t", models=("qwen3-tiny",))
    engine = SimpleNamespace(capabilities=Capabilities(switch_with_calls_running=False, host_kv=True,
                                                       d2d_staging=True, chunked_prefill=True),
                             active_model=None, stats=lambda: None, session_states=list, device_tokens=dict,
                             specs={})
    r = CallRunner(settings.common, settings.agent, engine, None, None, None, None, structlog.get_logger())

    async def no_snapshot() -> None:  # no NATS to publish it on
        pass

    r.closer.on_change = no_snapshot
    return r


async def test_a_steps_replies_are_written_once_before_their_bookkeeping(tmp_path, monkeypatch):
    r, order = runner(tmp_path), []

    async def complete(call_id):  # publishes the record and reply (queued), returns its bookkeeping
        order.append(f"publish {call_id}")
        return lambda: order.append(f"note {call_id}")

    async def written():
        order.append("write")

    r.closer.complete = complete
    monkeypatch.setattr(call_closing, "written", written)
    await r.closer.events(StepReport(finished=["c1", "c2"]))
    assert order == ["publish c1", "publish c2", "write", "note c1", "note c2"]


async def test_the_loop_does_not_wait_for_a_round_summarys_ack(tmp_path, monkeypatch):
    r = runner(tmp_path)
    ack = asyncio.get_running_loop().create_future()  # the stream never answers

    async def emit_async(js, event, *a, **kw):
        return ack

    monkeypatch.setattr(record_sender, "emit_async", emit_async)
    summary = RoundSummary(instance_id="agent-t", round_index=1, wall_s=0.01, active_s=0.01, switch_s=0.0,
                           at=1000.0, slots=["qwen3-tiny"])
    await asyncio.wait_for(r.closer.events(StepReport(rounds=[summary])), 1.0)  # returns with the ack pending
    assert len(r.closer.sender._tasks) == 1  # its ack is awaited in the background (and at stop)
    ack.set_result(SimpleNamespace(seq=1))
    await asyncio.wait_for(r.closer.sender.drain(1.0), 2.0)
    assert not r.closer.sender._tasks


async def test_the_gateway_answers_before_its_own_bookkeeping(monkeypatch):
    order = []

    class Log:
        def info(self, event, **kw):
            order.append(event)

        warning = error = info

    class Js:
        async def publish(self, subject, data, timeout=None, headers=None):
            order.append("submitted")
            asyncio.get_running_loop().call_soon(deliver)  # the agent's reply arrives
            return SimpleNamespace(seq=1, duplicate=False)

    class Nc:
        max_payload = 1 << 20

        def __init__(self):
            self.options = {"name": "talaria-gateway"}

        async def subscribe(self, subject, cb=None):
            return SimpleNamespace(unsubscribe=lambda: asyncio.sleep(0))

    tracer = SimpleNamespace(start_as_current_span=lambda *a, **kw: _Span())
    nc, js = Nc(), Js()
    js._nc = nc  # the bus reads the sender's name from the connection
    submitter = Submitter(nc, js, tracer, 5.0, Log())
    call = CallSubmitted(call_id="c1", session_id="s1", model="qwen3-tiny", prompt_ids=[1, 2], block_hashes=[],
                         max_tokens=1, submitted_at=time.time())  # the wait ends at its deadline
    result = CallResult(call_id="c1", session_id="s1", call_index=0, model="qwen3-tiny", instance_id="agent-0",
                        text="x", finish_reason="length", usage=Usage(2, 1, 3, 0),
                        timings=Timings(0.0, 0.0, 0.0, 0.0, 0.0, 0.0))

    def deliver():
        asyncio.ensure_future(submitter._on_reply(SimpleNamespace(
            subject=f"{DEP.reply_prefix}.gateway.x.c1", data=encode(result),
            headers={SENDER_HEADER: "talaria-agent-agent-0"})))

    async def answer(reply):
        order.append("answered")

    reply = await asyncio.wait_for(submitter.submit(call, on_reply=answer), 5.0)
    assert isinstance(reply, CallResult)
    assert order == ["submitted", "answered", "call served"]


class _Span:
    def __enter__(self):
        return SimpleNamespace(set_attribute=lambda *a: None, set_attributes=lambda *a: None,
                               get_span_context=lambda: SimpleNamespace(trace_id=1), set_status=lambda *a: None)

    def __exit__(self, *exc):
        return False
