"""The engine as an actor (engine_thread.py): work runs on its one thread, and after each piece
the thread publishes a frozen `EngineView` (engine_view.py), the only engine state the loop reads."""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import FrozenInstanceError

import pytest

from talaria.services.instance_agent.engine import EngineError, Sequence
from talaria.services.instance_agent.engine_thread import EngineThread
from talaria.services.instance_agent.watchdog import Watchdog
from talaria.shared.tokenizer import encode

PROMPT = encode("Read the issue, run the tests, patch the bug. " * 3)


async def test_each_piece_of_work_publishes_a_new_frozen_view(make_engine):
    eng = make_engine(["qwen3-tiny"])
    with ThreadPoolExecutor(max_workers=1) as executor:
        thread = EngineThread(eng, executor, Watchdog())
        first = thread.view
        assert first.sessions == () and first.kv_state("s1", "qwen3-tiny") == "none"
        await thread.call(eng.generate, Sequence("c1", "s1", "qwen3-tiny", PROMPT, 4))
        after = thread.view
        assert after is not first and after.kv_state("s1", "qwen3-tiny") == "device"
        assert first.kv_state("s1", "qwen3-tiny") == "none"  # an old view never changes
        state, reusable = after.reusable("s1", "qwen3-tiny", len(PROMPT) + 8, PROMPT)
        assert (state, reusable) == ("device", len(PROMPT))
        with pytest.raises(FrozenInstanceError):
            after.active_model = None
        with pytest.raises(TypeError):
            after.device[("s1", "qwen3-tiny")] = ()  # read-only


async def test_work_that_fails_still_publishes_the_view_it_leaves(make_engine):
    eng = make_engine(["qwen3-tiny"])
    with ThreadPoolExecutor(max_workers=1) as executor:
        thread = EngineThread(eng, executor, Watchdog())
        before = thread.view
        with pytest.raises(EngineError):
            await thread.call(eng.finish, Sequence("never", "s1", "qwen3-tiny", PROMPT, 4))  # never admitted
        assert thread.view is not before
