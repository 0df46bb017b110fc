"""The layers as the design draws them, read from the source: the wire layer (shared/) imports
no service and nothing of the command line or simulator above it."""

from __future__ import annotations

from bench.structure_counts import ROOT, import_graph, module_name, source_files


def test_the_wire_layer_imports_no_service():
    graph, _, _ = import_graph(source_files())
    shared = {module_name(p) for p in (ROOT / "shared").rglob("*.py")}
    upward = {(m, t) for m in shared for t in graph[m]
              if t.startswith(("talaria.services", "talaria.sim", "talaria.cli", "talaria.stack"))}
    assert not upward
