"""Control-plane overhead of two or more code trees, measured side by side (issue 11, ask 5).

    python bench/control_overhead_ab.py TREE_A TREE_B [...] [--calls 150] [--blocks 6]

On a shared machine the load changes from one run of `control_overhead.py` to the next by
more than a change to the call path does. Here every tree gets its own stack (each started
with its tree on PYTHONPATH), all at once; sequential 1-token calls go to the stacks in a
shuffled rotation, call by call, so each tree's calls see the same load; then blocks of 16
concurrent sessions (7 calls each) rotate the same way. Figures and hops are those of
`control_overhead.py` (from the `calls` rows). The stacks idle in the background while
another one is called, so absolute figures run higher than with one stack.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import live  # noqa: E402
from control_overhead import HOPS, MODEL, figures  # noqa: E402
from live import call_rows, connect, live_stack, p50, pct  # noqa: E402


async def measure(stacks, calls: int, blocks: int, seed: int = 0) -> list[tuple[dict, dict]]:
    ncs = [await connect(s) for s in stacks]
    keys = [getattr(s, "api_key", None) for s in stacks]

    async def call(k: int, session: str, text: str, **kw):
        live.API_KEY = keys[k]  # each stack has its own key
        return await live.nats_call(ncs[k], MODEL, session, text, **kw)

    for k in range(len(stacks)):
        await call(k, "warmup", "warm up", max_tokens=2)
    rnd = random.Random(seed)
    sent1: list[dict] = [{} for _ in stacks]
    sent16: list[dict] = [{} for _ in stacks]
    for i in range(calls):
        for k in rnd.sample(range(len(stacks)), len(stacks)):
            cid = f"ab1-{k}-{i}"
            _, lat, t0 = await call(k, "ab1", f"ping {i}", call_id=cid, timeout=20)
            sent1[k][cid] = (t0, lat)
    for b in range(blocks):
        for k in rnd.sample(range(len(stacks)), len(stacks)):
            async def session(j: int, k: int = k, b: int = b) -> None:
                for i in range(7):
                    cid = f"ab16-{k}-{b}-{j}-{i}"
                    _, lat, t0 = await call(k, f"ab16-{b}-{j}", f"ping {i}", call_id=cid, timeout=20)
                    sent16[k][cid] = (t0, lat)

            await asyncio.gather(*(session(j) for j in range(16)))
    out = []
    for k, stack in enumerate(stacks):
        out.append((figures(sent1[k], await call_rows(stack, list(sent1[k]))),
                    figures(sent16[k], await call_rows(stack, list(sent16[k])))))
    for nc in ncs:
        await nc.close()
    return out


def table(names: list[str], res: list[tuple[dict, dict]]) -> str:
    cols = [(c, q, k) for c, q in ((0, 0.5), (1, 0.5), (1, 0.95)) for k in range(len(names))]
    label = {(0, 0.5): "c=1 p50", (1, 0.5): "c=16 p50", (1, 0.95): "c=16 p95"}
    lines = ["| figure (ms) | " + " | ".join(f"{names[k]} {label[c, q]}" for c, q, k in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for key in ("latency", "overhead", *HOPS):
        cells = [1000 * (p50(res[k][c][key]) if q == 0.5 else pct(res[k][c][key], q)) for c, q, k in cols]
        lines.append(f"| {key} | " + " | ".join(f"{x:.2f}" for x in cells) + " |")
    lines.append("| calls measured | " + " | ".join(str(len(res[k][c]["latency"])) for c, q, k in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", help="repository roots (each started with its own code)")
    p.add_argument("--calls", type=int, default=150, help="sequential calls per tree")
    p.add_argument("--blocks", type=int, default=6, help="blocks of 16 sessions x 7 calls per tree")
    args = p.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees]
    with contextlib.ExitStack() as stack:
        stacks = []
        for tree in trees:
            os.environ["PYTHONPATH"] = tree  # the stack's services run this tree's code
            stacks.append(stack.enter_context(live_stack(agents=1)))
        res = asyncio.run(measure(stacks, args.calls, args.blocks))
    print(table([Path(t).name for t in trees], res))


if __name__ == "__main__":
    main()
