"""Session-prefill benchmark: a burst of returning sessions on one cold instance (not a test).

    python bench/sp_burst.py [--device cuda] [--sessions 8] [--out results/sp_burst.md]

One cold instance time-shares two models. Long calls keep both models busy; while model A's
slot is decoding, a burst of A's sessions returns from their tool calls (KV still on the
device or in the host registry) and new work for model B arrives. With SP they are admitted at the next decode boundary of
A's slot; without it they wait for A's next slot, after B's. The real RoundScheduler drives
the real TorchEngine, exactly as the instance agent does (synchronously here). Reports the
returning calls' TTFT p50/p95 for SP on and off, and their ratio, from one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from talaria.services.instance_agent.engine import Sequence, TorchEngine  # noqa: E402
from talaria.services.instance_agent.engine_view import reusable_kv  # noqa: E402
from talaria.services.instance_agent.runner import INITIAL_COSTS  # noqa: E402
from talaria.shared.stats import quantile  # noqa: E402
from talaria.services.instance_agent.scheduler import (  # noqa: E402
    AgentCall, CallAdmitted, CallFinished, Decode, Idle, Prefill, RoundScheduler, SchedulerConfig, SwitchModel,
)

A, B = "qwen3-tiny", "qwen3-moe-tiny"


def prompt(n: int, salt: int) -> list[int]:
    return [256] + [32 + (salt * 131 + i * 7) % 95 for i in range(n - 1)]


class Driver:
    """The instance agent's loop without NATS: scheduler actions executed on the engine."""

    def __init__(self, engine: TorchEngine, sp: bool) -> None:
        self.engine = engine
        self.sched = RoundScheduler(SchedulerConfig(sp=sp), [A, B], INITIAL_COSTS)
        self.reqs: dict[str, Sequence] = {}
        self.submitted: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.results: dict[str, object] = {}
        self.via: dict[str, str] = {}
        self.decodes = 0
        self.last_decode_model: str | None = None

    def submit(self, req: Sequence, continuation: bool) -> None:
        state, reusable = reusable_kv(self.engine, req.session_id, req.model, len(req.prompt_ids))
        now = time.perf_counter()
        self.sched.submit(AgentCall(req.call_id, req.session_id, req.model, call_index=int(continuation),
                                    prompt_tokens=len(req.prompt_ids), reusable_tokens=reusable, kv_state=state,
                                    max_tokens=req.max_tokens, arrived_at=now), now)
        self.reqs[req.call_id], self.submitted[req.call_id] = req, now

    def step(self) -> bool:
        action = self.sched.next_action(time.perf_counter())
        match action:
            case Idle():
                events = self.sched.drain_events()
                self._events(events)
                return False
            case SwitchModel():
                rec = self.engine.switch_to(action.to_model)
                events = self.sched.on_switch_done(action, time.perf_counter(), rec.total_s)
            case Prefill():
                steps = self.engine.prefill([self.reqs[c] for c in action.call_ids])
                events = self.sched.on_prefill_done(action, time.perf_counter(), self._tokens(steps))
            case Decode():
                steps = self.engine.decode([self.reqs[c] for c in action.call_ids])
                self.decodes += 1
                self.last_decode_model = self.engine.active_model
                events = self.sched.on_decode_done(action, time.perf_counter(), self._tokens(steps))
        self._events(events)
        return True

    def _tokens(self, steps) -> set[str]:
        now = time.perf_counter()
        for s in steps:
            self.first_token.setdefault(s.call_id, now)
        return {s.call_id for s in steps if s.finished}

    def _events(self, events) -> None:
        for e in events:
            if isinstance(e, CallAdmitted):
                self.via[e.call_id] = e.via
            elif isinstance(e, CallFinished) and e.reason != "aborted":
                self.results[e.call_id] = self.engine.finish(self.reqs[e.call_id])

    def run_until_idle(self, hook=None) -> None:
        while self.step():
            if hook is not None:
                hook(self)


