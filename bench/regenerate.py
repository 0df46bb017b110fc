"""Regenerate results/: every results file, the command that makes it, run one after another,
each Markdown output stamped with that command and the commit (bench/run_record.py).

    python bench/regenerate.py --dry-run          # print the commands, run nothing
    python bench/regenerate.py [--only NAME ...]  # run them (all of them takes hours)

RESULTS is the index: tests/unit/ops/test_results_index.py fails when a file in results/ is
made by no listed command, or a listed output is missing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.run_record import stamp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM = "${TALARIA_VLLM_PYTHON:-/opt/vllm-venv/bin/python}"  # the vLLM CPU venv (docs/engines.md)


@dataclass(frozen=True)
class Result:
    name: str
    outputs: tuple[str, ...]  # paths under results/
    commands: tuple[str, ...]  # shell lines run in the repository root, in order
    minutes: int  # rough wall time on the 2-core development machine
    note: str = ""  # why it is special (needs root, a GPU venv, ...)
    rerender: str = ""  # rewrites the report from the result's own JSONs, running nothing again
    prints: bool = False  # the commands print; a person writes the report from that (and stamps it)


RESULTS = (
    Result("agent_bench", ("agent_bench.md", "agent_bench.png"), ("python bench/agent_bench.py",), 5),
    Result("sp_burst", ("sp_burst.md",), ("python bench/sp_burst.py",), 3),
    Result("router_decision", ("router_decision.md",), ("python bench/router_decision.py --sessions 10000 --instances 64 --calls 3000",), 3),
    Result("router_checkpoint", ("router_checkpoint.md",), ("python bench/router_checkpoint.py --sizes 1000,20000,100000",), 3),
    Result("router_sensitivity", ("router_sensitivity.md",), ("python bench/router_sensitivity.py --seeds 8 --scale-sessions 1000",), 20),
    Result("sim_report", ("sim_report.md", "sim_report.json",
                          "fixed_replay.png",
                          "router_bars.png", "tau_sweep.png"),
           ("python -m talaria.sim.experiments all --out results/",), 60,
           rerender="python -m talaria.sim.experiments report --out results/"),
    Result("matrix", ("matrix.md", "matrix.json", "matrix_heatmap.png"),
           ("python -m talaria.sim.experiments matrix --ablations --seeds 1000,2000,3000 --peer-split history --out results/",), 30),
    Result("matrix_bound", ("matrix_bound.md",),
           ("python bench/matrix_zero_wait_bound.py results/matrix.json > results/matrix_bound.md",), 1),
    Result("weka_as_deployed", ("weka_as_deployed.md",),
           ("python bench/weka_as_deployed.py --seeds 3",), 5),
    Result("weka_as_deployed_capped", ("weka_as_deployed_capped.md",),
           ("python bench/weka_as_deployed.py --seeds 3 --gaps recorded --out results/weka_as_deployed_capped.md",), 5),
    Result("overload", ("overload.md",), ("python bench/overload.py",), 25),
    Result("capacity", ("capacity.md", "capacity.png"), ("python bench/capacity.py all",), 10),
    Result("migration", ("migration.md", "migration.png"),
           ("python bench/migration_sim.py --seeds 10 --link-scale 1 --setup-scale 1",
            "python bench/migration_capacity.py --seeds 10",
            "python bench/migration_ttft.py --tokens 4096,16384,65536 --netns --transports tcp,mooncake",
            ".ci-vllm-venv/bin/python bench/migration_ttft.py --engine vllm --tokens 4096,16384,65536 --netns"
            " --transports tcp,mooncake"), 65,
           note="the TTFT part needs root (network namespaces), the mooncake extra and, for its vLLM rows,"
                " the vLLM stage's venv (.ci/vllm_stage.sh builds .ci-vllm-venv without the extra: add it with"
                " .ci-vllm-venv/bin/pip install -e '.[test,mooncake]')"),
    Result("hot_cold_sim", ("hot_cold_sim.md",), ("python bench/hot_cold_sim.py --seeds 3",), 5),
    Result("sim_fidelity_peers", ("sim_fidelity_peers.md",),
           ("python bench/sim_fidelity.py --policies talaria,sglang-cache-aware,vllm-stack-session"
            " --out results/sim_fidelity_peers.md",), 5),
    Result("output_estimate", ("output_estimate.md",), ("python bench/output_estimate.py --cells output=50@60%,output=1000@100%,base@100%,depth=5@100%,prompt=100000@60%",), 10),
    Result("vllm_engine", ("vllm_engine.md",),
           (f"{VLLM} bench/vllm_return.py --out results/vllm_engine.md",
            f"{VLLM} bench/vllm_writethrough.py --reps 7 --out results/vllm_engine.md",
            f"{VLLM} bench/engine_throughput.py --dtype bfloat16 --prompt 256 --decode 16 --batch 1 4 --reps 1"
            " --out results/vllm_engine.md"), 20, "needs the vLLM CPU venv; runs append to the file"),
    Result("faults", ("faults.md", "faults.json"), ("python bench/faults.py --sessions 12 --calls 10 --faults all",), 15),
    Result("load", ("load.md",), ("python bench/load.py --rates 40,80,160,300 --seconds 15",), 10),
    Result("routers", ("routers.md", "routers.json"), ("python bench/routers_sim.py --instances 64 --routers 1,2,4 --lag-ms 10 --stress-ms 100 --sessions-per-instance 20",
            "python bench/routers_sim.py --instances 64 --routers 1,4 --lag-ms 100 --stress-ms 1000 --sessions-per-instance 20 --seed 1 --add",
            "python bench/routers_sim.py --instances 256 --routers 1,2,4 --lag-ms 10 --stress-ms 100 --sessions-per-instance 10 --add",
            "python bench/routers_sim.py --instances 256 --routers 1,4 --lag-ms 10 --stress-ms 0 --sessions-per-instance 10 --seed 1 --add"), 10),
    Result("routers_load", ("routers_load.md",),
           ("python bench/load.py --routers 1,2 --rounds 2 --rates 80,160,240,320 --seconds 12",), 15),
    Result("metrics", ("metrics.md",), ("python bench/metrics_overhead.py",
                                        "python -m pytest tests/integration/test_nats_cluster.py -s"), 10,
           "both print; the report is written from their output", prints=True),
    Result("mutation", ("mutation.md",), ("python bench/mutation.py --sample 3",), 40, "not in CI"),
    Result("multihost", ("multihost.md",), ("python bench/multihost.py --out results/multihost.md",), 10,
           "needs root (network namespaces)"),
    Result("stream_bytes", ("stream_bytes.md",), ("python bench/stream_bytes.py --sessions 4 --calls 5",), 3),
    Result("session_inference", ("session_inference.md",),
           ("python bench/session_inference.py", "python bench/matrix_session_ids.py"), 7),
    Result("session_attribution", ("session_attribution.md",), ("python bench/session_attribution.py --batch 64",), 5),
)
# Written by hand, not by a command: read with the results they explain.
NOTES = {"README.md": "this index", "matrix_notes.md": "the matrix's cell-by-cell reasons"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print each result's commands, run nothing")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these results only")
    args = ap.parse_args(argv)
    names = {r.name for r in RESULTS}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        print(f"regenerate: unknown result {', '.join(unknown)} (known: {', '.join(sorted(names))})", file=sys.stderr)
        return 2
    chosen = [r for r in RESULTS if not args.only or r.name in args.only]
    for r in chosen:
        print(f"# {r.name}: {', '.join(r.outputs)} (~{r.minutes} min{'; ' + r.note if r.note else ''})")
        for command in r.commands:
            print(command)
            if not args.dry_run:
                subprocess.run(command, shell=True, cwd=ROOT, check=True, executable="/bin/bash")
        if r.prints and not args.dry_run:
            print(f"# {r.name}: write results/{r.outputs[0]} from the output above, then stamp it "
                  "(bench/run_record.py stamp)")
        elif not args.dry_run:
            for out in r.outputs:
                if out.endswith(".md"):
                    stamp(ROOT / "results" / out, " && ".join(r.commands))
    if args.dry_run:
        print(f"# {len(chosen)} results, about {sum(r.minutes for r in chosen)} min in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())

