"""Does the simulator predict the live stack? One small workload, live and simulated, per policy.

    python bench/sim_fidelity.py [--policies talaria,least-pressure,prefix-aware] [--sessions 12]
        [--agents 2] [--seed 0] [--out results/sim_fidelity.md] [--work DIR] [--reuse-live]

1. A generated agent workload (talaria/sim/workloads.agent_sessions: `--sessions` sessions over
   the three demo models, depth p50 4, prompts ~1,200 tokens, outputs p50 16 tokens, the
   paper's tool gaps baked in) in the served models' own token units.
2. Live, once per policy: `talaria replay`'s parts (an embedded stack with `--agents`
   instance agents, the closed-loop `Replayer`, token scale 1, recorded gaps), then the
   served calls exported as a trace (talaria/trace_export.py: prompt and output tokens as
   served, gaps as measured) and the SCTs from the `calls` rows.
3. Simulated: that exported trace through `talaria.sim` with the same policy, the same
   number of instances, the instance scheduler configured as the live agent configures it
   (SchedulerConfig.for_engine with the torch engine's capabilities), recorded gaps, each
   call's `max_tokens` = the cap the replayer sent, and the `local-torch` cost profile
   (talaria/sim/profiles.py, measured by `--measure` on this machine).
4. The table: SCT p50/p95 live vs simulated per policy, their ratio, whether the ranking
   agrees (results/sim_fidelity.md).

`--measure` prints the torch engine's prefill and decode costs on this machine (the
local-torch profile's numbers) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from talaria.replay import ReplayConfig, Replayer, metrics_from_db  # noqa: E402
from talaria.services.instance_agent.engine.contract import Capabilities  # noqa: E402
from talaria.services import configs  # noqa: E402
from talaria.services.instance_agent.scheduler import SchedulerConfig  # noqa: E402
from talaria.services.router.policy.base import PolicyConfig  # noqa: E402
from talaria.shared.settings import Settings  # noqa: E402
from talaria.shared.stats import quantile  # noqa: E402
from talaria.sim.cluster import RunConfig, simulate  # noqa: E402
from talaria.sim.metrics import session_scts  # noqa: E402
from talaria.sim.profiles import LOCAL_TORCH  # noqa: E402
from talaria.sim.workloads import agent_sessions  # noqa: E402
from talaria.trace_export import fetch_rows, rows_to_sessions  # noqa: E402
from talaria.traces.format import Session, TraceCall, save_sessions  # noqa: E402
from talaria.traces.load import load_trace  # noqa: E402
from talaria.traces.gaps import GapModel  # noqa: E402

MODELS = ["qwen3-tiny", "qwen3-moe-tiny", "gpt2-tiny"]
POLICIES = ("talaria", "least-pressure", "prefix-aware")
TOLERANCE = 0.20  # the bar: each policy's SCT p50 / p95 within 20 %
MAX_OUTPUT = 64  # ReplayConfig.max_output_tokens: the cap the replayer sends
PROBE_TOKENS = 48  # decode steps of the overhead probe (enough for a stable median)
GAPS = GapModel("recorded", None)  # the workload's own gaps, live and simulated


def workload(n: int, seed: int) -> list[Session]:
    return agent_sessions(n, MODELS, depth=4, prompt=1200, output=16, seed=seed)


def live_scheduler() -> SchedulerConfig:
    """The instance scheduler as the live agent builds it (runner.py) on the torch engine.
    Chunked prefill stays off here: the simulator prices a prompt's prefill whole."""
    caps = Capabilities(switch_with_calls_running=False, host_kv=True, d2d_staging=True, chunked_prefill=False)
    return configs.get("talaria", chunked_prefill=False).live_scheduler(caps)


# ---- live --------------------------------------------------------------------------------


