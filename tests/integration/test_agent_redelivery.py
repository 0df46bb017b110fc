"""A routed call reaches its agent twice (the router's core-NATS fast copy and the durable
JetStream copy); it runs once however the two interleave with its completion, and an engine
entry that nobody runs can never wedge the agent (issue 15, the nats-pause miss).

After a NATS pause the durable copy of a call that ran from its fast copy can arrive while the
call's completion is still being published (its publish waited out the pause) or its engine
state released. The agent used to forget the call there, in neither its running nor its
finished calls, so it admitted the copy and ran the call again; when that happened during the
release, the rerun's completion raised and stranded the other calls finished with it in the
engine ("cannot switch model: 1 call(s) still running"), and every call waited for the 30 s
deadline. Here the real agent service takes both copies over real NATS; the pause is held
at the two points where the copy can arrive.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

from talaria.services.instance_agent import record_sender
from talaria.services.instance_agent import agent_service
from talaria.services.instance_agent.engine import Sequence
from talaria.shared.events import CallCompleted, CallRouted, CallSubmitted
from talaria.shared.messages import CallResult, REPLY_DECODER
from talaria.shared.bus import connect, emit, publish_fast
from talaria.shared.nats_auth import owner_sender
from talaria.shared.settings import Settings
from tests.integration.harness import Services, acked, wait_until
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

pytestmark = pytest.mark.integration

AGENT = "agent-0"


class Stack:
    """The real agent service, and this test standing in for the gateway and the router."""

    def __init__(self, nats_url, tmp_path, monkeypatch) -> None:
        self.settings = Settings.of(nats_url=nats_url, data_dir=tmp_path, instance_id=AGENT,
                                 models=("qwen3-tiny", "gpt2-tiny"), ablation="round-only")
        self.services = Services()
        self.runner = None
        self.copies: dict[str, list[bool]] = {}  # call id -> for each copy accepted: durable?
        self.arrived: dict[str, asyncio.Event] = {}
        self.prefilled: Counter[str] = Counter()  # call id -> times the engine admitted it
        self.replies: dict[str, asyncio.Queue] = {}
        stack = self

        class ObservedRunner(agent_service.CallRunner):
            def __init__(self, *args, **kw) -> None:
                super().__init__(*args, **kw)
                stack.runner = self
                prefill = self.engine.prefill

                def counted(reqs, *a, **k):
                    stack.prefilled.update(r.call_id for r in reqs)
                    return prefill(reqs, *a, **k)

                self.engine.prefill = counted

            def accept(self, routed, msg, headers=None):
                refused = super().accept(routed, msg, headers)
                stack.copies.setdefault(routed.call.call_id, []).append(msg is not None)
                stack.arrived.setdefault(routed.call.call_id, asyncio.Event()).set()
                return refused

        monkeypatch.setattr(agent_service, "CallRunner", ObservedRunner)

    async def start(self) -> None:
        self.nc, self.js = await connect(self.settings.common.nats_url, "talaria-router")
        await self.services.start(AGENT, agent_service.run, self.settings)

    async def close(self) -> None:
        await self.services.close()
        await self.nc.close()

    async def submit(self, call_id: str, model: str, session: str) -> tuple[CallRouted, int]:
        """The gateway's submission (its stream sequence is what the durable copy refers to)."""
        inbox = f"_INBOX.test.{call_id}"
        self.replies[call_id] = asyncio.Queue()

        async def on_reply(msg):
            await self.replies[call_id].put(REPLY_DECODER.decode(msg.data))

        await self.nc.subscribe(inbox, cb=on_reply)
        call = CallSubmitted(call_id=call_id, session_id=session, model=model, prompt_ids=[5, 6, 7, 8, 9],
                               block_hashes=[], max_tokens=4, submitted_at=time.time(), reply_to=inbox,
                               deadline_at=time.time() + 60)
        seq = await emit(self.js, call, sender=owner_sender(call))
        routed = CallRouted(call=call, call_index=0, instance_id=AGENT, policy="talaria", routed_at=time.time())
        return routed, seq

    async def fast_copy(self, routed: CallRouted) -> None:
        await publish_fast(self.js, DEP.dispatch(AGENT), routed)

    async def durable_copy(self, routed: CallRouted, submitted_seq: int) -> int:
        return await emit(self.js, routed.by_reference(submitted_seq))

    async def route(self, call_id: str, model: str, session: str) -> None:
        """As the router does: the fast copy first, then the durable one."""
        routed, seq = await self.submit(call_id, model, session)
        await self.fast_copy(routed)
        await self.durable_copy(routed, seq)

    async def reply(self, call_id: str, timeout: float = 60.0):
        return await asyncio.wait_for(self.replies[call_id].get(), timeout)


@pytest.fixture
async def stack(nats_url, tmp_path, monkeypatch):
    s = Stack(nats_url, tmp_path, monkeypatch)
    await s.start()
    try:
        yield s
    finally:
        await s.close()


