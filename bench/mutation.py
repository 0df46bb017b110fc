"""Mutation run over the pure cores: break one rule at a time, see whether a unit test notices.

    python bench/mutation.py                         # every area, 2 workers -> results/mutation.md
    python bench/mutation.py --area leases --area auth --workers 1
    python bench/mutation.py --list                  # the mutants, without running anything
    python bench/mutation.py --rev f33e018 --out /tmp/before.md   # the same run on an older commit

Why our own and not mutmut / cosmic-ray: the repository installs its folders under other
names (`talaria.shared` is `shared/`, `talaria.services` is `services/`), both tools copy
or rewrite modules by their import path, and what we want is narrower: a fixed list of
one-rule mutants over named functions, each run against only the unit tests of its area.

Mutants (AST level, one change each, at a fixed place; the list is a pure function of the
source, so two runs on the same commit try the same mutants in the same order):

    cmp        a comparison flipped at its boundary (< <=, > >=) or negated (== !=, in / not in, is / is not)
    bool-drop  one operand of `and` / `or` dropped (the other check alone)
    not-drop   `not x` -> `x`
    cond       an `if` / `while` / conditional-expression test that is no comparison negated
    minmax     min <-> max
    arith      + <-> -, * <-> /, // -> /, augmented assignments likewise
    term-zero  one term of a sum or difference dropped (`a + b` -> `a`, `b`)
    const      an integer operand of arithmetic, or a non-zero bound of a comparison, n -> n + 1
    ret-bool   `return True` <-> `return False`
    stmt-drop  a statement with an effect removed: a call, a store into an attribute or a
               subscript, an augmented assignment, `del`, `continue` / `break`, an early `return`

Left alone: docstrings, strings, annotations, default arguments, `assert`, `raise`, logging.

Each worker has its own copy of the tree (tracked files plus untracked ones git does not
ignore, or `git archive REV`), imports resolve to it (talaria/__init__.py puts the checkout
root on the package path), and a mutant is written into it, run with
`pytest -x -q <tests>` under a timeout (5 x the area's clean run, at least 20 s), then
restored. <tests> are the area's unit tests that execute the mutant's statement, as a traced
clean run of the area's tests found (a mutant no test executes survives without a run). A mutant is killed when the tests fail or time out, survived when they pass.

Equivalent mutants (no input can tell them from the original) are listed in EQUIVALENT with
the reason, matched by (file, function, kind, before, after); they count neither way.

Not in CI: a run takes minutes to hours (~1,100 mutants; 1-3 s each on an idle 2-core machine
per worker, up to 20 s when it is shared), so `--sample 3` is the quick look and `--recheck`
reruns only an earlier run's survivors. The report: results/mutation.md.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as futures
import datetime as dt
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Source:
    path: str  # relative to the repository root
    only: tuple[str, ...] = ()  # qualified names (Class.method, function, Class) to mutate; () = all
    skip: tuple[str, ...] = ()  # qualified names to leave alone


@dataclass(frozen=True)
class Area:
    name: str
    sources: tuple[Source, ...]
    tests: tuple[str, ...]


ROUTER_TESTS = ("tests/unit/router",)
AREAS: tuple[Area, ...] = (
    Area("router-costs", (Source("services/router/costs.py"),), ROUTER_TESTS),
    Area("leases", (Source("services/router/leases.py", skip=("LeaseBook.to_list",)),
                    Source("services/router/policy/soft_reservation.py")), ROUTER_TESTS),
    Area("router-fold", (Source("services/router/state.py", only=("RouterState",),
                                skip=("RouterState.to_dict", "RouterState.from_dict")),), ROUTER_TESTS),
    Area("scheduler", (Source("services/instance_agent/scheduler/admission.py", skip=("Selection",)),
                       Source("services/instance_agent/scheduler/cold_pool.py",
                              only=("ColdPool._select_p", "ColdPool._select_sp", "ColdPool._sp_eligible",
                                    "ColdPool._contended"))),
         ("tests/unit/scheduler",)),
    Area("hkvr", (Source("services/instance_agent/memory/hkvr_core.py"),
                  Source("services/instance_agent/memory/host_pages.py", only=("agreed_prefix",))),
         ("tests/unit/memory/test_memory_hkvr_core.py", "tests/unit/memory/test_hkvr_rules.py")),
    Area("bump", (Source("services/instance_agent/memory/bump.py"),),
         ("tests/unit/memory/test_memory_bump.py", "tests/unit/memory/test_bump_rules.py")),
    Area("idempotency", (Source("services/gateway/idempotency_rules.py"),
                         Source("services/gateway/idempotency.py",
                                only=("IdempotentCalls.left", "IdempotentCalls._orphan_after_grace"))),
         ("tests/unit/contract/test_idempotency_rules.py", "tests/unit/contract/test_idempotent_orphans.py",
          "tests/unit/contract/test_orphan_grace.py")),
    Area("auth", (Source("services/gateway/auth.py", skip=("http_middleware", "new_key")),),
         ("tests/unit/contract/test_security_rules.py", "tests/unit/contract/test_settings.py",
          "tests/unit/contract/test_auth_rules.py")),
    Area("projection", (Source("services/telemetry/store.py", only=("MemoryStore", "_MemoryBatch", "_Offset")),
                        Source("services/telemetry/projector.py",
                               only=("completed_values", "failed_values", "text_", "ts"))),
         ("tests/unit/telemetry",)),
)

# (file, function, kind, before, after) -> why no input tells the mutant from the original.
EQUIVALENT: dict[tuple[str, str, str, str, str], str] = {
    ("services/gateway/auth.py", "parse_key_entry", "bool-drop", "not sep or not rest", "(not rest)"):
        "str.partition leaves the tail empty whenever the separator is missing, so `not rest` "
        "already holds wherever `not sep` does",
    ("services/gateway/auth.py", "Unauthenticated.__init__", "stmt-drop", "super().__init__(message)", "pass"):
        "BaseException.__new__ already stores the constructor's arguments, so args and str() are "
        "the same without the call",
    ("services/gateway/auth.py", "client_session", "bool-drop", "prefix and session_id.startswith(prefix)",
     "(session_id.startswith(prefix))"):
        "with an empty prefix every id starts with it and session_id[0:] is session_id itself",
    ("services/telemetry/store.py", "_MemoryBatch._bump", "bool-drop", "at or dt.datetime.now(dt.timezone.utc)",
     "(at)"):
        "every caller passes ts() of an event's required time, never None, and a datetime is always true",
    ("services/router/costs.py", "CostModel.price_all", "bool-drop",
     'cfg.kv_home_admits and own and kv_state in ("device", "host") and k_have > 0',
     "(cfg.kv_home_admits and own and (k_have > 0))"):
        "the session's own KV found here (own) with tokens (k_have > 0) is only ever on device or host: "
        "the recompute and none branches leave k_have at 0",
    ("services/router/costs.py", "CostModel.replica_gain", "bool-drop",
     "res.weight_bytes and snap.staging_free_bytes >= res.weight_bytes",
     "(snap.staging_free_bytes >= res.weight_bytes)"):
        "with no weight bytes the halved price multiplies 0 GiB: the threshold is the same",
    # select() stops taking candidates once len(admitted) reaches min(free_slots, batch) and
    # names the reason itself, so _misses is only ever asked below both counts.
    ("services/instance_agent/scheduler/admission.py", "select", "minmax", "min", "max"):
        "with the larger bound, _misses refuses every candidate past the smaller one with the same "
        "reason select() would give (max_batch first): the same selection, only slower",
    ("services/instance_agent/scheduler/admission.py", "_misses", "cmp", "len(admitted) >= limits.free_slots",
     "(len(admitted) > limits.free_slots)"): "only reached with len(admitted) < free_slots",
    ("services/instance_agent/scheduler/admission.py", "_misses", "stmt-drop", 'return "max_batch"', "pass"):
        "only reached with len(admitted) < free_slots",
    ("services/instance_agent/scheduler/admission.py", "_misses", "cmp", "len(admitted) >= limits.batch",
     "(len(admitted) > limits.batch)"): "only reached with len(admitted) < batch",
    ("services/instance_agent/scheduler/admission.py", "_misses", "stmt-drop", 'return "batch"', "pass"):
        "only reached with len(admitted) < batch",
    # Cumulative prefix hashes put a hash at one position in every prefix, so the slice check
    # always finds it; its fallback, pre.hashes.index(h), finds the same page (only slower).
    ("services/instance_agent/memory/hkvr_core.py", "HkvrCore._unpublished", "cmp",
     "pre.hashes[position:position + 1] == (h,)", "(pre.hashes[position:position + 1] != (h,))"):
        "both branches give the position of h in the prefix: the fast path or pre.hashes.index(h)",
    ("services/instance_agent/memory/hkvr_core.py", "HkvrCore._unpublished", "term-zero", "position + 1",
     "(position)"): "an empty slice sends every lookup to pre.hashes.index(h), the same page",
    ("services/instance_agent/memory/hkvr_core.py", "HkvrCore._evict", "term-zero",
     "page.desc.committed_tokens // page.desc.page_size - 1", "(page.desc.committed_tokens // page.desc.page_size)"):
        "a wrong position hint only misses _unpublished's fast path; pre.hashes.index(h) finds the page",
    ("services/instance_agent/memory/hkvr_core.py", "HkvrCore._victim", "bool-drop",
     '(p := self.pages[k]).pins == 0 and p.state == "committed"', "((p := self.pages[k]).pins == 0)"):
        "a copying page holds its transfer pin until complete(), so pins == 0 already means committed",
    ("services/router/costs.py", "_static_terms", "bool-drop", 'snap.active_model or ""', "(snap.active_model)"):
        "queued.get(None) and queued.get('') are both None: no model is named ''",
    ("services/router/costs.py", "_static_terms", "bool-drop", "snap.active_model and not idle", "(not idle)"):
        "not idle means calls running or queued for the active model, so there is an active model",
    ("services/router/costs.py", "CostModel.price_all", "bool-drop",
     'kv is not None and kv.state != "none" and kv.state != "recompute"', "(kv is not None and kv.state != 'none')"):
        "a snapshot's SessionKv state is device, host or none (wire.KvState): never recompute",
    ("services/router/costs.py", "CostModel.price_all", "cmp", "k_have > known", "(k_have >= known)"):
        "the larger of two numbers: at equality either one is the same",
    ("services/router/costs.py", "CostModel.price_all", "bool-drop",
     "st.idle_active is not None and st.idle_active not in view.overlay_models",
     "(st.idle_active not in view.overlay_models)"): "_comeback of no model is 0 (no homes are kept under None)",
    ("services/router/costs.py", "CostModel.price_all", "bool-drop",
     "st.idle_active is not None and st.idle_active not in view.overlay_models", "(st.idle_active is not None)"):
        "a model routed here since the snapshot has its session running here (the same fold puts it in "
        "homes), and _comeback is 0 for a live model",
    ("services/router/costs.py", "_comeback", "bool-drop", "homes is None or not homes.idle_since",
     "(homes is None)"):
        "HomeBook never keeps a model's homes without a session (its _drop and prune delete the empty "
        "entry), so idle_since is never empty where homes exist",
    ("services/router/leases.py", "_drop", "bool-drop", "pos >= 0 and expiries[pos] == expires_at",
     "(expiries[pos] == expires_at)"):
        "pos is -1 only when expires_at is below every expiry, and then expiries[-1], the largest, "
        "cannot equal it",
    # RouterState._observed: the re-send fast path and the inherited lookup are caches.
    ("services/router/state.py", "RouterState._observed", "stmt-drop", "return", "pass"):
        "after restamp() took a re-send in place, building a fresh view from it (inheriting inflight "
        "and lookups) gives the same view (instances.py restamp's contract)",
    ("services/router/state.py", "RouterState._observed", "stmt-drop", "view.inherit_kv_index(old)", "pass"):
        "a cache: the KV lookup is rebuilt from the same snapshot sessions on first use",
    ("services/router/state.py", "RouterState._drop_lease", "bool-drop", "by_call is not None and lease.call_id == by_call",
     "(lease.call_id == by_call)"): "a lease's call id is never None, so with no by_call the test is false either way",
    ("services/instance_agent/memory/hkvr_core.py", "HkvrCore._publish", "cmp", "pre.published < len(pre.hashes)",
     "(pre.published <= len(pre.hashes))"): "at equality it queues an empty tail, which publishes nothing",
    ("services/instance_agent/memory/hkvr_core.py", "HkvrCore._unpublished", "term-zero", "position + 1", "(1)"):
        "a slice that misses sends the lookup to pre.hashes.index(h), the same page",
    ("services/instance_agent/memory/hkvr_core.py", "HkvrCore._victim", "bool-drop",
     'page.pins == 0 and page.state == "committed"', "(page.pins == 0)"):
        "a copying page holds its transfer pin until complete(), so pins == 0 already means committed",
    ("services/instance_agent/memory/host_pages.py", "agreed_prefix", "stmt-drop", "return n", "pass"):
        "the fast path's answer: without it the loop finds no disagreement and returns the same n",
}


# (file, function, statement's first line) -> why every mutant of that statement is equivalent.
DEAD_STATEMENTS: dict[tuple[str, str, str], str] = {
    ("services/instance_agent/scheduler/cold_pool.py", "ColdPool._select_p",
     "slot.prefill_left_s = max(0.0, slot.prefill_left_s - selection.cost_s)"):
        "a dead store: P selects once per slot (p_done) and a new slot starts from its plan's budget, "
        "so nothing reads prefill_left_s after this",
}

# --------------------------------------------------------------------------------------
# Mutants
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    area: str
    path: str
    func: str  # qualified name of the enclosing function
    line: int
    kind: str
    before: str  # the source segment replaced
    after: str  # its replacement
    start: tuple[int, int]  # (line, col) of the segment, 1-based line, 0-based col (utf-8 bytes)
    end: tuple[int, int]
    stmt_line: int = 0  # first line of the statement it sits in: a test that runs it may notice
    stmt_src: str = ""  # that line's text, stripped

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}:{self.kind}:{self.after}"

    def equivalent(self) -> str | None:
        return EQUIVALENT.get((self.path, self.func, self.kind, self.before, self.after)) or \
            DEAD_STATEMENTS.get((self.path, self.func, self.stmt_src))


_CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_ARITH_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div}
_LOGGERS = {"log", "logger", "logging", "self.log", "structlog"}


def _seg(lines: list[bytes], node: ast.AST) -> str:
    (l0, c0), (l1, c1) = (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)
    if l0 == l1:
        return lines[l0 - 1][c0:c1].decode()
    return (lines[l0 - 1][c0:] + b"".join(lines[l0:l1 - 1]) + lines[l1 - 1][:c1]).decode()


class _Collector(ast.NodeVisitor):
    def __init__(self, area: str, path: str, src: str, source: Source) -> None:
        self.area, self.path, self.source = area, path, source
        self.lines = src.encode().splitlines(keepends=True)
        self.scope: list[str] = []
        self.out: list[Mutant] = []
        self.stmt_line = 0

    def visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.stmt):
            outer, self.stmt_line = self.stmt_line, node.lineno
            try:
                super().visit(node)
            finally:
                self.stmt_line = outer
        else:
            super().visit(node)

    # ---- scope ----
    def _qual(self) -> str:
        return ".".join(self.scope)

    def _wanted(self) -> bool:
        q = self._qual()
        if not q:
            return False  # module level: constants and imports
        hit = lambda names: any(q == n or q.startswith(n + ".") for n in names)  # noqa: E731
        if self.source.only and not hit(self.source.only):
            return False
        return not hit(self.source.skip)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        for stmt in node.body:
            self.visit(stmt)
        self.scope.pop()

    def visit_FunctionDef(self, node) -> None:
        self.scope.append(node.name)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        for stmt in body:
            self.visit(stmt)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.visit(node.body)

    # ---- left alone ----
    def visit_Assert(self, node) -> None:
        pass

    def visit_Raise(self, node) -> None:
        pass

    def visit_JoinedStr(self, node) -> None:
        pass

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            if isinstance(node.target, (ast.Attribute, ast.Subscript)):
                self._stmt_drop(node)
            self.visit(node.value)

    # ---- emit ----
    def _add(self, node: ast.AST, kind: str, after: str, *, wrap: bool = True) -> None:
        if not self._wanted():
            return
        before = _seg(self.lines, node)
        if wrap:
            after = f"({after})"
        self.out.append(Mutant(self.area, self.path, self._qual(), node.lineno, kind, before, after,
                               (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset),
                               self.stmt_line or node.lineno,
                               self.lines[(self.stmt_line or node.lineno) - 1].decode().strip()))

    def _replace(self, node: ast.expr, kind: str, new: ast.expr) -> None:
        self._add(node, kind, ast.unparse(new))

    def _stmt_drop(self, node: ast.stmt) -> None:
        self._add(node, "stmt-drop", "pass", wrap=False)

    # ---- expressions ----
    def visit_Compare(self, node: ast.Compare) -> None:
        for x in (node.left, *node.comparators):
            if not (isinstance(x, ast.Constant) and x.value == 0):  # the boundary of 0 is `cmp`'s
                self._const(x)
        for i, op in enumerate(node.ops):
            swap = _CMP_SWAP.get(type(op))
            if swap is not None:
                ops = list(node.ops)
                ops[i] = swap()
                self._replace(node, "cmp", ast.Compare(node.left, ops, node.comparators))
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        for i in range(len(node.values)):
            rest = node.values[:i] + node.values[i + 1:]
            self._replace(node, "bool-drop", rest[0] if len(rest) == 1 else ast.BoolOp(node.op, rest))
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self._replace(node, "not-drop", node.operand)
        self.generic_visit(node)

    def _cond(self, test: ast.expr) -> None:
        if not isinstance(test, (ast.Compare, ast.BoolOp, ast.UnaryOp)):
            self._replace(test, "cond", ast.UnaryOp(ast.Not(), test))

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._cond(node.test)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            self._add(node.func, "minmax", "max" if node.func.id == "min" else "min", wrap=False)
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        swap = _ARITH_SWAP.get(type(node.op))
        if swap is not None and not _is_str(node):
            self._replace(node, "arith", ast.BinOp(node.left, swap(), node.right))
        if not _is_str(node):
            self._const(node.left)
            self._const(node.right)
        if isinstance(node.op, (ast.Add, ast.Sub)) and not _is_str(node):
            self._replace(node, "term-zero", node.left)
            if isinstance(node.op, ast.Add):
                self._replace(node, "term-zero", node.right)
        self.generic_visit(node)

    def _const(self, node: ast.expr) -> None:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            self._add(node, "const", repr(node.value + 1), wrap=False)

    # ---- statements ----
    def visit_If(self, node: ast.If) -> None:
        self._cond(node.test)
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        self._cond(node.test)
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, (ast.Call, ast.Await)) and not _is_log(node.value):
            self._stmt_drop(node)
        if not _is_log(node.value):
            self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(isinstance(t, (ast.Attribute, ast.Subscript)) for t in node.targets):
            self._stmt_drop(node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._stmt_drop(node)
        swap = _ARITH_SWAP.get(type(node.op))
        if swap is not None:
            self._add(node, "arith", ast.unparse(ast.AugAssign(node.target, swap(), node.value)), wrap=False)
        self.visit(node.value)

    def visit_Delete(self, node: ast.Delete) -> None:
        self._stmt_drop(node)

    def visit_Continue(self, node) -> None:
        self._stmt_drop(node)

    def visit_Break(self, node) -> None:
        self._stmt_drop(node)

    def visit_Return(self, node: ast.Return) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, bool):
            self._add(node.value, "ret-bool", repr(not node.value.value), wrap=False)
        if node.value is not None:
            self.visit(node.value)

    def generic_visit(self, node: ast.AST) -> None:
        for name, value in ast.iter_fields(node):
            if name in ("annotation", "returns", "decorator_list", "type_comment"):
                continue
            if isinstance(node, ast.arguments):
                continue  # defaults
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, ast.AST):
                        self._early_return(node, name, i, item)
                        self.visit(item)
            elif isinstance(value, ast.AST):
                self.visit(value)

    def _early_return(self, parent: ast.AST, field_name: str, i: int, item: ast.AST) -> None:
        # An early return (one inside a branch or a loop) is a rule: `if x: return ...`.
        if isinstance(item, ast.Return) and isinstance(parent, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            self._stmt_drop(item)


def _is_str(node: ast.BinOp) -> bool:
    return any(isinstance(x, (ast.JoinedStr,)) or (isinstance(x, ast.Constant) and isinstance(x.value, str))
               for x in (node.left, node.right))


def _is_log(node: ast.expr) -> bool:
    if isinstance(node, ast.Await):
        node = node.value
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    return ast.unparse(node.func.value) in _LOGGERS


def collect(root: Path, areas: tuple[Area, ...]) -> list[Mutant]:
    out: list[Mutant] = []
    for area in areas:
        for source in area.sources:
            file = root / source.path
            if not file.is_file():
                raise SystemExit(f"{area.name}: {source.path} does not exist (moved? update AREAS)")
            src = file.read_text()
            collector = _Collector(area.name, source.path, src, source)
            collector.visit(ast.parse(src))
            if not collector.out:
                raise SystemExit(f"{area.name}: no mutants in {source.path} {source.only or ''} (renamed?)")
            for m in collector.out:
                if _compiles(apply(src, m)):
                    out.append(m)
    seen, unique = set(), []
    for m in out:  # one mutant per resulting program
        key = (m.path, m.start, m.end, m.after)
        if key not in seen:
            seen.add(key)
            unique.append(m)
    return unique


def apply(src: str, m: Mutant) -> str:
    lines = src.encode().splitlines(keepends=True)
    (l0, c0), (l1, c1) = m.start, m.end
    head = b"".join(lines[:l0 - 1]) + lines[l0 - 1][:c0]
    tail = lines[l1 - 1][c1:] + b"".join(lines[l1:])
    return (head + m.after.encode() + tail).decode()


def _compiles(src: str) -> bool:
    try:
        compile(src, "<mutant>", "exec")
        return True
    except SyntaxError:
        return False


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


def make_copy(dest: Path, rev: str | None) -> None:
    dest.mkdir(parents=True)
    if rev:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "--hypothesis-seed=0", "-o", "addopts="]
# Imported once by each worker's server and inherited by every forked test run: the third-party
# part of a run's start-up. Of talaria only talaria.shared (below); each run imports services/
# (where every mutant is) afresh from the copy.
PRELOAD = ("pytest", "_pytest.python", "hypothesis", "pytest_asyncio", "asyncpg", "sqlalchemy",
           "sqlalchemy.dialects.postgresql", "sqlalchemy.ext.asyncio", "alembic.command", "alembic.config",
           "msgspec", "nats", "aiohttp", "aiohttp.web", "structlog", "structlog.dev", "rich", "numpy",
           "opentelemetry.sdk.trace", "torch", "safetensors", "tokenizers", "jinja2")


class LineTracer:
    """pytest plugin for the clean run: which tests execute which lines of the area's sources
    (setup and teardown included), so each mutant runs only the tests that reach it."""

    def __init__(self, files: list[str]) -> None:
        self.files = set(files)
        self.hits: dict[str, dict[int, set[str]]] = {f: {} for f in files}
        self.current: str | None = None

    def _local(self, frame, event, arg):
        if event == "line" and self.current is not None:
            self.hits[frame.f_code.co_filename].setdefault(frame.f_lineno, set()).add(self.current)
        return self._local

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename in self.files:
            if self.current is not None:  # the def line itself counts as running the function
                self.hits[frame.f_code.co_filename].setdefault(frame.f_lineno, set()).add(self.current)
            return self._local
        return None

    def pytest_runtest_protocol(self, item, nextitem):
        import threading

        self.current = item.nodeid
        sys.settrace(self._global)
        threading.settrace(self._global)
        return None  # the default protocol runs the test, traced

    def pytest_runtest_logfinish(self, nodeid, location):
        import threading

        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
        self.current = None


def serve() -> None:
    """A worker's test server (cwd: its copy). Each request {"tests", "timeout"} forks a child
    that runs pytest on the copy as it is now; the answer is {"status", "took"}."""
    import importlib
    import signal
    import threading

    copy = os.getcwd()
    sys.path.insert(0, copy)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # talaria.shared (and the embedded servers) hold no mutant (every area's sources are under
    # services/) and import nothing of services at import time: loaded once, from this copy.
    import pkgutil

    for info in pkgutil.walk_packages([str(Path(copy) / "shared")], prefix="talaria.shared."):
        try:
            importlib.import_module(info.name)
        except Exception:
            pass
    importlib.import_module("talaria.embedded")
    assert not any(n.startswith("talaria.services") for n in sys.modules), "a mutated package preloaded"
    assert sys.modules["talaria"].__file__.startswith(copy), "talaria resolves to another tree"
    log = Path(copy) / ".mutant.log"
    for line in sys.stdin:
        req = json.loads(line)
        shutil.rmtree(Path(copy) / ".hypothesis", ignore_errors=True)  # no example carried between mutants
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import pytest

            tracer = LineTracer([str(Path(copy) / f) for f in req["trace"]]) if req.get("trace") else None
            rc = int(pytest.main([*PYTEST_ARGS, *req["tests"]], plugins=[tracer] if tracer else []))
            if tracer is not None:
                Path(req["trace_out"]).write_text(json.dumps(
                    {f: {n: sorted(ids) for n, ids in lines.items()} for f, lines in tracer.hits.items()}))
            mod = sys.modules.get("talaria.services")
            if mod is not None and not str(getattr(mod, "__path__", [""])[0]).startswith(copy):
                rc = 99  # imported another tree's code: the result would mean nothing
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        timer = threading.Timer(req["timeout"], lambda: os.kill(pid, signal.SIGKILL))
        timer.start()
        _, status = os.waitpid(pid, 0)
        timer.cancel()
        took = time.monotonic() - t0
        if os.WIFSIGNALED(status):
            verdict = "timeout" if took >= req["timeout"] else f"error: signal {os.WTERMSIG(status)}"
        else:
            rc = os.WEXITSTATUS(status)
            verdict = {0: "survived", 1: "killed", 2: "killed", 3: "killed"}.get(rc)
            if verdict is None:
                verdict = f"error rc={rc}: {log.read_text()[-600:]}"
        print(json.dumps({"status": verdict, "took": took}), flush=True)


class Worker:
    """One copy of the tree; mutants are written into it one at a time and restored."""

    def __init__(self, base: Path, k: int, rev: str | None) -> None:
        self.copy = base / f"w{k}"
        make_copy(self.copy, rev)
        self.stamp = time.time() - 10_000  # mtimes that only move forward: never a stale .pyc
        self.server: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONHASHSEED="0")
        env.pop("PYTHONPATH", None)
        self.server = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"], cwd=self.copy,
                                       env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stdin.close()
            self.server.wait()

    def tests(self, tests, timeout: float, trace: list[str] | None = None) -> tuple[str, float]:
        present = [t for t in tests if (self.copy / t.split("::")[0]).exists()]
        if not present:
            return "survived", 0.0  # no unit test reaches it: nothing can notice
        assert self.server is not None and self.server.stdin is not None and self.server.stdout is not None
        req = {"tests": present, "timeout": timeout}
        if trace:
            req.update(trace=trace, trace_out=str(self.copy / ".trace.json"))
        self.server.stdin.write(json.dumps(req) + "\n")
        self.server.stdin.flush()
        answer = json.loads(self.server.stdout.readline())
        return answer["status"], answer["took"]

    def _write(self, path: Path, text: str) -> None:
        path.write_text(text)
        self.stamp += 2
        os.utime(path, (self.stamp, self.stamp))

    def baseline(self, area: Area) -> tuple[float, dict[str, dict[int, list[str]]]]:
        """The clean run, traced: (its time, {source: {line: [test ids that ran it]}})."""
        sources = sorted({s.path for s in area.sources})
        if not any((self.copy / t).exists() for t in area.tests):
            return 0.0, {f: {} for f in sources}
        status, took = self.tests(area.tests, timeout=3600, trace=sources)
        if status != "survived":
            raise SystemExit(f"{area.name}: the unmutated tests do not pass ({status})")
        raw = json.loads((self.copy / ".trace.json").read_text())
        return took, {f: {int(n): ids for n, ids in raw[str(self.copy / f)].items()} for f in sources}

    def run(self, m: Mutant, tests: tuple[str, ...], timeout: float) -> tuple[Mutant, str, float]:
        file = self.copy / m.path
        original = file.read_text()
        try:
            self._write(file, apply(original, m))
            status, took = self.tests(tests, timeout)
        finally:
            self._write(file, original)
        return m, status, took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--area", action="append", help="only these areas (repeatable); default all")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rev", help="run on this commit (git archive) instead of the working tree")
    ap.add_argument("--list", action="store_true", help="print the mutants and stop")
    ap.add_argument("--out", default=str(ROOT / "results" / "mutation.md"))
    ap.add_argument("--json", help="also write every mutant's outcome here")
    ap.add_argument("--sample", type=int, default=1, metavar="N",
                    help="every N-th mutant of each area only (deterministic; for a quick look)")
    ap.add_argument("--recheck", metavar="JSON",
                    help="the mutants of this earlier --json output that still exist (matched by file, function, "
                         "kind and text, so moved lines still match): its survivors run again, the rest keep "
                         "their outcome")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="no run: the report of earlier --json outputs (later files win per area)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve()
        return 0
    names = {a.name for a in AREAS}
    for n in args.area or ():
        if n not in names:
            ap.error(f"unknown area {n!r}; areas: {', '.join(sorted(names))}")
    areas = tuple(a for a in AREAS if not args.area or a.name in args.area)

    if args.merge:
        results, wall = [], 0.0
        by_area: dict[str, list] = {}
        for name in args.merge:
            data = json.loads(Path(name).read_text())
            wall += data["wall_s"]
            for area_name in {r["area"] for r in data["mutants"]}:
                by_area[area_name] = [r for r in data["mutants"] if r["area"] == area_name]
        for rows in by_area.values():
            for r in rows:
                results.append((Mutant(r["area"], r["path"], r["func"], r["line"], r["kind"], r["before"],
                                       r["after"], (0, 0), (0, 0), 0, r.get("stmt_src", "")), r["status"], 0.0))
        areas = tuple(a for a in areas if a.name in by_area)
        Path(args.out).write_text(render(areas, results, args, wall))
        print(Path(args.out).read_text())
        return 0

    base = Path(tempfile.mkdtemp(prefix="talaria-mutation-"))
    try:
        workers = [Worker(base, k, args.rev) for k in range(max(1, args.workers))]
        mutants = collect(workers[0].copy, areas)
        kept: list[tuple[Mutant, str, float]] = []
        if args.recheck:
            # The earlier run's mutants (its sample) that still exist; its survivors run again.
            earlier = json.loads(Path(args.recheck).read_text())["mutants"]
            status = dict(zip(_ordinal([(r["path"], r["func"], r["kind"], r["before"], r["after"]) for r in earlier]),
                              (r["status"] for r in earlier)))
            rerun = []
            for m, key in zip(mutants, _ordinal([_key(m) for m in mutants])):
                st = status.get(key)
                if st == "survived":
                    rerun.append(m)
                elif st is not None:
                    kept.append((m, st, 0.0))
            gone = len(status) - len(rerun) - len(kept)
            print(f"recheck: {len(rerun)} survivors run again, {len(kept)} kept, {gone} no longer in the code")
            mutants = rerun
        elif args.sample > 1:
            mutants = [m for a in areas for m in [x for x in mutants if x.area == a.name][::args.sample]]
        if args.list:
            for m in mutants:
                print(f"{m.area:13} {m.path}:{m.line} [{m.kind}] {m.before!r} -> {m.after!r}")
            print(f"{len(mutants)} mutants")
            return 0
        for w in workers:
            w.start()
        results: list[tuple[Mutant, str, float]] = []
        t_start = time.monotonic()
        for area in areas:
            todo = [m for m in mutants if m.area == area.name]
            if not todo:
                continue
            clean, reach = workers[0].baseline(area)
            timeout = max(20.0, 5 * clean)
            print(f"{area.name}: {len(todo)} mutants, tests {clean:.1f} s clean (traced), timeout {timeout:.0f} s",
                  flush=True)

            def reached(m: Mutant, reach=reach) -> list[str]:
                lines = reach[m.path]
                return sorted(set(lines.get(m.stmt_line, ())) | set(lines.get(m.line, ())))
            free: queue.SimpleQueue[Worker] = queue.SimpleQueue()
            for w in workers:
                free.put(w)

            def one(m: Mutant, timeout=timeout) -> tuple[Mutant, str, float]:
                tests = reached(m)
                if not tests:
                    return m, "survived", 0.0  # no test runs this line
                w = free.get()  # a copy runs one mutant at a time
                try:
                    return w.run(m, tuple(tests), timeout)
                finally:
                    free.put(w)

            with futures.ThreadPoolExecutor(len(workers)) as pool:
                jobs = [pool.submit(one, m) for m in todo]
                for i, job in enumerate(jobs, 1):
                    m, status, took = job.result()
                    results.append((m, status, took))
                    if i % 25 == 0 or i == len(jobs):
                        print(f"  {i}/{len(jobs)} ({time.monotonic() - t_start:.0f} s)", flush=True)
                    if status != "killed":
                        print(f"  {status:8} {m.path}:{m.line} [{m.kind}] {m.before!r} -> {m.after!r}", flush=True)
        wall = time.monotonic() - t_start
        results += kept
        order = {_key(m): i for i, m in enumerate(collect(workers[0].copy, areas))}
        results.sort(key=lambda r: order.get(_key(r[0]), 0))
    finally:
        for w in locals().get("workers", []):
            w.stop()
        shutil.rmtree(base, ignore_errors=True)
    report = render(areas, results, args, wall)
    Path(args.out).write_text(report)
    print(report)
    if args.json:
        Path(args.json).write_text(json.dumps({"wall_s": wall, "sample": args.sample, "rev": args.rev, "mutants": [
            dict(area=m.area, path=m.path, line=m.line, func=m.func, kind=m.kind, before=m.before,
                 after=m.after, stmt_src=m.stmt_src, status=s) for m, s, _ in results]}, indent=1))
    errors = [m for m, s, _ in results if s.startswith("error")]
    return 1 if errors else 0


def render(areas, results, args, wall: float) -> str:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.rev or "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    dirty = "" if args.rev or not subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                                                 capture_output=True, text=True).stdout else " (+ uncommitted changes)"
    cmd = "python bench/mutation.py" + "".join(f" --area {a}" for a in args.area or ()) + \
        (f" --rev {args.rev}" if args.rev else "") + (f" --workers {args.workers}" if args.workers != 2 else "") + \
        (f" --sample {args.sample}" if args.sample > 1 else "") + \
        (" --merge " + " ".join(args.merge) if args.merge else "") + \
        (f" --recheck {args.recheck}" if args.recheck else "")
    lines = [
        "# Mutation run over the pure cores",
        "",
        f"`{cmd}` on {head}{dirty}, {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{wall / 60:.1f} min with {args.workers} worker(s). What the mutants are and how they run: "
        "the docstring of bench/mutation.py.",
        "",
        "Score = killed / (mutants - equivalent). A timeout counts as killed.",
        "",
        "| area | sources | tests | mutants | killed | timeout | survived | equivalent | score |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    total = [0, 0, 0, 0, 0]
    for area in areas:
        rs = [(m, s) for m, s, _ in results if m.area == area.name]
        eq = sum(1 for m, s in rs if s == "survived" and m.equivalent())
        killed = sum(1 for _, s in rs if s == "killed")
        timeout = sum(1 for _, s in rs if s == "timeout")
        survived = sum(1 for m, s in rs if s == "survived" and not m.equivalent())
        denom = len(rs) - eq
        score = f"{100 * (killed + timeout) / denom:.0f} %" if denom else "-"
        srcs = ", ".join(Path(s.path).name + (f" ({', '.join(s.only)})" if s.only else "") for s in area.sources)
        tests = ", ".join(t.removeprefix("tests/unit/") for t in area.tests)
        lines.append(f"| {area.name} | {srcs} | {tests} | {len(rs)} | {killed} | {timeout} | {survived} | {eq} | {score} |")
        for i, v in enumerate((len(rs), killed, timeout, survived, eq)):
            total[i] += v
    n, k, t, s, e = total
    lines.append(f"| **all** | | | {n} | {k} | {t} | {s} | {e} | "
                 f"{100 * (k + t) / (n - e):.0f} % |" if n - e else "| all | | | 0 | | | | | - |")
    survivors = [(m, s) for m, s, _ in results if s == "survived" and not m.equivalent()]
    lines += ["", "## Survivors", ""]
    if not survivors:
        lines.append("None.")
    for m, _ in survivors:
        lines.append(f"- {m.area}: `{m.path}:{m.line}` ({m.func}) [{m.kind}] `{_one_line(m.before)}` -> `{_one_line(m.after)}`")
    equivalents = [m for m, s, _ in results if s == "survived" and m.equivalent()]
    lines += ["", "## Equivalent mutants (survive by construction)", ""]
    if not equivalents:
        lines.append("None.")
    for m in equivalents:
        lines.append(f"- {m.area}: `{m.path}:{m.line}` ({m.func}) [{m.kind}] `{_one_line(m.before)}` -> "
                     f"`{_one_line(m.after)}`: {m.equivalent()}")
    errors = [(m, s) for m, s, _ in results if s.startswith("error")]
    if errors:
        lines += ["", "## Errors (the run itself failed)", ""]
        lines += [f"- `{m.path}:{m.line}` [{m.kind}]: {s}" for m, s in errors]
    return "\n".join(lines) + "\n"


def _key(m: Mutant) -> tuple[str, str, str, str, str]:
    return (m.path, m.func, m.kind, m.before, m.after)


def _ordinal(keys: list[tuple]) -> list[tuple]:
    """Each key with its occurrence number, so the same text twice in a function is two mutants."""
    seen: dict[tuple, int] = {}
    out = []
    for k in keys:
        seen[k] = seen.get(k, 0) + 1
        out.append((*k, seen[k]))
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("`", "'")


if __name__ == "__main__":
    sys.exit(main())
