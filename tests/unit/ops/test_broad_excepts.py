"""Broad handlers (`except Exception`, bare `except`) in services/ stay few, and each is at a
service's boundary: it logs, re-raises (translated), or says in a `noqa: BLE001` comment why it
may stay quiet. Bus and database failures are caught by name (shared/bus.py BUS_ERRORS,
shared/db/connection.py DB_ERRORS); anything else is a bug and propagates (issue 36)."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[3] / "services"
MOST = 30
LOG_CALLS = {"debug", "info", "warning", "error", "exception", "critical"}


def _broad(handler: ast.ExceptHandler) -> bool:
    return handler.type is None or (isinstance(handler.type, ast.Name) and handler.type.id == "Exception")


def _accounted(handler: ast.ExceptHandler, line: str) -> bool:
    if "noqa: BLE001" in line:
        return True
    for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_CALLS:
            return True
    return False


def broad_handlers() -> list[tuple[str, int, bool]]:
    """(file, line, accounted for) of each broad handler under services/."""
    out = []
    for path in sorted(SERVICES.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ExceptHandler) and _broad(node):
                out.append((str(path.relative_to(SERVICES.parent)), node.lineno,
                            _accounted(node, lines[node.lineno - 1])))
    return out


def test_broad_handlers_are_few():
    found = broad_handlers()
    assert len(found) <= MOST, f"{len(found)} broad handlers in services/ (at most {MOST}): " + \
        ", ".join(f"{f}:{n}" for f, n, _ in found)


def test_each_broad_handler_logs_raises_or_says_why():
    quiet = [f"{f}:{n}" for f, n, accounted in broad_handlers() if not accounted]
    assert not quiet, "broad handlers that swallow silently: " + ", ".join(quiet)


def test_the_lint_sees_a_silent_handler():
    tree = ast.parse("try:\n    pass\nexcept Exception:\n    pass\n")
    handler = tree.body[0].handlers[0]
    assert _broad(handler) and not _accounted(handler, "except Exception:")