def hold_completion_publish(monkeypatch, call_id: str):
    """The NATS pause as the agent sees it: the call's completion record does not get out
    until `resume` is set; `held` is set when the agent is waiting on it."""
    held, resume = asyncio.Event(), asyncio.Event()
    emit_real = record_sender.emit_async  # a completion's record is published from there

    async def paused_emit(js, event, *a, **k):
        if not (isinstance(event, CallCompleted) and event.call_id == call_id):
            return await emit_real(js, event, *a, **k)
        held.set()
        ack = asyncio.get_running_loop().create_future()

        async def after_the_pause():
            await resume.wait()
            try:
                ack.set_result(await (await emit_real(js, event, *a, **k)))
            except Exception as exc:
                ack.set_exception(exc)

        asyncio.ensure_future(after_the_pause())
        return ack

    monkeypatch.setattr(record_sender, "emit_async", paused_emit)
    return held, resume.set


def hold_engine_release(stack: Stack, call_id: str):
    """The engine thread stops inside the release of the finished call until resumed."""
    held, resume = threading.Event(), threading.Event()
    engine = stack.runner.engine
    finish = engine.finish

    def held_finish(seq):
        if seq.call_id == call_id and not resume.is_set():
            held.set()
            resume.wait(30)
        return finish(seq)

    engine.finish = held_finish
    loop = asyncio.get_running_loop()

    class Held:
        async def wait(self):
            await loop.run_in_executor(None, held.wait, 30)

    return Held(), resume.set


@pytest.mark.parametrize("window", ["completion publish", "engine release"])
async def test_a_durable_copy_arriving_while_its_call_finishes_is_acked_never_run_again(
        stack, monkeypatch, window):
    if window == "completion publish":
        held, resume = hold_completion_publish(monkeypatch, "x")
    else:
        held, resume = hold_engine_release(stack, "x")
    routed, seq = await stack.submit("x", "qwen3-tiny", "s-x")
    await stack.fast_copy(routed)
    await asyncio.wait_for(held.wait(), 60)  # x ran from its fast copy and is finishing
    routed_seq = await stack.durable_copy(routed, seq)  # ...when its durable copy comes
    await asyncio.wait_for(_durable_arrived(stack, "x"), 30)
    resume()
    assert isinstance(await stack.reply("x"), CallResult)
    # Later calls, one needing a model switch: had x been admitted again, it would have run
    # before the switch (its model is the active one).
    await stack.route("y", "gpt2-tiny", "s-y")
    assert isinstance(await stack.reply("y"), CallResult)
    await stack.route("z", "qwen3-tiny", "s-z")
    assert isinstance(await stack.reply("z"), CallResult)
    assert stack.prefilled["x"] == 1, "x ran again from its durable copy"
    assert stack.replies["x"].empty()  # one answer
    assert stack.copies["x"] == [False, True]
    await wait_until(lambda: acked(stack.js, f"agent-{AGENT}", routed_seq), "the durable copy acked")
    assert not stack.runner.engine.running and not list(stack.runner.core.live())


async def _durable_arrived(stack: Stack, call_id: str) -> None:
    while True:
        await stack.arrived.setdefault(call_id, asyncio.Event()).wait()
        if True in stack.copies.get(call_id, []):
            return
        stack.arrived[call_id].clear()


async def test_an_engine_entry_nobody_runs_cannot_wedge_the_agent(stack):
    # Warm up on qwen3-tiny, then leak an engine entry for it: no call of the runner or the
    # scheduler owns it (the kind of state a lost completion used to leave behind).
    await stack.route("w", "qwen3-tiny", "s-w")
    assert isinstance(await stack.reply("w"), CallResult)
    leak = Sequence(call_id="leaked", session_id="s-leak", model="qwen3-tiny", prompt_ids=[1, 2, 3], max_tokens=8)
    await asyncio.get_running_loop().run_in_executor(stack.runner.thread.executor, stack.runner.engine.prefill, [leak])
    assert leak in stack.runner.engine.running
    # A call for the other model needs a switch, which the engine refuses while it holds a call.
    await stack.route("y", "gpt2-tiny", "s-y")
    assert isinstance(await stack.reply("y", timeout=30), CallResult)
    assert leak not in stack.runner.engine.running


async def test_an_agent_whose_work_loop_dies_exits_rather_than_heartbeat_with_no_one_working(
        nats_url, tmp_path, monkeypatch):
    # Its heartbeats would keep the router placing calls on it, each waiting for its 504;
    # exiting non-zero lets the supervisor restart it (and the router fail its calls, 503).
    async def broken(self, stop):
        raise RuntimeError("work loop bug")

    monkeypatch.setattr(agent_service.CallRunner, "work_loop", broken)
    settings = Settings.of(nats_url=nats_url, data_dir=tmp_path, instance_id=AGENT, models=("qwen3-tiny",),
                        ablation="round-only")
    with pytest.raises(RuntimeError, match="work loop bug"):
        await asyncio.wait_for(agent_service.run(settings), 120)