def run_live(policy: str, sessions: list[Session], agents: int, work: Path) -> dict:
    from talaria.stack import Stack

    settings = Settings.from_env().with_(policy=policy, data_dir=work / f"stack-{policy}", http_port=0)
    stack = Stack(settings, agents=agents).start(progress=lambda m: print(f"  {m}", file=sys.stderr))
    try:
        run_id = f"fid-{uuid.uuid4().hex[:8]}"
        cfg = ReplayConfig(token_scale=1.0, max_prompt_tokens=100_000, max_output_tokens=MAX_OUTPUT)
        # A long-running server has run each model before: warm every model on the agents
        # (a process's first forward pass of a model costs ~0.5 s of one-off setup here),
        # so the measured run is the steady state the simulator models.
        warm = [Session(f"w{m}{k}", (TraceCall(f"w{m}{k}", 0, m, 64, 0, 2, 0.0),))
                for m in MODELS for k in range(2 * agents)]
        asyncio.run(Replayer(stack.client_nats_url, replace(cfg, models=tuple(MODELS)), GAPS, f"warm-{run_id}",
                             stack.api_key).run(_one_model_each(warm), progress=False))
        # The agent's own work per decode step (the loop, token publishing; not in the engine's
        # decode_s): one call alone per model, so no other call's work is in its wall time.
        for k, m in enumerate(MODELS):
            probe = Session(f"p{k}", (TraceCall(f"p{k}", 0, m, 256, 0, PROBE_TOKENS, 0.0),))
            asyncio.run(Replayer(stack.client_nats_url, replace(cfg, models=(m,)), GAPS, f"probe-{run_id}",
                                 stack.api_key).run([probe], progress=False))
        probe_calls = asyncio.run(_per_call(stack.database_url, f"probe-{run_id}", expect=len(MODELS)))
        since = datetime.now(timezone.utc)
        t0 = time.monotonic()
        stats = asyncio.run(Replayer(stack.client_nats_url, cfg, GAPS, run_id, stack.api_key).run(sessions))
        wall = time.monotonic() - t0
        metrics = asyncio.run(metrics_from_db(stack.database_url, run_id, stats.calls_sent))
        rows = [r for r in asyncio.run(fetch_rows(stack.database_url, since)) if _of_run(r["session_id"], run_id)]
        per_call = asyncio.run(_per_call(stack.database_url, run_id, expect=stats.calls_ok))
    finally:
        stack.stop()
    served = rows_to_sessions(rows)
    caps = {s.id: [min(MAX_OUTPUT, c.output_tokens) for c in s.calls] for s in sessions}
    # the cap each call was sent with (the exported rows do not keep it)
    served = [Session(s.id, tuple(replace(c, max_tokens=max(c.output_tokens, caps[_origin(s.id, run_id)][c.call_index]))
                                  for c in s.calls)) for s in served]
    save_sessions(served, work / f"served-{policy}.jsonl")
    return {"policy": policy, "run_id": run_id, "wall_s": wall, "calls_ok": stats.calls_ok,
            "calls_failed": stats.calls_failed, "errors": stats.errors, **metrics, "per_call": per_call,
            "probe": probe_calls}


async def _per_call(database_url: str, run_id: str, expect: int = 0, timeout_s: float = 30.0) -> list[dict]:
    """Each served call's timeline as the agent recorded it, once `expect` calls have one
    (telemetry projects the rows asynchronously)."""
    import asyncpg

    from talaria.shared.settings import asyncpg_dsn

    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            rows = await _rows(conn, run_id)
            if sum(r["total_s"] is not None for r in rows) >= expect or time.monotonic() > deadline:
                return rows
            await asyncio.sleep(0.2)
    finally:
        await conn.close()


async def _rows(conn, run_id: str) -> list[dict]:
    rows = await conn.fetch(
        "SELECT session_id, call_index, instance_id, model, prompt_tokens, cached_tokens, output_tokens, kv_source,"
        " queue_s, ttft_s, prefill_s, decode_s, slot_wait_s,"
        " extract(epoch FROM completed_at) - extract(epoch FROM submitted_at) AS total_s"
        " FROM calls WHERE session_id ~ ('(^|:)' || $1 || '-') ORDER BY session_id, call_index", run_id)
    return [{k: float(v) if k.endswith("_s") and v is not None else v for k, v in dict(r).items()} for r in rows]


def _one_model_each(sessions: list[Session]) -> list[Session]:
    """Warm-up sessions whose trace model is their served model (the replayer maps trace
    models in order of first appearance: list them so that each maps onto itself)."""
    return sorted(sessions, key=lambda s: MODELS.index(s.model))


