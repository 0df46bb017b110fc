"""The layers as the design draws them, read from the source: the wire layer (shared/) imports
no service and nothing of the command line or simulator above it; there are no import cycles;
the environment is read in one place; in the instance agent one call has three shapes and
one table by call id."""

from __future__ import annotations

import ast

from bench.structure_counts import (
    ROOT, call_id_maps, call_shapes, cycles, import_graph, module_name, source_files,
)


def test_the_wire_layer_imports_no_service():
    graph, _, _ = import_graph(source_files())
    shared = {module_name(p) for p in (ROOT / "shared").rglob("*.py")}
    upward = {(m, t) for m in shared for t in graph[m]
              if t.startswith(("talaria.services", "talaria.sim", "talaria.cli", "talaria.stack"))}
    assert not upward


def test_there_are_no_import_cycles():
    """Not even through imports inside functions or under TYPE_CHECKING (the graph has them all)."""
    graph, _, _ = import_graph(source_files())
    assert cycles(graph) == []


def _reads_environment(tree: ast.Module) -> list[int]:
    """Lines that read a variable from the environment (`os.environ.get`, `os.getenv`,
    `os.environ[...]`); handing the whole environment to a child process is not a read."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func)
            if target in ("os.environ.get", "os.getenv", "environ.get"):
                lines.append(node.lineno)
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            if isinstance(node.ctx, ast.Load):
                lines.append(node.lineno)
    return lines


def test_the_environment_is_read_in_one_place():
    """Every TALARIA_* variable is read by `Settings.from_env` (shared/settings.py), so each has
    one parser, one validation and one error message naming it."""
    readers = {}
    for path in source_files():
        if path == ROOT / "shared" / "settings.py":
            continue
        lines = _reads_environment(ast.parse(path.read_text()))
        if lines:
            readers[str(path.relative_to(ROOT))] = lines
    assert not readers, readers


def test_no_module_rewrites_its_globals_at_run_time():
    """Configuration is a value handed in (a service's settings, a connection's Deployment),
    never a module global set at start: no `global` statement, no `globals()` write."""
    found = {}
    for path in source_files():
        tree = ast.parse(path.read_text())
        lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Global)
                 or (isinstance(n, ast.Call) and ast.unparse(n.func) == "globals")]
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, found


def test_one_call_in_the_agent_has_three_shapes_and_one_table():
    """The core's record, the runner's transport and the engine's sequence; the core's table
    is the only thing indexed by call id (an engine is handed sequences, never ids)."""
    assert call_shapes() == ["AgentCall", "CallTransport", "Sequence"]
    assert call_id_maps() == ["calls"]
