"""The matrix's report: the win table (talaria vs the best baseline per cell), the heat map,
the sensitivity of the remaining constants, and the section of results/sim_report.md.
The runs themselves are `matrix.py`."""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import fields
from pathlib import Path

from talaria.sim.result_json import write_json
from talaria.sim import matrix as matrix_design
from talaria.sim.matrix import ABLATIONS, FORECAST_POOLS, NO_LEASE, OURS, PAPER, ROUND_ONLY, SENSITIVITY

GEOMEAN_GOAL = 0.85  # issue 21: geomean SCT p95 <= 0.85x the best single peer
# What each ablation takes away (the mechanism that wins a cell is the one whose removal
# costs the most there)
MECHANISM = {PAPER: "router rules beyond the paper", NO_LEASE: "soft leases",
             ROUND_ONLY: "instance mechanisms (SP, HKVR, staging, parked KV)",
             # the inverse ablation: pools the peers' exact forecast sizes in place of talaria's
             # online ones; "wins" where the online pools beat the forecast
             FORECAST_POOLS: "online hot pools (vs the exact split)"}

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
        costs = {a: _ratio(res[a]["sct_p95"], ours["sct_p95"]) for a in ABLATIONS if a in res}
        if costs:
            top = max(costs, key=lambda a: _num(costs[a]))
            row["mechanism"] = (MECHANISM[top], costs[top]) if costs[top] > 1.0 else ("none", costs[top])
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
        "| cell | load | talaria SCT p50 / best peer | ratio | talaria SCT p95 / best peer | ratio | "
        "rejected (ours / paper rules) | goodput vs best | mechanism that wins it: talaria vs its own ablations "
        "(the costliest one's SCT p95 / talaria's) |",
        "|---|---|---|---|---|---|---|---|---|",
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
            f"{_x(r['goodput_ratio'])}{mark(r['ok_goodput'])} | {_mech(r)} |")
    g = w["goals"]
    geo = ", ".join(f"{b} {_x(v)}" for b, v in w["geomean_p95_vs"].items())
    lines += [
        "",
        f"Goals over {g['cells']} cells: SCT p50 and p95 within 2 % of the best peer in "
        f"{g['sct_within_2pct']}; zero rejections at <= 100 % load in {g['zero_rejections_le_100']}; "
        f"goodput >= the best peer's at 120 % in {g['goodput_at_120']} (cells below 120 % count as met). "
        f"Geometric mean of talaria's SCT p95 over each peer's: {geo} "
        f"(goal: <= {GEOMEAN_GOAL:.2f}x the best single peer, {w['best_single_baseline']}).",
    ]
    return "\n".join(lines)


def miss_table(matrix: dict) -> str:
    """Each cell where talaria is more than 2 % behind the best peer at SCT p50 or p95, and why,
    as far as this run's ablations say: a quantile the exact split recovers is the
    online pools' cost; one no ablation recovers is placement among the cell's instances, set
    beside how far the peers themselves spread at that quantile (a miss inside that spread is
    which policy this draw of sessions happened to favour, not a rule any peer has and talaria
    lacks); the room is the zero-wait bound (matrix.zero_wait_scts) over the best peer."""
    lines = ["| cell | misses | why (from this run) | peers' own spread (worst / best peer) | "
             "room: zero-wait bound / best peer (p50 / p95) |", "|---|---|---|---|---|"]
    by_name = {c["name"]: c for c in matrix["cells"]}
    for r in wins(matrix)["rows"]:
        if r["ok_sct"]:
            continue
        cell = by_name[r["cell"]]
        res = cell["results"]
        peers = [res[b] for b in matrix["baselines"] if b in res]
        design = matrix_design.Cell(**{f.name: cell[f.name] for f in fields(matrix_design.Cell) if f.name in cell})
        serverless = design.models > design.instances
        misses, why, spread = [], [], []
        for q, ratio in (("p50", r["ratio_p50"]), ("p95", r["ratio_p95"])):
            if ratio <= 1.02:
                continue
            key = f"sct_{q}"
            best = min(_num(p[key]) for p in peers)
            misses.append(f"{q} {_x(ratio)}")
            spread.append(f"{q} {_x(max(_num(p[key]) for p in peers) / best)}")
            forecast = res.get(FORECAST_POOLS)
            f = _num(forecast[key]) / best if forecast is not None else math.inf
            if serverless:
                why.append(f"{q}: placement and rotation over instances that time-share models")
            elif f <= 1.02:
                why.append(f"{q}: online pools (with the exact split {_x(f)})")
            elif f < ratio - 0.02:
                why.append(f"{q}: online pools (with the exact split {_x(f)}) and placement in a "
                           f"model's pool")
            else:
                why.append(f"{q}: placement in a model's pool (no ablation recovers it)")
        zw = cell.get("zero_wait")
        best50 = res[r["best_p50"]]["sct_p50"]
        best95 = res[r["best_p95"]]["sct_p95"]
        room = f"{_x(zw['sct_p50'] / best50)} / {_x(zw['sct_p95'] / best95)}" if zw else "— (closed replay)"
        lines.append(f"| {r['cell']} | {', '.join(misses)} | {'; '.join(why)} | {', '.join(spread)} | {room} |")
    return "\n".join(lines)


