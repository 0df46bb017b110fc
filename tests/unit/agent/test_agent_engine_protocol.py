"""The agent drives its engine through the `Engine` Protocol alone (engine/contract.py): every
attribute the agent's modules read or set on an engine is a member of the Protocol, and none is
probed with getattr/hasattr. An engine adapter that implements the Protocol is then enough."""

from __future__ import annotations

import ast
from pathlib import Path

from talaria.services.instance_agent.engine import contract

AGENT = Path(__file__).resolve().parents[3] / "services" / "instance_agent"


def protocol_members() -> set[str]:
    tree = ast.parse(Path(contract.__file__).read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)} | {
        n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


def _is_engine(node: ast.expr) -> bool:
    """`engine`, `self.engine`, `x.engine`, `self.thread.engine`: an engine the agent holds."""
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine")


def engine_uses() -> dict[str, set[str]]:
    """Attribute names used on an engine, per agent module (the engine package itself aside)."""
    uses: dict[str, set[str]] = {}
    for path in sorted(AGENT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _is_engine(node.value):
                uses.setdefault(path.name, set()).add(node.attr)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr", "setattr"):
                assert not (node.args and _is_engine(node.args[0])), f"{path.name}: probes the engine"
    return uses


def test_the_agent_uses_only_what_the_engine_protocol_declares():
    members = protocol_members()
    uses = engine_uses()
    assert uses, "found no engine use: the scan is broken"
    stray = {module: sorted(names - members) for module, names in uses.items() if names - members}
    assert not stray, f"engine attributes used outside the Protocol: {stray}"


def test_the_torch_engine_implements_the_protocol():
    from talaria.services.instance_agent.engine.torch_engine import TorchEngine

    members = protocol_members() - {"capabilities", "specs", "should_yield"}  # set in __init__
    assert all(callable(getattr(TorchEngine, m, None)) or isinstance(getattr(TorchEngine, m, None), property)
               for m in members), sorted(m for m in members if not hasattr(TorchEngine, m))
