"""How much room a matrix cell leaves any router: the zero-wait bound beside the best peer.

A session's zero-wait SCT is its recorded gaps plus each call run alone the moment it
arrives, its reusable prefix (or the model's shared system prompt) on device, no switch, no
queue, decoding at batch 1 (the fastest step per token). No policy on this hardware can
finish a session sooner, so bound p95 / best peer p95 is the least SCT p95 ratio any router
could reach in the cell; where it is near 1, nothing is left to win. Generated cells only
(the WEKA cells replay with a gap model and release 30 sessions at once: their bound says
nothing about routing).

    python bench/matrix_zero_wait_bound.py [results/matrix.json] > results/matrix_bound.md
"""

from __future__ import annotations

import json
import math
import sys

from talaria.shared.stats import quantile
from talaria.sim.matrix import cells, zero_wait_scts


def main(path: str = "results/matrix.json") -> None:
    m = json.load(open(path))
    res = {c["name"]: c["results"] for c in m["cells"]}
    print("# Zero-wait bound per matrix cell (bench/matrix_zero_wait_bound.py)\n")
    print(__doc__.split("\n\n")[1].replace("\n", " ") + "\n")
    print("| cell | bound p50 / best peer | bound p95 / best peer | talaria p95 / bound |")
    print("|---|---|---|---|")
    logs, ours = [], []
    for cell in cells(m.get("seed", 0)):
        if cell.weka or cell.name not in res:
            continue
        r = res[cell.name]
        b = zero_wait_scts(cell)
        b50, b95 = quantile(b, 0.5), quantile(b, 0.95)
        p50 = min(r[p]["sct_p50"] for p in m["baselines"])
        p95 = min(r[p]["sct_p95"] for p in m["baselines"])
        logs.append(math.log(b95 / p95))
        ours.append(math.log(r["talaria"]["sct_p95"] / b95))
        print(f"| {cell.name} | {b50 / p50:.2f}x | {b95 / p95:.2f}x | {r['talaria']['sct_p95'] / b95:.2f}x |")
    print(f"\nGeometric mean over {len(logs)} generated cells: bound p95 / best peer of the cell "
          f"{math.exp(sum(logs) / len(logs)):.2f}x; talaria p95 / bound {math.exp(sum(ours) / len(ours)):.2f}x.")


if __name__ == "__main__":
    main(*sys.argv[1:])
