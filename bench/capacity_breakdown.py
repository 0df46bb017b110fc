"""Where an instance's time goes in a `sim run` (issue 34: why talaria needs 5 instances, not 4,
on the 20-model capacity trace).

    python bench/capacity.py trace --models 20 /tmp/z20.jsonl
    python bench/capacity_breakdown.py /tmp/z20.jsonl --catalogue 20 --instances 4 [--config talaria]
        [--switch-scale 0] [--set KNOB=VALUE ...]

Prints the run's SCT, then per instance the seconds spent switching, prefilling (restores
included) and decoding, and per model the decode steps' mean batch and the decode seconds,
read off the simulator's executor as it runs (each finished action is counted once).
`--switch-scale F` multiplies every switch's cost by F (0: free switches), a what-if that
says how much of the tail switching explains.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from talaria.services.instance_agent.scheduler.types import Decode, Prefill, SwitchModel  # noqa: E402
from talaria.sim import executor as sim_executor  # noqa: E402
from talaria.sim import profiles  # noqa: E402


class Tally:
    """Seconds per (instance, action kind) and decode steps per model, from finished actions."""

    def __init__(self) -> None:
        self.busy: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.steps: collections.Counter = collections.Counter()  # model -> decode steps
        self.seq_steps: collections.Counter = collections.Counter()  # model -> sequence-steps
        self.decode_s: collections.Counter = collections.Counter()

    def action_done(self, ex, now: float, steps: int | None) -> None:
        action, took = ex.action, now - ex.action_start
        if isinstance(action, SwitchModel):
            self.busy[ex.id]["switch"] += took
        elif isinstance(action, Prefill):
            self.busy[ex.id]["prefill"] += took
        elif isinstance(action, Decode):
            k = action.steps if steps is None else steps
            self.busy[ex.id]["decode"] += took
            self.steps[action.model] += k
            self.seq_steps[action.model] += k * len(action.call_ids)
            self.decode_s[action.model] += took


def instrument(tally: Tally, switch_scale: float) -> None:
    done = sim_executor.SimExecutor._done

    def counted(self, now, token, steps):
        if token == self.token:  # not a stale event: the action in flight finished
            tally.action_done(self, now, steps)
        return done(self, now, token, steps)

    sim_executor.SimExecutor._done = counted
    if switch_scale != 1.0:
        switch = profiles.ServerProfile.switch

        def scaled(self, model, staged):
            path, seconds, phases = switch(self, model, staged)
            return path, seconds * switch_scale, {k: v * switch_scale for k, v in phases.items()}

        profiles.ServerProfile.switch = scaled


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--catalogue", required=True)
    ap.add_argument("--instances", type=int, required=True)
    ap.add_argument("--config", default="talaria")
    ap.add_argument("--profile", default="paper-tp8")
    ap.add_argument("--gaps", default="paper")
    ap.add_argument("--switch-scale", type=float, default=1.0)
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE")
    args = ap.parse_args(argv)
    tally = Tally()
    instrument(tally, args.switch_scale)
    from talaria.sim.cli import main as sim_main

    run = ["run", "--trace", args.trace, "--profile", args.profile, "--catalogue", args.catalogue, "--gaps",
           args.gaps, "--config", args.config, "--instances", str(args.instances)]
    for knob in args.set:
        run += ["--set", knob]
    if sim_main(run) != 0:
        return 1
    total = collections.Counter()
    print("\n| instance | switch s | prefill s | decode s | busy s |\n|---|---|---|---|---|")
    for iid in sorted(tally.busy):
        b = tally.busy[iid]
        total.update(b)
        print(f"| {iid} | {b['switch']:.0f} | {b['prefill']:.0f} | {b['decode']:.0f} | {sum(b.values()):.0f} |")
    print(f"| all | {total['switch']:.0f} | {total['prefill']:.0f} | {total['decode']:.0f} | {sum(total.values()):.0f} |")
    steps, seqs = sum(tally.steps.values()), sum(tally.seq_steps.values())
    print(f"\ndecode steps {steps}, mean batch {seqs / max(1, steps):.2f}")
    print("\n| model | decode s | mean batch |\n|---|---|---|")
    for model in sorted(tally.steps, key=lambda m: -tally.decode_s[m]):
        print(f"| {model} | {tally.decode_s[model]:.0f} | {tally.seq_steps[model] / tally.steps[model]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
