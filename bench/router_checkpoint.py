"""The router's state checkpoint at the sizes a long-running router reaches.

    python bench/router_checkpoint.py [--sizes 1000,20000,100000]

The router saves its state (RouterState.to_dict) to Postgres every SAVE_EVERY_S while it
changes: the encoding runs under the router's lock and the JSONB write on its event loop,
so both are time the router does not route. Per session-table size (the rows a router
keeps: at most state.SESSIONS_KEPT; 20,000 is a day at 0.25 sessions/s) with the
redelivery map full (ROUTED_KEPT call ids): to_dict, the JSON encoding with json.dumps
(SQLAlchemy's default, before) and with msgspec (shared/db/connection.py, now), the bytes
written, and the save interval the router then keeps (router_service.save_interval: at most
SAVE_SHARE of its time). Writes results/router_checkpoint.md. Wall-clock on a shared
machine: ratios within one run are the fair comparison.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from talaria.services.router.router_service import SAVE_SHARE, save_interval  # noqa: E402
from talaria.services.router.state import ROUTED_KEPT, SESSIONS_KEPT, RouterState, SessionEntry  # noqa: E402
from talaria.shared.db.connection import _json  # noqa: E402


def state(sessions: int) -> RouterState:
    st = RouterState()
    for k in range(sessions):
        sid = f"session-{k:012d}"
        st.sessions[sid] = SessionEntry(sid, "qwen3-235b", "inst-03", 25_000 + k % 9_000, 1.7e9 + k, 11,
                                        None, "inst-01", f"{sid}-call-10", 1.7e9 + k, [0.41, 0.52, 0.33, 38.0])
    for k in range(ROUTED_KEPT):
        cid = f"{k:032x}"
        st.routed[cid] = f"inst-{k % 64:02d}"
        st.submission_seq[cid] = k
    return st


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=f"1000,20000,{SESSIONS_KEPT}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "router_checkpoint.md"))
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        st = state(n)
        to_dict_s, snap = timed(st.to_dict, args.repeats)
        json_s, text = timed(lambda: json.dumps(snap), args.repeats)
        msgspec_s, _ = timed(lambda: _json(snap), args.repeats)
        spent = to_dict_s + msgspec_s
        rows.append((n, to_dict_s, json_s, msgspec_s, len(text) / 1e6, save_interval(spent), spent))
        print(f"{n} sessions: to_dict {to_dict_s * 1e3:.0f} ms, json.dumps {json_s * 1e3:.0f} ms, "
              f"msgspec {msgspec_s * 1e3:.0f} ms ({msgspec_s / json_s:.2f}x), {len(text) / 1e6:.1f} MB")
    lines = [
        "# Router checkpoint cost by session-table size", "",
        f"`python bench/router_checkpoint.py --sizes {args.sizes}` on {platform.machine()} / Python "
        f"{platform.python_version()}, shared 2-core machine; medians of {args.repeats}. The redelivery map "
        f"holds its {ROUTED_KEPT:,} call ids in every row. The table keeps at most {SESSIONS_KEPT:,} sessions "
        "(state.SESSIONS_KEPT; before, every session ever seen: a month at 0.25 sessions/s is 650,000).", "",
        "| session rows | to_dict ms (router lock held) | json.dumps ms (before) | msgspec ms (now) | "
        "msgspec / json.dumps | MB written | save interval s | router time on checkpoints |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, td, js, ms, mb, every, spent in rows:
        lines.append(f"| {n:,} | {td * 1e3:.0f} | {js * 1e3:.0f} | {ms * 1e3:.0f} | {ms / js:.2f}x | {mb:.1f} | "
                     f"{every:.1f} | {100 * spent / every:.1f} % |")
    lines += ["", f"The save interval is router_service.save_interval: SAVE_EVERY_S, or longer once a save "
              f"takes more than {SAVE_SHARE:.0%} of it (to_dict + the encoding here; the Postgres write adds to it "
              "live)."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
