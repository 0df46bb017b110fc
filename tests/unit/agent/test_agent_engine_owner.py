"""The engine is an actor (engine_thread.py): code off its thread never reads its tables. It hands
the engine work (`EngineThread.run` / `call`) and reads the `EngineView` published after each
(engine_view.py). A lint over the agent's modules, not a runtime check: it covers every path,
the error paths tests never take included, and costs nothing live.

It fails on any use of an engine's attribute in the agent's modules but: handing a method to the
engine thread (`thread.run(engine.decode, ...)`, `.call(...)`), what is fixed once the engine is
built (FIXED), and the functions that run on the engine thread (ON_ENGINE_THREAD). An engine held
under another name than `engine` / `store` escapes it (test_agent_engine_protocol.py forbids probing)."""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parents[3] / "services" / "instance_agent"
# The engine's own packages run on its thread (engine/, memory/); the scheduler is pure.
MODULES = sorted(AGENT.glob("*.py")) + sorted((AGENT / "scheduler").glob("*.py"))

# Set when the engine is built and never changed: read from any thread.
FIXED = {
    "capabilities",  # Capabilities, frozen (vLLM sets it while it loads, before the agent starts)
    "specs",  # the served models' shapes
    "page_size", "kv_bytes_per_token", "page_hashes",  # PageStore: a model's page shape (and keys: pure)
    "should_yield",  # set once by EngineThread before any work (a threading.Event's is_set)
}
# Functions whose body runs on the engine thread.
ON_ENGINE_THREAD = {"_build_engine", "_step_and_release", "_finish_quietly", "_then_publish", "view_of",
                    "reusable_kv"}
# EngineThread.run / .call, and EngineSteps._step (it hands its step to `run`): the first
# argument runs on the engine thread.
HAND_OFF = {"run", "call", "_step"}


def _is_engine(node: ast.expr) -> bool:
    """`engine`, `store`, `self.engine`, `self.thread.engine`, `self.store`: an engine the agent holds."""
    return (isinstance(node, ast.Name) and node.id in ("engine", "store")) or (
        isinstance(node, ast.Attribute) and node.attr in ("engine", "store"))


def off_thread_reads(source: str, name: str = "<src>") -> list[str]:
    """`name:line engine.attr` for each use of an engine attribute off the engine thread."""
    tree = ast.parse(source)
    handed, exempt = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HAND_OFF:
            handed.update(id(a) for a in node.args[:1])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ON_ENGINE_THREAD:
            exempt.update(id(n) for n in ast.walk(node))
    return [f"{name}:{node.lineno} engine.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _is_engine(node.value) and node.attr not in FIXED
            and id(node) not in handed and id(node) not in exempt]


def test_no_agent_module_reads_the_engines_tables_off_its_thread():
    assert len(MODULES) > 10, "found too few agent modules: the scan is broken"
    found = [hit for path in MODULES for hit in off_thread_reads(path.read_text(), path.name)]
    assert not found, f"engine state read off the engine thread (hand it to EngineThread.call, or read the view): {found}"


def test_the_lint_tells_a_hand_off_from_a_read():
    src = """
async def step(self, seqs):
    out = await self.thread.run(self.engine.decode, seqs)
    cap = self.engine.capabilities
    return self.engine.stats(), engine.active_model, self.thread.engine.session_states()

def _step_and_release(self, seq):
    self.engine.finish(seq)
"""
    assert sorted(off_thread_reads(src)) == ["<src>:5 engine.active_model", "<src>:5 engine.session_states",
                                             "<src>:5 engine.stats"]