def scenario(data: Path, device: str, sp: bool, sessions: int, prefix: int, long_tokens: int) -> dict:
    engine = TorchEngine(data, [A, B], device=device, kv_pages=2048, host_kv_pages=4096)
    d = Driver(engine, sp)
    try:
        firsts = {}
        for i in range(sessions):  # warm-up: each session's first call leaves its KV here
            req = Sequence(f"w{i}", f"s{i}", A, prompt(prefix, i), 4)
            d.submit(req, continuation=False)
            firsts[i] = req
        d.run_until_idle()
        for i in range(4):  # long work on both models keeps the rounds turning
            d.submit(Sequence(f"la{i}", f"la{i}", A, prompt(64, 100 + i), long_tokens), continuation=False)
            d.submit(Sequence(f"lb{i}", f"lb{i}", B, prompt(64, 200 + i), long_tokens), continuation=False)
        burst = []

        def inject(driver: Driver) -> None:
            # The tool results come back while A's slot is decoding (after its P, as in the paper).
            if burst or "la0" not in driver.via or driver.last_decode_model != A:
                return
            for i in range(4):  # meanwhile model B's traffic keeps arriving
                driver.submit(Sequence(f"nb{i}", f"nb{i}", B, prompt(64, 400 + i), long_tokens), continuation=False)
            for i in range(sessions):
                prev = firsts[i]
                out = d.results[prev.call_id].token_ids
                req = Sequence(f"r{i}", f"s{i}", A, prev.prompt_ids + out + prompt(24, 300 + i)[1:], 4)
                driver.submit(req, continuation=True)
                burst.append(req.call_id)

        d.run_until_idle(inject)
        ttft = sorted(d.first_token[c] - d.submitted[c] for c in burst)
        return {
            "ttft_p50": quantile(ttft, 0.50), "ttft_p95": quantile(ttft, 0.95),
            "via": {v: sum(d.via.get(c) == v for c in burst) for v in ("P", "SP")},
            "kv": sorted({d.results[c].kv_source for c in burst}),
            "texts": [d.results[c].text for c in burst],
            "sp_admitted": d.sched.sp_admitted, "sp_parked": d.sched.sp_parked,
        }
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1024, help="tokens of each returning session's prefix")
    ap.add_argument("--long-tokens", type=int, default=192, help="output length of the long calls in flight")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/sp_burst.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for sp in (True, False):  # interleaved so machine noise hits both alike
                runs[sp].append(scenario(Path(tmp), args.device, sp, args.sessions, args.prefix, args.long_tokens))
                print(f"rep {rep} sp={sp}: p50 {runs[sp][-1]['ttft_p50'] * 1e3:.1f} ms", file=sys.stderr)
    assert all(r["texts"] == runs[True][0]["texts"] for r in runs[True] + runs[False]), "SP changed output"
    on = {k: statistics.median(r[k] for r in runs[True]) for k in ("ttft_p50", "ttft_p95")}
    off = {k: statistics.median(r[k] for r in runs[False]) for k in ("ttft_p50", "ttft_p95")}
    lines = [
        "# Session-prefill burst (torch engine, one cold instance, two models)", "",
        f"device `{args.device}`, {args.sessions} returning sessions with {args.prefix}-token prefixes, "
        f"4 long calls ({args.long_tokens} output tokens) per model in flight, median of {args.reps} "
        "interleaved runs. "
        "Command: `python bench/sp_burst.py`.", "",
        "| SP | return TTFT p50 (ms) | return TTFT p95 (ms) | admitted via P / SP | KV source |",
        "|---|---:|---:|---|---|",
    ]
    for sp, agg in ((True, on), (False, off)):
        r = runs[sp][-1]
        lines.append(f"| {'on' if sp else 'off'} | {agg['ttft_p50'] * 1e3:.1f} | {agg['ttft_p95'] * 1e3:.1f} | "
                     f"{r['via']['P']} / {r['via']['SP']} | {', '.join(r['kv'])} |")
    lines += ["", f"SP off / SP on: p50 {off['ttft_p50'] / on['ttft_p50']:.2f}x, "
              f"p95 {off['ttft_p95'] / on['ttft_p95']:.2f}x. Greedy outputs identical in every run."]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
