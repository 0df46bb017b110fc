"""The online output estimate (services/router/output_estimate.py): how close, and how much
its constants matter.

    python bench/output_estimate.py [--cells output=50@60%,output=1000@100%,...] [--out results/output_estimate.md]

On matrix cells (talaria/sim/matrix.py), talaria's router is run
  - with the estimate as built (KV_QUANTILE 0.95, MODEL_KEEP 256, SESSION_KEEP 16),
  - with each constant at about half and double (the quantile at 0.9 and 0.99),
  - and with the oracle the simulator used to give: every call's `max_tokens` its true
    output, and the router pricing by max_tokens;
and reports SCT p50 / p95 per run, plus the estimate's error on the calls it priced (mean
absolute error of the expected output against the true output, as a share of the mean).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from talaria.services.router import output_estimate as oe  # noqa: E402
from talaria.shared.events import CallSubmitted  # noqa: E402
from talaria.sim import matrix  # noqa: E402
from talaria.sim.cluster import Cluster, RunConfig  # noqa: E402
from talaria.sim.executor import instance_config  # noqa: E402
from talaria.sim.metrics import summarise  # noqa: E402
from talaria.traces.format import Session  # noqa: E402

CELLS = ("output=50@60%", "output=1000@100%", "base@100%", "depth=5@100%", "prompt=100000@60%")
VARIANTS = {
    "as built": {},
    "KV_QUANTILE=0.9": {"KV_QUANTILE": 0.9},
    "KV_QUANTILE=0.99": {"KV_QUANTILE": 0.99},
    "MODEL_KEEP=128": {"MODEL_KEEP": 128},
    "MODEL_KEEP=512": {"MODEL_KEEP": 512},
    "SESSION_KEEP=8": {"SESSION_KEEP": 8},
    "SESSION_KEEP=32": {"SESSION_KEEP": 32},
}


def run(cell, patch: dict, oracle: bool = False) -> tuple[dict, float]:
    if oracle:  # as before: max_tokens = the true output, and the router prices by max_tokens
        patch = {**patch, "expected": lambda self, s, m, cap: float(cap), "kv_tokens": lambda self, s, m, cap: cap}
    saved = {k: getattr(oe.OutputEstimator if k in ("expected", "kv_tokens") else oe, k) for k in patch}
    for k, v in patch.items():
        setattr(oe.OutputEstimator if k in ("expected", "kv_tokens") else oe, k, v)
    try:
        flags = instance_config("talaria")
        sessions, gaps, _ = matrix.workload(cell, flags)
        if oracle:
            sessions = [Session(s.id, tuple(replace(c, max_tokens=c.output_tokens) for c in s.calls)) for s in sessions]
        name, pc = matrix.policy_config(matrix.OURS)
        cluster = Cluster(sessions, RunConfig(matrix.server_for(cell), cell.instances, name, pc, flags, gaps))
        truth = {f"{c.session}#{c.call_index}": c.output_tokens for s in sessions for c in s.calls}
        errors = []
        handle = cluster.router.handle

        def probe(event, now):  # the estimate each call was priced with, against its truth
            if isinstance(event, CallSubmitted):
                est = cluster.router.state.outputs.expected(event.session_id, event.model, event.max_tokens)
                errors.append(abs(est - truth[event.call_id]))
            return handle(event, now)

        cluster.router.handle = probe
        result = summarise(cluster.run())
        mean_out = statistics.mean(truth.values())
        mae = (statistics.mean(errors) / mean_out, statistics.median(errors) / mean_out) if errors else (0.0, 0.0)
        return result, mae
    finally:
        for k, v in saved.items():
            setattr(oe.OutputEstimator if k in ("expected", "kv_tokens") else oe, k, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--out", default="results/output_estimate.md")
    args = ap.parse_args(argv)
    wanted = [c.strip() for c in args.cells.split(",") if c.strip()]
    cells = {c.name: c for c in matrix.cells()}
    missing = [w for w in wanted if w not in cells]
    if missing:
        raise SystemExit(f"unknown cells {missing}; known: {sorted(cells)}")
    lines = ["# The online output estimate: error and flatness", "",
             "talaria's SCT p50 / p95 (s) on matrix cells with the output estimate as built, each of its "
             "constants at about half and double, and the oracle the simulator used to give (max_tokens = "
             "the true output, priced by max_tokens). `err` = mean / median of |expected - true output| over "
             "the calls priced (retries included), over the mean output: the mean carries the calls priced "
             "before their model's first completion, at their cap (up to the model's whole context).", "",
             f"Command: `python bench/output_estimate.py --cells {','.join(wanted)}`", "",
             "| cell | " + " | ".join([*VARIANTS, "oracle"]) + " |", "|---|" + "---|" * (len(VARIANTS) + 1)]
    for name in wanted:
        cols = []
        for label, patch in [*VARIANTS.items(), ("oracle", None)]:
            res, mae = run(cells[name], patch or {}, oracle=patch is None)
            cols.append(f"{res['sct_p50']:.1f} / {res['sct_p95']:.1f} (err {mae[0]:.2f} / {mae[1]:.2f})")
            print(f"{name} {label}: {cols[-1]}", file=sys.stderr)
        lines.append(f"| {name} | " + " | ".join(cols) + " |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