def _of_run(session_id: str, run_id: str) -> bool:
    """Whether a served session id (`[tenant:]<run_id>-<id>`) is one of the run's sessions
    (not a warm-up or probe session, whose run ids only contain it)."""
    return re.search(f"(^|:){re.escape(run_id)}-", session_id) is not None


def _origin(served_id: str, run_id: str) -> str:
    """The workload session a served session id came from (`[tenant:]<run_id>-<id>`)."""
    return served_id.split(f"{run_id}-", 1)[1].split("@", 1)[0]


# ---- simulated ---------------------------------------------------------------------------


def step_overhead(probe: list[dict]) -> float:
    """The agent's time per decode step outside the engine's forward pass, from calls that
    ran alone: (completion - first token - decode_s) / steps, the median over the probes."""
    per_step = [(r["total_s"] - r["ttft_s"] - r["decode_s"]) / (r["output_tokens"] - 1)
                for r in probe if r.get("decode_s") is not None and (r["output_tokens"] or 0) > 1]
    return max(0.0, statistics.median(per_step)) if per_step else 0.0


def calibrated(per_call: list[dict], base=LOCAL_TORCH, overhead_s: float = 0.0):
    """`base` with its prefill and decode costs fitted to what the live run's engines took.

    The live agents share this machine's two cores with the stack's other processes (and
    whatever else runs here), so a step takes several times what `--measure` finds alone.
    From the agent-recorded timings of the run's calls (engine timings only, never an SCT):
      prefill = c0 + f_p * the profile's compute for the call's new tokens: c0 the median
        first-token time (ttft_s - queue_s) of calls that computed <= one page (16 tokens:
        the fixed cost of a prefill step, admission, first sample); f_p the median over
        calls that computed >= 256 tokens of their engine prefill time (prefill_s, the
        forward passes) over the profile's price;
      decode: a step's fixed part d0 = the median over calls of their engine decode time
        (decode_s, the decode steps they were in) / (output - 1), less the profile's batch
        and context terms, plus the agent's own work per step (`step_overhead`, measured
        by probe calls run alone before the replay);
    per model (the median over its calls; a model the run never served: all calls').
    """
    small, big, fd = [], {}, {}
    for r in per_call:
        if r.get("ttft_s") is None or r.get("total_s") is None:
            continue
        m = r["model"]
        mp = base.model(m)
        cached = r["cached_tokens"] or 0
        new = max(1, r["prompt_tokens"] - cached)
        if new <= 16:
            small.append(r["ttft_s"] - r["queue_s"])
        elif new >= 256 and r.get("prefill_s"):
            big.setdefault(m, []).append(r["prefill_s"] / (mp.prefill_s(new, cached) - mp.prefill_c0_s))
        steps = (r["output_tokens"] or 0) - 1
        if steps > 0 and r.get("decode_s"):  # the engine's step time less the profile's context term
            ctx = r["prompt_tokens"] + 1 + steps / 2
            fd.setdefault(m, []).append(r["decode_s"] / steps - mp.decode_d2_s * ctx)
    c0 = statistics.median(small) if small else 0.0
    every_p = [f for fs in big.values() for f in fs] or [1.0]
    every_d = [f for fs in fd.values() for f in fs]
    factors = {"prefill_c0_s": c0, "step_overhead_s": overhead_s}
    models = {}
    for n, m in base.models.items():
        kp = statistics.median(big.get(n) or every_p)  # a model the run never prefilled: all models' factor
        live_d = fd.get(n) or every_d
        d0 = (max(0.0, statistics.median(live_d) - m.decode_d1_s) if live_d else m.decode_d0_s) + overhead_s
        factors[n] = {"prefill": kp, "decode_d0_s": d0}
        models[n] = replace(m, prefill_k=m.prefill_k * kp, prefill_c0_s=c0, decode_d0_s=d0,
                            source=f"{m.source}; prefill c0 {c0 * 1e3:.0f} ms + x{kp:.2f}, decode d0 "
                                   f"{d0 * 1e3:.1f} ms (live run)")
    return base.with_models(models), {"calibration": factors}