def _mech(row: dict) -> str:
    m = row.get("mechanism")
    return "—" if m is None else f"{m[0]} ({_x(m[1])})"


def side_by_side(matrix: dict, old: dict | None) -> str:
    """Talaria / best baseline per cell: the transplanted baselines (model-blind, every
    instance time-sharing every model, output length known to every policy) beside the
    faithful peers deployed as they are deployed."""
    if not old:
        return ""
    ow = {r["cell"]: r for r in wins(old)["rows"]}
    nw = {r["cell"]: r for r in wins(matrix)["rows"]}
    lines = ["| cell | old: p50 ratio (best transplanted) | old: p95 ratio | new: p50 ratio (best peer) | "
             "new: p95 ratio |", "|---|---|---|---|---|"]
    for name, r in nw.items():
        o = ow.get(name)
        old_cols = (f"{_x(o['ratio_p50'])} ({o['best_p50']}) | {_x(o['ratio_p95'])}" if o else "— (new cell) | —")
        lines.append(f"| {name} | {old_cols} | {_x(r['ratio_p50'])} ({r['best_p50']}) | {_x(r['ratio_p95'])} |")
    og, ng = wins(old)["goals"], wins(matrix)["goals"]
    lines += ["", f"Geometric mean of talaria's SCT p95 over the best single baseline: transplanted "
                  f"{_x(og['mean_p95_vs_best_single'] or math.inf)} ({wins(old)['best_single_baseline']}), "
                  f"faithful peers {_x(ng['mean_p95_vs_best_single'] or math.inf)} "
                  f"({wins(matrix)['best_single_baseline']})."]
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
hashes the gateway would compute, so the prefix index is real; a 503 is retried by the agent).
The peers are deployed as each is deployed (talaria/sim/deployment.py): per-model hot pools
split by offered demand where the models fit the instances, serverless on-demand loading
where they do not. Talaria runs every instance as its own cold-pool agent.

- round-robin: cycles through the model's instances.
- sglang-cache-aware: SGLang model gateway's cache-aware policy with its current defaults
  (cache threshold 0.3, balance 64 / 1.5; a miss goes to the least-loaded worker).
- dynamo-kv: Dynamo's KV router: overlap weight 1 x (the worker's pending prefill + this
  request's uncached) blocks + its in-flight blocks, deduplicated by block hash; host hits 0.75;
  argmin, random ties.
- llm-d: the inference scheduler's default profile as shipped: prefix 3 (its scorer sees a
  prompt's first 256 blocks x 16 tokens), queue 2, KV utilisation 2, max-score picker
  (llm-d-affinity, a labelled variant, adds model affinity 1).
