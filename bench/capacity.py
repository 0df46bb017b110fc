"""Issue 34's capacity benchmark: the traces it names, and the table and plot of `sim capacity`.

    python bench/capacity.py all      # results/capacity.md + .png: the CASES below (~10 min here)
    python bench/capacity.py trace --models 20 [--sessions 150] [--rate 0.05] [--shape tool|chat] OUT.jsonl
    talaria sim capacity --trace OUT.jsonl --catalogue 20 --slo-p95 2x --json /tmp/cap20.json
    python bench/capacity.py report /tmp/cap20.json [/tmp/cap50.json ...] > results/capacity.md
    python bench/capacity.py report bench/data/capacity/case*.json --out results/capacity.md  # re-render

results/capacity.md (`all`): the traces `trace --models 20 z20.jsonl`, `trace --models 50
z50.jsonl` and `trace --models 20 --shape chat c20.jsonl` (seed 0) in a temporary folder, each
section's `sim capacity` command as it prints.

`trace`: agent sessions (workloads.agent_sessions, the matrix's base shape: depth ~30, prompt
~25K, output ~250) over a Zipf(1) catalogue of `--models` models named z00.. (so `--catalogue N`
maps them by popularity), Poisson arrivals at `--rate` sessions/s. `tool`: tool-call returns
(replay with the paper's gaps, the default); `chat`: depth ~10 and a fifth of the returns human
turns of minutes (replay with `--gaps recorded:none`). `report`: a markdown table per result
(instances per deployment, ratios to the best peer and to the lower bound) on stdout and one
plot (SCT p95 vs instances per deployment, every run) at results/capacity.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

from talaria.sim.capacity import OURS
from talaria.sim.cli import main as sim_main
from talaria.sim.workloads import agent_sessions, at_rate
from talaria.traces.format import save_sessions

SHAPES = {"tool": dict(depth=30, gaps="paper"), "chat": dict(depth=10, gaps="human")}
# results/capacity.md: (trace file, models, shape, `--gaps` to replay it with, SLO)
CASES = (("z20.jsonl", 20, "tool", "paper", "2x"), ("z50.jsonl", 50, "tool", "paper", "2x"),
         ("c20.jsonl", 20, "chat", "recorded:none", "2x"), ("z20.jsonl", 20, "tool", "paper", "1.5x"),
         ("z20.jsonl", 20, "tool", "paper", "3x"))


def write_trace(out, models: int, shape: str = "tool", sessions: int = 150, rate: float = 0.05, seed: int = 0) -> None:
    names = [f"z{k:02d}" for k in range(models)]
    made = agent_sessions(sessions, names, SHAPES[shape]["depth"], 25_000, 250, SHAPES[shape]["gaps"], zipf_s=1.0,
                          seed=seed)
    n = save_sessions(at_rate(made, rate), out)
    print(f"{out}: {len(made)} sessions, {n} calls over {models} Zipf(1) models", file=sys.stderr)


def run_all(md: Path, png: Path) -> None:
    """Every case of CASES through `sim capacity`, then the report into `md` and `png`."""
    tmp = Path(tempfile.mkdtemp(prefix="capacity-"))
    jsons = []
    for k, (trace, models, shape, gaps, slo) in enumerate(CASES):
        if not (tmp / trace).exists():
            write_trace(tmp / trace, models, shape)
        out = tmp / f"case{k}.json"
        if sim_main(["capacity", "--trace", str(tmp / trace), "--catalogue", str(models), "--gaps", gaps,
                     "--slo-p95", slo, "--json", str(out)]) != 0:
            raise SystemExit(f"capacity case {k} failed")
        jsons.append(str(out))
    kept = Path(__file__).parent / "data" / "capacity"  # so `report` re-renders without a rerun
    kept.mkdir(parents=True, exist_ok=True)
    for k, path in enumerate(jsons):
        (kept / f"case{k}.json").write_text(Path(path).read_text())
    render(jsons, md, png)


def render(jsons: list[str], md: Path, png: Path) -> None:
    with md.open("w") as f, redirect_stdout(f):
        print(f"<!-- made by `python bench/capacity.py all` at commit {_commit()} -->")  # run_record.py stamp
        report(jsons, png)


def _at_best_peer(r: dict, best: int | None) -> str:
    """talaria's SCT p95 over the best peer's where the peer first meets the SLO, beside the
    least ratio any schedule could reach there (the zero-wait bound over the peer's p95)."""
    pol = r["policies"]
    if best is None:
        return "-"
    peer_p95 = min(e["sct_p95"] for n, e in pol.items() if n != OURS and e["instances"] == best)
    ours = [x["sct_p95"] for x in pol.get(OURS, {}).get("runs", []) if x["instances"] == best]
    mine = f"{ours[0] / peer_p95:.2f}x" if ours and ours[0] is not None else "not run"
    return f"{mine} ({r['bound_p95_s'] / peer_p95:.2f}x)"


def _commit() -> str:
    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")


def _gaps(described: str) -> str:
    return "the paper's tool gaps" if "paper" in described else described.split(" (")[0]


def _secs(v) -> str:
    return "miss" if v is None else f"{v:.0f}"


def _kv(e: dict, k) -> str:
    """Returns that recomputed their context (moves or losses) / that migrated it, in the run at
    count k ("-" for results written before runs counted them)."""
    run = next((x for x in e["runs"] if x["instances"] == k), None)
    if run is None or "recomputes" not in run:
        return "-"
    return f"{run['recomputes']} / {run['migrations']}"


def _fmt(k) -> str:
    return "-" if k is None else str(k)


def report(paths: list[str], png: Path) -> None:
    results = [(p, json.load(open(p))) for p in paths]
    print("# Instances to hold an SCT p95 SLO (`talaria sim capacity`, bench/capacity.py)\n")
    print(" ".join(__doc__.split("\n\n")[2:4]).replace("\n", " ") + "\n")
    for path, r in results:
        pol = r["policies"]
        peers = {n: e["instances"] for n, e in pol.items() if n != OURS and e["instances"] is not None}
        best = min(peers.values()) if peers else None
        ours = pol.get(OURS, {}).get("instances")
        lb = r["instances_lower_bound"]
        print(f"## {r['sessions']} sessions over {r['models']} models of a {r.get('catalogue')}-model catalogue "
              f"({Path(r['trace']).name}; gaps: {_gaps(r['gaps'])})\n")
        print(f"SLO: SCT p95 <= {r['slo_p95_s']:.0f} s = {r['slo_p95_s'] / r['bound_p95_s']:.2f}x the zero-wait bound "
              f"({r['bound_p95_s']:.0f} s). Instance lower bound (instance_bound.py): {_fmt(lb)}. "
              f"{sum(len(e['runs']) for e in pol.values())} runs in {r.get('wall_s', 0):.0f} s.\n")
        if r.get("command"):
            print(f"`{r['command']}`\n")
        print("| deployment | instances | vs best peer | vs lower bound | SCT p50 / p95 at that count (s) | "
              "recomputes / migrations at that count | runs (instances: p95 s; miss = stopped once out of reach) |")
        print("|---|---|---|---|---|---|---|")
        for name, e in pol.items():
            k = e["instances"]
            vs_best = f"{k / best:.2f}x" if k and best else "-"
            vs_lb = f"{k / lb:.2f}x" if k and lb else "-"
            at = f"{e['sct_p50']:.0f} / {e['sct_p95']:.0f}" if k is not None else "-"
            runs = ", ".join(f"{x['instances']}: {_secs(x['sct_p95'])}" for x in e["runs"])
            print(f"| {name} | {_fmt(k) if k is not None else '> ' + str(r['max_instances'])} | {vs_best} | {vs_lb} | "
                  f"{at} | {_kv(e, k)} | {runs} |")
        if ours is not None and best is not None:
            at_best = [x for x in pol[OURS]["runs"] if x["instances"] == best]
            peer_p95 = min(pol[n]["sct_p95"] for n, k in peers.items() if k == best)
            line = f"\ntalaria needs {ours / best:.2f}x the best peer's instances ({ours} vs {best})"
            if at_best and at_best[0]["sct_p95"] is not None:
                line += f"; at the best peer's {best}, talaria's SCT p95 is {at_best[0]['sct_p95'] / peer_p95:.2f}x its"
            # Every session's SCT is at least its zero-wait SCT, so no schedule's p95 is below the
            # bound's: bound / peer p95 is the least ratio any router could reach at that count.
            line += f" (no schedule can go below {r['bound_p95_s'] / peer_p95:.2f}x: the zero-wait bound)"
            print(line + ".\n")
    print("## Summary\n")
    print("Dedicated pools (one pool of >= 1 instance per model, no switching) need at least the trace's "
          "model count.\n")
    print("| trace | SLO (x zero-wait bound) | lower bound | talaria | best peer | talaria / best peer | "
          "talaria / dedicated pools (at most) | p95 at the best peer's count: talaria / peer (least possible) |")
    print("|---|---|---|---|---|---|---|---|")
    for path, r in results:
        pol = r["policies"]
        peers = [e["instances"] for n, e in pol.items() if n != OURS and e["instances"] is not None]
        ours, best = pol.get(OURS, {}).get("instances"), min(peers) if peers else None
        vs_best = f"{ours / best:.2f}x" if ours and best else "-"
        vs_pools = f"{ours / r['models']:.2f}x" if ours else "-"
        print(f"| {Path(r['trace']).name} ({r['models']} models) | {r['slo_p95_s'] / r['bound_p95_s']:.1f}x | "
              f"{_fmt(r['instances_lower_bound'])} | {_fmt(ours)} | {_fmt(best)} | {vs_best} | {vs_pools} | "
              f"{_at_best_peer(r, best)} |")
    print()
    print("The last column bounds any router: every session's SCT is at least its zero-wait SCT, so at the "
          "best peer's instance count no schedule's SCT p95 is below the zero-wait bound's; where that "
          "ratio is above a goal (issue 34 asks for <= 0.7x), the goal is out of reach on that trace.\n")
    _plot(results, png)
    print(f"![SCT p95 against instances]({png.name})")


def _plot(results, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = min(3, len(results))
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(results):]:
        ax.set_visible(False)
    for ax, (path, r) in zip(axes.flat, results):
        miss = 1.4 * r["slo_p95_s"]  # where runs stopped as out of reach (p95 unknown, > SLO) are drawn
        for k, (name, e) in enumerate(r["policies"].items()):
            pts = sorted((x["instances"], x["sct_p95"] if x["sct_p95"] is not None else miss) for x in e["runs"])
            if pts:
                dx = 0.04 * (k - len(r["policies"]) / 2)  # side by side where counts coincide
                ax.plot([n + dx for n, _ in pts], [v for _, v in pts], marker="o", label=name,
                        lw=2.5 if name == OURS else 1.2)
        ax.axhline(r["slo_p95_s"], color="k", ls="--", lw=1, label="SLO")
        ax.axhline(miss, color="grey", ls="-", lw=0.5)
        ax.text(ax.get_xlim()[0], miss, " missed (run stopped, p95 > SLO)", fontsize=7, va="bottom")
        if r["instances_lower_bound"]:
            ax.axvline(r["instances_lower_bound"], color="grey", ls=":", lw=1, label="instance lower bound")
        ax.set(yscale="log", xlabel="instances", ylabel="SCT p95 (s)",
               title=f"{Path(r['trace']).name}: {r['models']} of {r.get('catalogue')} models, "
                     f"SLO {r['slo_p95_s'] / r['bound_p95_s']:.1f}x bound")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--models", type=int, default=20)
    t.add_argument("--sessions", type=int, default=150)
    t.add_argument("--rate", type=float, default=0.05, help="session arrivals per second")
    t.add_argument("--shape", choices=sorted(SHAPES), default="tool")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("out")
    a = sub.add_parser("all")
    a.add_argument("--out", type=Path, default=Path("results/capacity.md"))
    a.add_argument("--png", type=Path, default=Path("results/capacity.png"))
    rp = sub.add_parser("report")
    rp.add_argument("json", nargs="+")
    rp.add_argument("--png", type=Path, default=Path("results/capacity.png"))
    rp.add_argument("--out", type=Path, help="write the stamped page here (results/capacity.md) instead of stdout")
    args = ap.parse_args(argv)
    if args.cmd == "trace":
        write_trace(args.out, args.models, args.shape, args.sessions, args.rate, args.seed)
    elif args.cmd == "all":
        run_all(args.out, args.png)
    elif args.out:
        render(args.json, args.out, args.png)
    else:
        report(args.json, args.png)


if __name__ == "__main__":
    main()