def run_sim(policy: str, served: list[Session], agents: int, server=LOCAL_TORCH) -> dict:
    cfg = RunConfig(server, agents, policy, PolicyConfig(), live_scheduler(), GAPS, label=policy)
    result = simulate(served, cfg)
    scts = list(session_scts(result).values())
    per_call = [{"session_id": j.session, "call_index": j.call_index, "instance_id": j.instance,
                 "kv_source": j.kv_source, "ttft_s": j.first_token_t - j.release_t, "prefill_s": j.prefill_s,
                 "decode_s": j.decode_s, "total_s": j.done_t - j.release_t}
                for j in sorted(result.jobs, key=lambda j: (j.session, j.call_index))]
    return {"policy": policy, "per_call": per_call, "sessions": len(scts), "calls": len(result.jobs),
            "sct_p50": quantile(scts, 0.5), "sct_p95": quantile(scts, 0.95),
            "ttft_p50": quantile([j.first_token_t - j.release_t for j in result.jobs], 0.5),
            "switches": sum(len(i.switches) for i in result.instances)}


# ---- the engine's costs on this machine (the local-torch profile) -------------------------


def measure(reps: int = 5) -> dict:
    import torch

    from talaria.services.instance_agent.engine import Sequence, TorchEngine

    torch.set_num_threads(max(1, Settings.from_env().agent.torch_threads))  # as the agent (agent_service.py)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        eng = TorchEngine(Path(d), MODELS, kv_pages=2048, staging=False, hkvr=False)
        try:
            for m in MODELS:
                eng.switch_to(m)
                row = {}
                for n in (512, 2048):
                    ts = []
                    for r in range(reps):
                        t = time.perf_counter()
                        seq = Sequence(f"p{n}{r}", f"p{n}{r}", m, _ids(n, r), 1)
                        eng.prefill([seq])
                        ts.append(time.perf_counter() - t)
                        eng.finish(seq)
                    row[f"prefill_{n}_s"] = statistics.median(ts)
                for batch, ctx in ((1, 512), (1, 2048), (4, 512)):
                    ids = [f"d{batch}{ctx}{k}" for k in range(batch)]
                    seqs = [Sequence(c, c, m, _ids(ctx, k + 7), 64) for k, c in enumerate(ids)]
                    eng.prefill(seqs)
                    ts = []
                    for _ in range(8 * reps):
                        t = time.perf_counter()
                        eng.decode(seqs)
                        ts.append(time.perf_counter() - t)
                    for seq in seqs:
                        eng.finish(seq)
                    row[f"decode_b{batch}_ctx{ctx}_s"] = statistics.median(ts)
                out[m] = row
        finally:
            eng.close()
    return out


