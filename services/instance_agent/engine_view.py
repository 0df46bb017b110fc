"""EngineView: what the engine publishes after every piece of work on its thread (engine_thread.py),
a frozen value the event loop reads freely: the snapshot's residency, memory and session KV, and
where a routed call's KV is. The engine's own tables are read on its thread only.

`view_of` is engine-thread code: it reads the tables to build the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from talaria.services.instance_agent.engine.admission import common_prefix
from talaria.services.instance_agent.engine.contract import Engine, EngineStats

Key = tuple[str, str]  # (session_id, model)


@dataclass(frozen=True, slots=True)
class EngineView:
    active_model: str | None
    stats: EngineStats  # built fresh by the engine for this view; nobody changes it
    sessions: tuple[tuple[str, str, str, int], ...]  # Engine.session_states()
    device: Mapping[Key, tuple[int, ...]]  # Engine.device_tokens(), read-only
    block_tokens: int = 1  # Capabilities.kv_block_tokens: device KV is reused in whole blocks
    states: Mapping[Key, str] = field(default_factory=dict)  # 'device' | 'host', from `sessions`

    def kv_state(self, session_id: str, model: str) -> str:
        """As Engine.kv_state: 'device', 'host' or 'none'."""
        return self.states.get((session_id, model), "none")

    def device_prefix(self, session_id: str, model: str, prompt_ids) -> int:
        """As Engine.device_prefix: leading prompt tokens the session's device KV holds."""
        held = self.device.get((session_id, model))
        if held is None:
            return 0
        return common_prefix(held, tuple(prompt_ids)) // self.block_tokens * self.block_tokens

    def reusable(self, session_id: str, model: str, prompt_tokens: int, prompt_ids=None) -> tuple[str, int]:
        """(where the session's KV is, how many prompt tokens of it can be reused); at least
        the last prompt token is always computed, so it yields the first logits. With
        `prompt_ids`, device KV counts only as far as it matches the prompt: a prompt that
        does not extend the last one would otherwise be priced (and chunked) as almost free."""
        state = self.kv_state(session_id, model)
        if state == "none":
            return "none", 0
        if state == "device" and prompt_ids is not None:
            held = self.device_prefix(session_id, model, prompt_ids)
        else:
            held = max((n for s, m, st, n in self.sessions if s == session_id and m == model and st == state),
                       default=0)
        return state, min(held, prompt_tokens - 1)


def view_of(engine: Engine, frozen: dict | None = None) -> EngineView:
    """The engine's view now (engine thread only). `frozen` (the caller's, kept between
    views): each session's held token list and its tuple, so a list is copied once; the
    engine replaces a session's list when its KV changes, never changes it."""
    sessions = tuple(engine.session_states())
    states: dict[Key, str] = {}
    for s, m, st, _ in sessions:
        states.setdefault((s, m), st)  # device entries come first, as Engine.kv_state prefers them
    memo = frozen if frozen is not None else {}
    device = {}
    for key, tokens in engine.device_tokens().items():
        known = memo.get(key)
        if known is None or known[0] is not tokens:
            known = memo[key] = (tokens, tuple(tokens))
        device[key] = known[1]
    for key in [k for k in memo if k not in device]:
        del memo[key]
    return EngineView(engine.active_model, engine.stats(), sessions, MappingProxyType(device),
                      engine.capabilities.kv_block_tokens, MappingProxyType(states))


def reusable_kv(engine: Engine, session_id: str, model: str, prompt_tokens: int,
                prompt_ids=None) -> tuple[str, int]:
    """`EngineView.reusable` on `engine` now: for its own thread, or an engine no thread drives
    (benchmarks, tests)."""
    return view_of(engine).reusable(session_id, model, prompt_tokens, prompt_ids)