- vllm-stack-session: production-stack session routing: a consistent hash ring on the session.
- talaria: ours; where the models fit, its router sizes the hot pools online from measured
  demand (services/router/hot_pools.py), from an even split, never the peers' forecast.
  Ablations, one mechanism each: talaria-paper (the router rules beyond the paper off: Eq. 1
  ranking only, the paper's admission, reject on overload), talaria-no-lease (tau = 0),
  talaria-round-only (the instance's SP, HKVR, staging and parked KV off), and
  talaria-forecast-pools (the peers' exact forecast pools in place of its online ones).
"""


def matrix_section(matrix: dict) -> list[str]:
    """The report's matrix section (sim_report.md)."""
    head = inspect.cleandoc(matrix_design.cells.__doc__ or "")  # the grid's design (matrix.py `cells`)
    return [
        "## Workload matrix", "",
        f"`talaria sim experiments matrix --ablations` ({sum(1 for c in matrix['cells'] if not c.get('weka'))} "
        f"generated cells + {sum(1 for c in matrix['cells'] if c.get('weka'))} WEKA cells x "
        f"{len([p for p in matrix['policies'] if not p.startswith(OURS + '[')])} policies"
        + (f" x seeds {', '.join(map(str, matrix['matrix']['seeds']))} (the table below is seed "
           f"{matrix['seed']}; results/matrix.md has the means over the seeds)" if matrix.get("matrix") else "")
        + " in "
        f"{matrix['wall_s']:.0f} s wall with {matrix['workers']} worker processes on the shared 2-core machine"
        + (f"; the {len(SENSITIVITY)} sensitivity variants took another {matrix['sensitivity_wall_s']:.0f} s"
           if matrix.get("sensitivity_wall_s") else "") + "). Most cells have 20 sessions, so a cell's p95 "
        "is its 19th-slowest session: single cells are noisy (see the best / worst cells of the sensitivity "
        "table) and the geometric means over the matrix are the robust numbers; matrix_seeds.md "
        "(`python bench/matrix_seeds.py`) runs the same grid over 8 workload seeds.", "",
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


# Student's t, two-sided 95 %, by degrees of freedom (seeds - 1); 1.96 past the table.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _ci(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % t interval of the mean of per-seed values."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = T95.get(n - 1, 1.96) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def across_seeds(matrix: dict) -> dict:
    """Per cell over the seeds of `matrix["matrix"]`: talaria's mean SCT p50 / p95 over the best
    peer's mean, and the 95 % interval of the per-seed ratio to that peer (an interval holding
    1.00 says the difference is noise); the geometric mean of talaria's mean p95 over each peer's;
    the online pools' cost, talaria / talaria-forecast-pools (the exact split) per cell and seed."""
    runs = matrix["matrix"]["runs"]
    peers = matrix["baselines"]
    names = [c["name"] for c in runs[0]["cells"]]
    by = [{c["name"]: c["results"] for c in r["cells"]} for r in runs]
    rows, per_peer = [], {p: [] for p in peers}
    pools = []
    for name in names:
        res = [b[name] for b in by if OURS in b.get(name, {})]
        if not res:
            continue
        row = {"cell": name}
        for q in ("sct_p50", "sct_p95"):
            means = {p: sum(_num(r[p][q]) for r in res) / len(res) for p in peers if all(p in r for r in res)}
            best = min(means, key=means.get)
            ours = sum(_num(r[OURS][q]) for r in res) / len(res)
            ratio = _ratio(ours, means[best])
            per_seed = [_ratio(r[OURS][q], r[best][q]) for r in res]
            _, lo, hi = _ci(per_seed) if all(map(math.isfinite, per_seed)) else (0, math.inf, math.inf)
            row[q] = {"ours": ours, "best": best, "best_mean": means[best], "ratio": ratio, "ci": (lo, hi),
                      "noise": lo <= 1.0 <= hi, "ok": ratio <= 1.02}
            if q == "sct_p95":
                for p in means:
                    per_peer[p].append(_ratio(ours, means[p]))
        rows.append(row)
        for seed, r in zip([x["seed"] for x in runs], res):
            if FORECAST_POOLS in r:
                pools.append((name, seed, _ratio(r[OURS]["sct_p95"], r[FORECAST_POOLS]["sct_p95"])))
    seed_geo = {p: [] for p in peers}  # each seed's geomean over cells: the interval of the geomean
    for b in by:
        for p in peers:
            seed_geo[p].append(_geomean([_ratio(b[n][OURS]["sct_p95"], b[n][p]["sct_p95"]) for n in names
                                         if OURS in b.get(n, {}) and p in b[n]]))
    return {"seeds": matrix["matrix"]["seeds"], "rows": rows,
            "geomean_p95_vs": {p: (_geomean(v), *_ci(seed_geo[p])[1:]) for p, v in per_peer.items() if v},
            "pools": pools}


def seeds_table(matrix: dict) -> str:
    a = across_seeds(matrix)
    n = len(a["seeds"])
    lines = [f"## Across {n} held-out seeds ({', '.join(map(str, a['seeds']))})", "",
             f"Means over the seeds; the best peer is the one with the lowest mean. The interval is the 95 % "
             f"t interval (n = {n}) of the per-seed ratio talaria / that peer: one holding 1.00 says the "
             "difference is noise at this many seeds. ✗: mean more than 2 % behind.", "",
             "| cell | talaria SCT p50 / best peer (means) | ratio | 95 % CI | talaria SCT p95 / best peer (means) "
             "| ratio | 95 % CI |", "|---|---|---|---|---|---|---|"]
    for r in a["rows"]:
        cols = []
        for q in ("sct_p50", "sct_p95"):
            x = r[q]
            mark = "" if x["ok"] else (" ✗ (noise)" if x["noise"] else " ✗")
            cols.append(f"{_s(x['ours'])} / {_s(x['best_mean'])} ({x['best']}) | {_x(x['ratio'])}{mark} | "
                        f"{x['ci'][0]:.2f}–{x['ci'][1]:.2f}")
        lines.append(f"| {r['cell']} | {' | '.join(cols)} |")
    behind = [r for r in a["rows"] if not (r["sct_p50"]["ok"] and r["sct_p95"]["ok"])]
    real = [r for r in behind if not all(r[q]["ok"] or r[q]["noise"] for q in ("sct_p50", "sct_p95"))]
    geo = ", ".join(f"{p} {_x(g)} (per-seed {lo:.2f}–{hi:.2f})" for p, (g, lo, hi) in a["geomean_p95_vs"].items())
    lines += ["", f"Cells where talaria's mean SCT p50 or p95 is more than 2 % behind the best peer's mean: "
                  f"{len(behind)} of {len(a['rows'])}; of those, {len(real)} with an interval that excludes 1.00"
                  + (f" ({', '.join(r['cell'] for r in real)})" if real else "") + ". "
                  f"Geometric mean of talaria's mean SCT p95 over each peer's (goal <= 1.00x): {geo}."]
    if a["pools"]:
        worst = max(a["pools"], key=lambda t: _num(t[2]))
        over = [t for t in a["pools"] if t[2] > 1.02]
        lines += ["", f"Online pools vs the exact split (talaria / talaria-forecast-pools, SCT p95, every cell and "
                      f"seed): {len(over)} of {len(a['pools'])} more than 2 % slower; worst {_x(worst[2])} "
                      f"({worst[0]}, seed {worst[1]}); geometric mean {_x(_geomean([t[2] for t in a['pools']]))}."
                  + (" Over 2 %: " + ", ".join(f"{c} seed {s} {_x(x)}" for c, s, x in over) + "." if over else "")]
    return "\n".join(lines)


SPLIT_WORDS = {"exact": "this run's own demand (an exact forecast, which favours them)",
               "history": "another draw of the same workload (last week's traffic, as an operator has it)"}


# The last matrix against the transplanted (model-blind) baselines: an input the report shows
# beside the current one, not an output (the baselines left the registry's peers).
TRANSPLANTED_INPUT = Path(__file__).resolve().parents[2] / "bench" / "data" / "matrix_transplanted.json"

def write_outputs(matrix: dict, out_dir: Path) -> Path:
    write_json({**matrix, "wins": wins(matrix)}, out_dir / "matrix.json")
    heat_map(matrix, out_dir / "matrix_heatmap.png")
    old_path = TRANSPLANTED_INPUT
    old = json.loads(old_path.read_text()) if old_path.exists() else None
    md = out_dir / "matrix.md"
    notes = (out_dir / "matrix_notes.md").read_text() if (out_dir / "matrix_notes.md").exists() else ""
    md.write_text("# Workload matrix: talaria vs the faithful peers, each deployed as it is deployed\n\n"
                  "Ratio = talaria / best peer (below 1: talaria is faster); ✗ marks a missed goal. "
                  "Peers: " + ", ".join(matrix["baselines"]) + " (services/router/policy/, each citing its "
                  "source); deployment: talaria/sim/deployment.py, the peers' pools sized on "
                  + SPLIT_WORDS[matrix.get("peer_split", "exact")] + ". The mechanism column compares talaria "
                  "with its own ablations, not with the peers: it names the ablation whose SCT p95 is worst in "
                  "the cell (talaria-paper, talaria-no-lease, talaria-round-only, talaria-forecast-pools) and "
                  "that p95 over talaria's, i.e. what talaria would lose there without that mechanism; "
                  "\"online hot pools\" there means talaria's own pools beat the exact split of the cell's "
                  "demand (talaria-forecast-pools is always sized on the exact demand).\n\n"
                  + (seeds_table(matrix) + "\n\n## Seed " + str(matrix["seed"]) + " alone\n\n"
                     if matrix.get("matrix") else "")
                  + win_table(matrix) + "\n\n"
                  + "## Where talaria is more than 2 % behind, cell by cell\n\n" + miss_table(matrix) + "\n\n"
                  + ("## Old (transplanted baselines) beside new (faithful peers)\n\n" + side_by_side(matrix, old)
                     + "\n\n" if old else "")
                  + notes + "\n\n![heat map](matrix_heatmap.png)\n\n"
                  + "\n".join(sensitivity_table(matrix)))
    return md
