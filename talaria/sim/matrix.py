"""`talaria sim experiments matrix`: every policy on a grid of generated agent workloads.

Design (one factor at a time around a base, every level of every factor present):

    base      depth ~30 calls, prompt ~25K, output ~250, paper gaps, Poisson arrivals,
              3 equal models, 4 instances; swept over offered load 30/60/80/100/120 %
    variants  each other level of one factor (depth 5/100, prompt 8K/100K, output 50/1,000,
              heavy-tailed gaps, bursts, 20 Zipf models, 1/16 instances), at 60 % and 100 %
    WEKA      the shipped sessions: the fixed replay (30 model-sessions at t=0, one
              paper TP=8 server) and the router testbed (TP=4 models, 2 instances, high load)

Workloads come from `workloads.agent_sessions` (seeded; cell k uses seed `seed + k`).

Capacity. An instance's capacity is the session throughput it sustains if every call finds
its reusable prefix on device and no model switch is ever paid (a work-conserving upper
bound, so 100 % is the most a perfect session-aware policy could carry): a session's work
is sum over its calls of prefill(new tokens on top of the reusable prefix) + output tokens
x decode step at the saturated batch / batch, where the saturated batch is min(max_batch,
KV pool tokens / mean context). capacity = instances / mean session work (sessions/s);
a cell at load L starts sessions at L x capacity. Switches, recompute after a move and
queueing are what a policy loses against this bound.

Policies: the four baselines (least-pressure, session-sticky, prefix-aware, kv-cost, each
with its documented defaults), `talaria` (our configuration) and `talaria-paper` (the same
policy under the paper's rules: Eq. 1 ranking only, the paper's admission, fixed tau,
reject on overload). Runs go to a process pool (2 workers by default: this machine's cores).
"""

from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from talaria.services.router.policy.base import PolicyConfig
from talaria.sim.cluster import RunConfig, simulate
from talaria.sim.executor import instance_config
from talaria.shared.stats import quantile
from talaria.sim.metrics import summarise
from talaria.sim.profiles import PAPER_TP8, ROUTER_TP4, ServerProfile, catalogue
from talaria.sim.workloads import agent_sessions, at_rate, fixed_replay, router_testbed
from talaria.traces.format import Session
from talaria.traces.gaps import GapModel

BASELINES = ("least-pressure", "session-sticky", "prefix-aware", "kv-cost")
OURS = "talaria"
PAPER = "talaria-paper"
POLICIES = (*BASELINES, OURS, PAPER)
BASE_LOADS = (0.3, 0.6, 0.8, 1.0, 1.2)
VARIANT_LOADS = (0.6, 1.0)
VARIANTS = (
    ("depth", 5), ("depth", 100), ("prompt", 8_000), ("prompt", 100_000), ("output", 50), ("output", 1_000),
    ("gaps", "heavy"), ("arrivals", "bursts"), ("catalogue", 20), ("instances", 1), ("instances", 16),
)
SESSIONS_PER_INSTANCE = 4  # [asm] sessions per instance per unit load (run-time bound)
MIN_SESSIONS = 20  # so that p95 is not one session's luck


@dataclass(frozen=True)
class Cell:
    name: str
    depth: int = 30
    prompt: int = 25_000
    output: int = 250
    gaps: str = "paper"
    arrivals: str = "poisson"
    catalogue: int = 3  # 3 equal models, or N Zipf(1) models
    instances: int = 4
    load: float | None = 0.6  # None: a closed WEKA replay (no arrival rate)
    seed: int = 0
    weka: str = ""  # "" (generated) | fixed-replay | router-testbed

    @property
    def sessions(self) -> int:
        if self.load is None:
            return 30
        return max(MIN_SESSIONS, math.ceil(SESSIONS_PER_INSTANCE * self.instances * self.load))