def _ids(n: int, salt: int) -> list[int]:
    return [1] + [(salt * 131 + i * 7 + (i // 97)) % 250 + 2 for i in range(n - 1)]


# ---- report ------------------------------------------------------------------------------


def rank(rows: dict[str, dict], key: str) -> list[str]:
    return sorted(rows, key=lambda p: rows[p][key])


def report(live: dict[str, dict], sim: dict[str, dict], args, command: str) -> str:
    lines = ["# Does the simulator predict the live stack?", "",
             f"One generated workload ({args.sessions} sessions over {', '.join(MODELS)}, depth p50 4, prompts "
             f"~1,200 tokens, outputs p50 16, the paper's tool gaps) replayed live on `{args.agents}` instance agents "
             "(embedded stack, torch engine on this machine's CPU) and in the simulator (the served calls as "
             "exported, recorded gaps, each call's `max_tokens` the cap the replayer sent, the `local-torch` "
             "profile, the live agent's scheduler configuration), once per policy.", "",
             f"Command: `{command}`", "",
             "| policy | live SCT p50 | sim SCT p50 | sim / live | live SCT p95 | sim SCT p95 | sim / live | "
             "within 20 % |", "|---|---|---|---|---|---|---|---|"]
    ok_all = True
    for p in live:
        lv, sv = live[p], sim[p]
        r50, r95 = sv["sct_p50"] / lv["sct_p50"], sv["sct_p95"] / lv["sct_p95"]
        ok = abs(r50 - 1) <= TOLERANCE and abs(r95 - 1) <= TOLERANCE
        ok_all &= ok
        lines.append(f"| {p} | {lv['sct_p50']:.2f} s | {sv['sct_p50']:.2f} s | {r50:.2f} | {lv['sct_p95']:.2f} s | "
                     f"{sv['sct_p95']:.2f} s | {r95:.2f} | {'yes' if ok else 'no'} |")
    same50 = rank(live, "sct_p50") == rank(sim, "sct_p50")
    same95 = rank(live, "sct_p95") == rank(sim, "sct_p95")
    lines += ["", f"Ranking by SCT p50: live {' < '.join(rank(live, 'sct_p50'))}; simulated "
              f"{' < '.join(rank(sim, 'sct_p50'))} ({'same' if same50 else 'different'}).",
              f"Ranking by SCT p95: live {' < '.join(rank(live, 'sct_p95'))}; simulated "
              f"{' < '.join(rank(sim, 'sct_p95'))} ({'same' if same95 else 'different'}).", "",
              f"All within 20 %: {'yes' if ok_all else 'no'}.", ""]
    lines += ["Live runs: " + "; ".join(
        f"{p}: {lv['calls_ok']} calls ok, {lv['calls_failed']} failed, {lv['wall_s']:.0f} s wall" for p, lv in live.items()),
        "", "The machine's speed during each live run, as the simulator was calibrated from it (`calibrated`: "
        "engine timings of the run's calls and of the probe calls before it; `--measure` alone on this machine: "
        "prefill x1, decode step ~1-4 ms):", "",
        "| policy | prefill fixed cost | agent per-step work | " + " | ".join(f"{m} prefill x / decode step" for m in MODELS)
        + " |", "|---|---|---|" + "---|" * len(MODELS)]
    for p in live:
        c = sim[p]["calibration"]
        lines.append(f"| {p} | {c['prefill_c0_s'] * 1e3:.0f} ms | {c['step_overhead_s'] * 1e3:.1f} ms | " + " | ".join(
            f"x{c[m]['prefill']:.1f} / {c[m]['decode_d0_s'] * 1e3:.1f} ms" for m in MODELS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=",".join(POLICIES), help="router policies, comma-separated")
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/sim_fidelity.md")
    ap.add_argument("--json", default="", help="also write the live and simulated figures, per call too, here")
    ap.add_argument("--work", default=None, help="keep the traces and live results here (default: a temp dir)")
    ap.add_argument("--reuse-live", action="store_true", help="reuse the live results and served traces in --work")
    ap.add_argument("--measure", action="store_true", help="print the engine's costs on this machine and stop")
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(), indent=1))
        return 0
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    work = Path(args.work or tempfile.mkdtemp(prefix="sim-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    sessions = workload(args.sessions, args.seed)
    save_sessions(sessions, work / "workload.jsonl")
    live, sim = {}, {}
    for p in policies:
        saved = work / f"live-{p}.json"
        if args.reuse_live and saved.exists():
            live[p] = json.loads(saved.read_text())
        else:
            print(f"live: {p}", file=sys.stderr)
            live[p] = run_live(p, sessions, args.agents, work)
            saved.write_text(json.dumps(live[p], indent=1, default=str))
        server, factors = calibrated(live[p]["per_call"], overhead_s=step_overhead(live[p].get("probe", [])))
        served = [s for s in load_trace(work / f"served-{p}.jsonl") if _of_run(s.id, live[p]["run_id"])]
        sim[p] = {**run_sim(p, served, args.agents, server), **factors}
        print(f"{p}: live SCT p50/p95 {live[p]['sct_p50']:.2f}/{live[p]['sct_p95']:.2f} s, "
              f"sim {sim[p]['sct_p50']:.2f}/{sim[p]['sct_p95']:.2f} s", file=sys.stderr)
    command = "python bench/sim_fidelity.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    text = report(live, sim, args, command.strip())
    (work / "sim.json").write_text(json.dumps(sim, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"live": live, "sim": sim}, indent=1, default=str))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