def cells(seed: int = 0) -> list[Cell]:
    out = [Cell(f"base@{int(L * 100)}%", load=L) for L in BASE_LOADS]
    for factor, level in VARIANTS:
        for L in VARIANT_LOADS:
            out.append(Cell(f"{factor}={level}@{int(L * 100)}%", load=L, **{factor: level}))
    out = [replace(c, seed=seed + k) for k, c in enumerate(out)]
    out.append(Cell("weka fixed replay (1 inst, t=0)", instances=1, load=None, weka="fixed-replay", seed=seed))
    out.append(Cell("weka router testbed (2 inst, high)", instances=2, load=None, weka="router-testbed",
                    seed=seed))
    return out


def server_for(cell: Cell) -> ServerProfile:
    if cell.weka == "router-testbed":
        return ROUTER_TP4
    return PAPER_TP8 if cell.catalogue == 3 else catalogue(PAPER_TP8, cell.catalogue)


def session_work_s(session: Session, server: ServerProfile, max_batch: int) -> float:
    """Server seconds one session needs at saturation (module doc: capacity)."""
    mp = server.model(session.model)
    pool_tokens = server.kv_pool_bytes(mp.name) // mp.kv_bytes_per_token
    ctx = sum(c.prompt_tokens + c.output_tokens / 2 for c in session.calls) / len(session.calls)
    batch = max(1, min(max_batch, int(pool_tokens // max(1.0, ctx))))
    per_token = mp.decode_step_s(batch, int(batch * ctx)) / batch
    return sum(mp.prefill_s(c.new_tokens, c.reusable_prefix_tokens) + c.output_tokens * per_token
               for c in session.calls)


def capacity_s(sessions: list[Session], server: ServerProfile, instances: int, max_batch: int) -> float:
    """Sessions per second the cluster sustains at the bound (module doc)."""
    mean_work = sum(session_work_s(s, server, max_batch) for s in sessions) / len(sessions)
    return instances / mean_work


def workload(cell: Cell, flags) -> tuple[list[Session], GapModel, dict]:
    """The cell's sessions, the gap model to replay them with, and what was measured."""
    if cell.weka == "fixed-replay":
        return fixed_replay(), GapModel("paper", 10.0, seed=cell.seed), {"arrival_rate_s": None}
    if cell.weka == "router-testbed":
        return router_testbed("high"), GapModel("paper", 10.0, seed=cell.seed), {"arrival_rate_s": None}
    server = server_for(cell)
    base = agent_sessions(cell.sessions, list(server.models), cell.depth, cell.prompt, cell.output, cell.gaps,
                          cell.arrivals, 0.0 if cell.catalogue == 3 else 1.0, cell.seed)
    cap = capacity_s(base, server, cell.instances, flags.max_batch)
    rate = cell.load * cap
    calls = [c for s in base for c in s.calls]
    shape = {
        "capacity_sessions_s": cap, "arrival_rate_s": rate,
        "depth_p50": quantile([len(s.calls) for s in base], 0.5),
        "prompt_p50": quantile([c.prompt_tokens for c in calls], 0.5),
        "output_p50": quantile([c.output_tokens for c in calls], 0.5),
        "gaps_over_5s": sum(1 for c in calls if c.call_index and c.gap_before_s > 5) / max(1, len(calls) - len(base)),
    }
    return at_rate(base, rate), GapModel("recorded", None), shape


# Flatness around the constants our configuration still has: each at half and double.
SENSITIVITY = tuple(f"{OURS}[{knob}={v:g}]" for knob, base in (
    ("new_session_backlog_weight", 2.0), ("new_session_running_s", 1.0), ("lease_charge_s", 0.25),
) for v in (base / 2, base * 2))


def policy_config(policy: str) -> tuple[str, PolicyConfig]:
    """(registry name, config) of a matrix policy; `talaria[knob=value]` is our
    configuration with one knob changed (the sensitivity runs)."""
    if policy.startswith(f"{OURS}[") and policy.endswith("]"):
        knob, value = policy[len(OURS) + 1:-1].split("=")
        return "talaria", replace(policy_config(OURS)[1], **{knob: float(value)})
    if policy == PAPER:
        return "talaria", PolicyConfig(overload="reject", kv_home_admits=False, new_session_backlog_weight=1.0,
                                       new_session_running_s=0.0, prefix_placement=False,
                                       price_round_sharing=False)
    if policy == OURS:
        return "talaria", PolicyConfig(overload="queue")
    return policy, PolicyConfig()


KEEP = ("sct_p50", "sct_p95", "ttft_p50", "ttft_p95", "goodput_calls_s", "rejected", "retries", "gave_up",
        "sessions_incomplete", "avoidable_cold_opens", "calls", "sessions", "complete", "sim_wall_s")


def run_one(cell: Cell, policy: str) -> dict:
    flags = instance_config("talaria")
    sessions, gaps, shape = workload(cell, flags)
    name, pc = policy_config(policy)
    cfg = RunConfig(server_for(cell), cell.instances, name, pc, flags, gaps, label=f"{cell.name}/{policy}")
    started = time.perf_counter()
    s = summarise(simulate(sessions, cfg))
    out = {k: s[k] for k in KEEP}
    out["run_s"] = time.perf_counter() - started
    out["shape"] = shape
    return out


def _task(args: tuple[Cell, str]) -> tuple[str, str, dict]:
    cell, policy = args
    return cell.name, policy, run_one(cell, policy)


def run_matrix(policies=POLICIES, seed: int = 0, workers: int = 2, only: list[str] | None = None) -> dict:
    grid = [c for c in cells(seed) if not only or any(o in c.name for o in only)]
    # the costliest first, so the two workers finish together
    tasks = sorted(((c, p) for c in grid for p in policies),
                   key=lambda t: -(t[0].sessions * t[0].depth * (t[0].instances ** 0.5)))
    results: dict[str, dict] = {c.name: {} for c in grid}
    started = time.perf_counter()
    if workers <= 1:
        done = map(_task, tasks)
    else:
        pool = ProcessPoolExecutor(workers)
        done = pool.map(_task, tasks, chunksize=1)
    for k, (cell_name, policy, res) in enumerate(done, 1):
        results[cell_name][policy] = res
        print(f"  matrix [{k}/{len(tasks)}] {cell_name} / {policy}: SCT p95 {res['sct_p95']:.1f} s, "
              f"rejected {res['rejected']}, {res['run_s']:.1f} s", file=sys.stderr, flush=True)
    if workers > 1:
        pool.shutdown()
    return {
        "experiment": "matrix", "seed": seed, "workers": workers, "wall_s": time.perf_counter() - started,
        "policies": list(policies), "baselines": [p for p in policies if p in BASELINES], "ours": OURS,
        "cells": [{**asdict(c), "sessions": c.sessions, "results": results[c.name]} for c in grid],
        "cpu_count": os.cpu_count(),
    }


# ---- win table and goals ------------------------------------------------------------------


def _ratio(a, b):
    if a is None or b is None or b == 0 or (isinstance(a, float) and math.isinf(a)):
        return math.inf
    return a / b


def wins(matrix: dict) -> dict:
    """Per cell: talaria vs the best baseline at SCT p50 and p95 (ratio < 1: talaria wins);
    over the matrix: the geometric mean of talaria's p95 over each baseline's, the goals."""
    rows, per_baseline = [], {b: [] for b in matrix["baselines"]}
    for cell in matrix["cells"]:
        res = cell["results"]
        ours = res.get(OURS)
        if ours is None:
            continue
        base = {b: res[b] for b in matrix["baselines"] if b in res}
        best50 = min(base, key=lambda b: _num(base[b]["sct_p50"]))
        best95 = min(base, key=lambda b: _num(base[b]["sct_p95"]))
        r50 = _ratio(ours["sct_p50"], base[best50]["sct_p50"])
        r95 = _ratio(ours["sct_p95"], base[best95]["sct_p95"])
        load = cell["load"]
        loaded = load is not None and not (isinstance(load, float) and math.isnan(load))
        best_goodput = max(_num(base[b]["goodput_calls_s"], -1) for b in base)
        row = {
            "cell": cell["name"], "load": load, "best_p50": best50, "best_p95": best95, "ratio_p50": r50,
            "ratio_p95": r95, "rejected": ours["rejected"], "gave_up": ours["gave_up"],
            "goodput_ratio": _ratio(ours["goodput_calls_s"], best_goodput),
            "ok_sct": r50 <= 1.02 and r95 <= 1.02,
            "ok_reject": not (loaded and load <= 1.0 + 1e-9) or ours["rejected"] == 0,
            "ok_goodput": not (loaded and load > 1.0) or _num(ours["goodput_calls_s"], -1) >= best_goodput,
        }
        if PAPER in res:
            row["paper_ratio_p95"] = _ratio(res[PAPER]["sct_p95"], base[best95]["sct_p95"])
            row["paper_rejected"] = res[PAPER]["rejected"]
        rows.append(row)
        for b in base:
            per_baseline[b].append(_ratio(ours["sct_p95"], base[b]["sct_p95"]))
    geo = {b: _geomean(v) for b, v in per_baseline.items() if v}
    best_single = max(geo, key=geo.get) if geo else None  # the baseline talaria gains least on
    return {
        "rows": rows, "geomean_p95_vs": geo, "best_single_baseline": best_single,
        "goals": {
            "cells": len(rows),
            "sct_within_2pct": sum(r["ok_sct"] for r in rows),
            "zero_rejections_le_100": sum(r["ok_reject"] for r in rows),
            "goodput_at_120": sum(r["ok_goodput"] for r in rows),
            "mean_p95_vs_best_single": geo.get(best_single) if best_single else None,
        },
    }


def _num(x, default=math.inf):
    return default if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _geomean(v):
    v = [x for x in v if x is not None and math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else math.inf


def win_table(matrix: dict) -> str:
    w = wins(matrix)
    lines = [
        "| cell | load | talaria SCT p50 / best baseline | ratio | talaria SCT p95 / best baseline | ratio | "
        "rejected (ours / paper rules) | goodput vs best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_name = {c["name"]: c for c in matrix["cells"]}
    for r in w["rows"]:
        res = by_name[r["cell"]]["results"]
        o = res[OURS]
        load = "closed" if r["load"] is None or (isinstance(r["load"], float) and math.isnan(r["load"])) \
            else f"{r['load'] * 100:.0f} %"
        mark = lambda ok: "" if ok else " ✗"  # noqa: E731
        lines.append(
            f"| {r['cell']} | {load} | {_s(o['sct_p50'])} / {_s(res[r['best_p50']]['sct_p50'])} ({r['best_p50']}) | "
            f"{_x(r['ratio_p50'])}{mark(r['ratio_p50'] <= 1.02)} | {_s(o['sct_p95'])} / "
            f"{_s(res[r['best_p95']]['sct_p95'])} ({r['best_p95']}) | {_x(r['ratio_p95'])}{mark(r['ratio_p95'] <= 1.02)} | "
            f"{r['rejected']}{mark(r['ok_reject'])} / {r.get('paper_rejected', '—')} | "
            f"{_x(r['goodput_ratio'])}{mark(r['ok_goodput'])} |")
    g = w["goals"]
    geo = ", ".join(f"{b} {_x(v)}" for b, v in w["geomean_p95_vs"].items())
    lines += [
        "",
        f"Goals over {g['cells']} cells: SCT p50 and p95 within 2 % of the best baseline in "
        f"{g['sct_within_2pct']}; zero rejections at <= 100 % load in {g['zero_rejections_le_100']}; "
        f"goodput >= the best baseline's at 120 % in {g['goodput_at_120']} (cells below 120 % count as met). "
        f"Geometric mean of talaria's SCT p95 over each baseline's: {geo} "
        f"(goal: <= 0.90x the best single baseline, {w['best_single_baseline']}).",
    ]
    return "\n".join(lines)


def _s(x) -> str:
    return "∞" if x is None or (isinstance(x, float) and math.isinf(x)) else f"{x:.1f}"


def _x(x) -> str:
    return "∞" if x is None or math.isinf(x) else f"{x:.2f}×"


def heat_map(matrix: dict, path: Path) -> str:
    """SCT p95 of every policy in every cell over the cell's best policy (log colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    pols = [p for p in matrix["policies"] if not p.startswith(f"{OURS}[")]
    names = [c["name"] for c in matrix["cells"]]
    grid = np.full((len(names), len(pols)), np.nan)
    for i, c in enumerate(matrix["cells"]):
        vals = [_num(c["results"].get(p, {}).get("sct_p95")) for p in pols]
        best = min([v for v in vals if 0 < v < math.inf] or [1.0])
        for j, v in enumerate(vals):
            grid[i, j] = min(v / best, 4.0) if math.isfinite(v) else 4.0
    fig, ax = plt.subplots(figsize=(1.3 * len(pols) + 3, 0.32 * len(names) + 1.5))
    im = ax.imshow(np.log2(grid), cmap="RdYlGn_r", vmin=0, vmax=2, aspect="auto")
    ax.set_xticks(range(len(pols)), pols, rotation=30, ha="right")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    for i in range(len(names)):
        for j in range(len(pols)):
            ax.text(j, i, "∞" if grid[i, j] >= 4.0 else f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=6)
    fig.colorbar(im, ax=ax, label="log2(SCT p95 / best policy in the cell); 2 = 4x or gave up")
    ax.set_title("Workload matrix: SCT p95 relative to the cell's best policy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path.name


def sensitivity(matrix: dict) -> list[dict]:
    """Per sensitivity variant: geometric mean and worst cell of its SCT p50/p95 over ours."""
    rows = []
    for variant in [p for p in matrix["policies"] if p.startswith(f"{OURS}[")]:
        r50, r95 = [], []
        for cell in matrix["cells"]:
            res = cell["results"]
            if variant in res and OURS in res:
                r50.append(_ratio(res[variant]["sct_p50"], res[OURS]["sct_p50"]))
                r95.append(_ratio(res[variant]["sct_p95"], res[OURS]["sct_p95"]))
        fin = [x for x in r95 if math.isfinite(x)]
        rows.append({"variant": variant, "geomean_p50": _geomean(r50), "geomean_p95": _geomean(r95),
                     "worst_p95": max(fin) if fin else math.inf, "best_p95": min(fin) if fin else math.inf,
                     "cells": len(r95)})
    return rows


def sensitivity_table(matrix: dict) -> list[str]:
    rows = sensitivity(matrix)
    if not rows:
        return []
    return ["Sensitivity: our configuration with one remaining constant halved or doubled, over the same "
            "cells (ratio to our configuration; 1.00× = flat):", "",
            "| variant | SCT p50 (geomean) | SCT p95 (geomean) | SCT p95 best / worst cell | cells |",
            "|---|---|---|---|---|",
            *[f"| {r['variant']} | {_x(r['geomean_p50'])} | {_x(r['geomean_p95'])} | {_x(r['best_p95'])} / "
              f"{_x(r['worst_p95'])} | {r['cells']} |" for r in rows], ""]


POLICY_NOTES = """\
What each policy models (all see the same snapshots; every simulated call carries the block
hashes the gateway would compute, so the prefix index is real; a 503 is retried by the agent):

- least-pressure: the paper's least-loaded worker (§5.3): the instance with the least work
  queued or running; blind to sessions, KV and residency.
- session-sticky: the paper's sticky baseline: a session stays on the instance of its first
  call (least-pressure for that first call).
- prefix-aware: SGLang router's cache-aware policy with its defaults (cache threshold 0.5,
  balance thresholds 32 / 1.0001) over the router's prefix index; the match rate is judged over
  the ~12.5K tokens the index covers.
- kv-cost: Dynamo's KV router cost (overlap weight 1: prefill blocks not cached + active
  blocks), a host-tier block at half a miss, session affinity with a 30 s idle TTL.
- talaria-paper: Algorithm 1 with Eq. 1 / Eq. 2 as the paper writes them, its admission rule,
  fixed tau = 1 s, reject on overload (503 + Retry-After).
- talaria: ours: the same plus a return admitted where its KV is, first calls priced for
  their session, prefix placement, decode priced by the models it shares rounds with, and
  queueing past admission (reject only when every instance already holds
  max_queued_per_instance = 64 calls, the scheduler's batch bound; the 503 says why).
"""


def matrix_section(matrix: dict) -> list[str]:
    """The report's matrix section (sim_report.md)."""
    head = (__doc__ or "").split("\n\n", 1)[1].strip()
    return [
        "## Workload matrix", "",
        f"`talaria sim experiments matrix --sensitivity` ({sum(1 for c in matrix['cells'] if not c.get('weka'))} "
        f"generated cells + {sum(1 for c in matrix['cells'] if c.get('weka'))} WEKA cells x "
        f"{len([p for p in matrix['policies'] if not p.startswith(OURS + '[')])} policies in "
        f"{matrix['wall_s']:.0f} s wall with {matrix['workers']} worker processes on the shared 2-core machine"
        + (f"; the {len(SENSITIVITY)} sensitivity variants took another {matrix['sensitivity_wall_s']:.0f} s"
           if matrix.get("sensitivity_wall_s") else "") + "). Most cells have 20 sessions, so a cell's p95 "
        "is its 19th-slowest session: single cells are noisy (see the best / worst cells of the sensitivity "
        "table) and the geometric means over the matrix are the robust numbers.", "",
        "```", head, "```", "", POLICY_NOTES,
        win_table(matrix), "",
        "![matrix heat map](matrix_heatmap.png)", "",
        *sensitivity_table(matrix),
        "Measured workload shape per cell (median depth / prompt / output, share of gaps > 5 s, "
        "capacity estimate):", "",
        "| cell | sessions | depth p50 | prompt p50 | output p50 | gaps > 5 s | capacity (sessions/s) |",
        "|---|---|---|---|---|---|---|",
        *[_shape_row(c) for c in matrix["cells"]], "",
    ]


def _shape_row(cell: dict) -> str:
    any_res = next(iter(cell["results"].values()), {})
    sh = any_res.get("shape") or {}
    if not sh.get("capacity_sessions_s"):
        return f"| {cell['name']} | {any_res.get('sessions', '—')} | WEKA | WEKA | WEKA | — | — |"
    return (f"| {cell['name']} | {any_res.get('sessions')} | {sh['depth_p50']} | {sh['prompt_p50']} | "
            f"{sh['output_p50']} | {sh['gaps_over_5s'] * 100:.0f} % | {sh['capacity_sessions_s']:.3f} |")


def write_outputs(matrix: dict, out_dir: Path) -> Path:
    from talaria.sim.experiments import write_json

    write_json({**matrix, "wins": wins(matrix)}, out_dir / "matrix.json")
    heat_map(matrix, out_dir / "matrix_heatmap.png")
    md = out_dir / "matrix.md"
    md.write_text("# Workload matrix: talaria vs the best baseline per cell\n\n"
                  "Ratio = talaria / best baseline (below 1: talaria is faster); ✗ marks a missed goal.\n\n"
                  + win_table(matrix) + "\n\n![heat map](matrix_heatmap.png)\n\n"
                  + "\n".join(sensitivity_table(matrix)))
    return md
