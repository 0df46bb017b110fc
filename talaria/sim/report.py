"""Markdown report and paper-style plots from experiment results (results/README.md)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from talaria.sim.matrix_report import matrix_section

PAPER_FIXED = {  # calibration.md, headline table (SCT p50, SCT p95, TTFT p50, TTFT p95)
    "talaria": (189, 867, 0.55, 14.2),
    "no-sp": (623, None, 4.60, 20.5),
    "no-hkvr": (486, None, None, 26.33),
    "h2d-only": (194, 933, None, None),
    "round-only": (1000, 2296, 13.44, None),
}
COLORS = {"talaria": "C0", "no-sp": "C1", "no-hkvr": "C2", "h2d-only": "C3", "round-only": "C4"}


def _f(x, nd=1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{nd}f}"


def _cdf(ax, values, label, color=None):
    v = sorted(values)
    if not v:
        return
    ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=label, color=color)


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path.name


def fixed_replay_section(res: dict, out: Path, title: str, tag: str) -> list[str]:
    cfgs = res["configs"]
    lines = [f"## {title}", ""]
    lines.append("| configuration | SCT p50 | SCT p95 | TTFT p50 | TTFT p95 | paper SCT p50 / p95 | paper TTFT p50 / p95 | rounds | switch share | SP admitted / parked | oracle SCT p50 / p95 |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in cfgs.items():
        p = PAPER_FIXED.get(name, (None,) * 4)
        lines.append(
            f"| {name} | {_f(s['sct_p50'])} | {_f(s['sct_p95'])} | {_f(s['ttft_p50'], 2)} | {_f(s['ttft_p95'], 2)} "
            f"| {_f(p[0], 0)} / {_f(p[1], 0)} | {_f(p[2], 2)} / {_f(p[3], 2)} | {s['rounds']['count']} "
            f"| {_f(s['rounds']['switch_share'], 3)} | {s['sp']['admitted']} / {s['sp']['parked']} "
            f"| {_f(s['oracle']['sct_p50'])} / {_f(s['oracle']['sct_p95'])} |"
        )
    pr = res["paired"]
    lines += [
        "",
        f"Talaria vs Round-only: p50 speedup **{pr['speedup_p50']:.2f}x** (paper 5.3x), p95 "
        f"**{pr['speedup_p95']:.2f}x** (paper 2.6x); {pr['improved']} of {pr['total']} paired "
        f"model-sessions improve (paper 29 of 30). Talaria p50 SCT / oracle p50 = "
        f"{pr['talaria_over_oracle_p50']:.2f}.",
        "",
    ]
    bound, rnd = res.get("bound"), cfgs.get("round-only")
    if bound and rnd:
        t, tr = cfgs["talaria"], cfgs["talaria"]["rounds"]
        ph = t.get("switch_phases_s", {})
        fixed = sum(ph.get(k, 0.0) for k in ("P1", "P3", "P4", "P5"))
        kv = {k: ph.get(k, 0.0) for k in ("kv_park", "kv_unpark", "kv_resume")}
        lines += [
            "What bounds the speedup: the capacity-aware bound is, at each percentile, the lower of "
            "two idealised runs: Talaria's own schedule with every weight and KV transfer free "
            "(talaria/sim/schedule_bound.py; below Talaria for every session by construction: "
            f"{_f(bound['schedule']['sct_p50'])} / {_f(bound['schedule']['sct_p95'])} s) and the same "
            "scheduler on a server with free memory (the capacity-bound row: every model resident, every "
            f"KV on device, switches at their fixed phases; {_f(bound['free_memory_run']['sct_p50'])} / "
            f"{_f(bound['free_memory_run']['sct_p95'])} s; another schedule, so alone it is no bound). "
            f"The bound is {_f(bound['sct_p50'])} s p50 = {rnd['sct_p50'] / bound['sct_p50']:.2f}x Round-only, "
            f"so 6x needs Talaria within {rnd['sct_p50'] / 6 / bound['sct_p50']:.3f}x of it; it is at "
            f"{t['sct_p50'] / bound['sct_p50']:.3f}x. Talaria's {tr['count']} rounds average "
            f"{tr['wall_s'] / tr['count']:.1f} s (Eq. 5 caps a round at gamma x T_TTFT = 9 s) and spend "
            f"{tr['switch_s']:.0f} s switching ({tr['switch_share']:.1%}): weights (P2) {ph.get('P2', 0.0):.1f} s, "
            f"fixed phases (P1, P3-P5) {fixed:.1f} s, running calls' KV parked on device / moved back "
            f"{kv['kv_park']:.1f} / {kv['kv_unpark']:.1f} s (D2D), restored from host {kv['kv_resume']:.1f} s.",
            "",
        ]
    t = cfgs["talaria"]
    sw = t["switch"]["by_path"]
    lines.append(
        "Talaria switch paths: "
        + ", ".join(f"{p} {v['share']:.0%} (p50 {v['p50'] * 1000:.0f} ms)" for p, v in sw.items())
        + f"; HBM peak {t['hbm_peak_gib_per_gpu']:.1f} GiB of {t['hbm_cap_gib_per_gpu']:.0f} GiB per GPU."
    )
    lines.append("")
    # one figure, four panels: results/ keeps one file per plot, not one per panel
    fig, ((sct, box), (ttft, switch)) = plt.subplots(2, 2, figsize=(10.5, 6.4))
    for name, s in cfgs.items():
        _cdf(sct, [x["sct"] for x in s["per_session"] if x["sct"]], name, COLORS.get(name))
    _cdf(sct, [x["oracle"] for x in t["per_session"]], "oracle", "k")
    sct.set_xscale("log"), sct.set_xlabel("Session completion time (s)"), sct.set_ylabel("CDF"), sct.legend(fontsize=7)
    data = [[x["sct"] for x in s["per_session"] if x["sct"]] for s in cfgs.values()]
    box.boxplot(data, whis=(0, 100), showfliers=False)
    for i, d in enumerate(data, start=1):
        box.scatter([i] * len(d), d, s=6, alpha=0.6)
    box.set_xticks(range(1, len(cfgs) + 1), list(cfgs), fontsize=7)
    box.set_ylabel("SCT per session (s)")
    for name, s in cfgs.items():
        _cdf(ttft, [max(v, 1e-3) for v in s.get("ttft_samples", [])], name, COLORS.get(name))
    ttft.set_xscale("log"), ttft.set_xlabel("TTFT (s)"), ttft.set_ylabel("CDF"), ttft.legend(fontsize=7)
    for name in ("talaria", "h2d-only"):
        _cdf(switch, [x * 1000 for x in cfgs[name]["switch"]["samples"]], name, COLORS[name])
    switch.set_xscale("log"), switch.set_xlabel("Switch latency (ms)"), switch.set_ylabel("CDF"), switch.legend(fontsize=7)
    a = _save(fig, out / f"{tag}_replay.png")
    lines += [f"![SCT CDF, per-session SCT, TTFT CDF, switch CDF]({a})", ""]
    return lines


def _seed_mean(s: dict, key: str):
    return s.get("seeds", {}).get(f"{key}_mean")


def router_section(res: dict, out: Path) -> list[str]:
    n = res.get("seeds", 1)
    lines = ["## Router testbed (two TP=4 workers, 120 calls, 30 model-sessions)", ""]
    if res.get("skipped"):
        lines.append(f"Not in the router registry yet (skipped): {', '.join(res['skipped'])}.")
        lines.append("")
    lines += [
        f"Counters, TTFT and the first SCT columns are gap seed 0; the last two columns are means over "
        f"{n} gap seeds (with 30 model-sessions, one seed's p95 is the 29th of 30 SCTs). Three models on two "
        "instances: the faithful peers run as a serverless deployment runs them (deployment.py: on-demand "
        "loading, the peer's rule among the instances holding the model, a model loaded where it starts "
        "fastest); talaria's instances are cold talaria agents that time-share models in rounds; the "
        "'(transplanted)' rows are the model-blind routers of the earlier tables on the same cold instances, "
        "kept for comparison with them.",
        "",
        f"| load | policy | avoidable cold opens | model opens | same-instance returns | TTFT p50 | TTFT p95 | SCT p50 | SCT p95 | oracle SCT p50 | SCT p50, mean of {n} | SCT p95, mean of {n} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for load, pols in res["loads"].items():
        for pol, s in pols.items():
            r = s["router"]
            lines.append(
                f"| {load} | {pol} | {s['avoidable_cold_opens']} | {r['model_opens']} | {_f(r['same_instance_returns'] * 100 if r['same_instance_returns'] is not None else None)}% "
                f"| {_f(s['ttft_p50'], 2)} | {_f(s['ttft_p95'], 2)} | {_f(s['sct_p50'], 2)} | {_f(s['sct_p95'], 2)} | {_f(s['oracle']['sct_p50'], 2)} "
                f"| {_f(_seed_mean(s, 'sct_p50'), 2)} | {_f(_seed_mean(s, 'sct_p95'), 2)} |"
            )
    loads = list(res["loads"])
    pols = list(next(iter(res["loads"].values())))
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    width = 0.8 / max(1, len(pols))
    for k, pol in enumerate(pols):
        xs = [i + k * width for i in range(len(loads))]
        axes[0].bar(xs, [res["loads"][l][pol]["avoidable_cold_opens"] for l in loads], width, label=pol)
        axes[1].bar(xs, [_seed_mean(res["loads"][l][pol], "sct_p95") or res["loads"][l][pol]["sct_p95"]
                         for l in loads], width, label=pol)
    for ax, t in zip(axes, ("Avoidable cold opens (seed 0)", f"SCT p95 (s), mean of {n} seeds")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(loads))], loads)
        ax.set_title(t, fontsize=9)
    axes[0].legend(fontsize=7)
    a = _save(fig, out / "router_bars.png")
    return lines + ["", f"![router]({a})", ""]


def tau_section(res: dict, out: Path) -> list[str]:
    lines = ["## Lease timeout sweep", ""]
    if not res.get("points"):
        return lines + [f"Skipped: {res.get('skipped', 'no data')}.", ""]
    lines.append("| tau | same-instance returns | model-residency hits | model opens | unused leases | returning TTFT p50 / p95 |")
    lines.append("|---|---|---|---|---|---|")
    for tau, s in res["points"].items():
        r = s["router"]
        lines.append(
            f"| {tau} | {_f(r['same_instance_returns'] * 100)}% | {_f(r['model_residency_hits'] * 100)}% | {r['model_opens']} "
            f"| {r['unused_leases']} | {_f(s['returning_ttft_p50'], 2)} / {_f(s['returning_ttft_p95'], 2)} |"
        )
    lines += ["", "Rows marked 'paper admission' turn `kv_home_admits` off: then a return whose home "
              "instance is over the round budget only stays home while its lease is live, which is the "
              "effect the paper's sweep measures. With the rule on, the cost ranking keeps (nearly) every "
              "return home at any tau in this testbed, and tau mostly changes how many leases go unused."]
    pts = [(k, v) for k, v in res["points"].items() if k.replace(".", "", 1).isdigit()]
    fig, ax = plt.subplots(figsize=(5, 3))
    xs = [float(k) for k, _ in pts]
    ax.plot(xs, [v["router"]["same_instance_returns"] * 100 for _, v in pts], "o-", label="same instance")
    ax.plot(xs, [v["router"]["model_residency_hits"] * 100 for _, v in pts], "s-", label="model-residency hit")
    ax.set_xlabel("lease timeout tau (s)"), ax.set_ylabel("%"), ax.legend(fontsize=7)
    a = _save(fig, out / "tau_sweep.png")
    return lines + ["", f"![tau]({a})", ""]


def scale_section(res: dict, out: Path) -> list[str]:
    rate = res.get("arrival_rate_s")
    lines = [
        f"## Scale: {res['instances']} instances, {res['models']} models (Zipf s={res['zipf_s']}), {res['sessions']} sessions"
        + (f", {rate:g} sessions/s" if rate is not None else ""),
        "",
        "Every instance runs the agent's own RoundScheduler, HkvrCore and StagingPlanner; the router "
        "is the project's RouterCore. Simulator wall time is on this 2-core machine (noisy: the same "
        "run varies by ~15-25%).",
        "",
    ]
    if res.get("skipped"):
        lines.append(f"Not in the router registry yet (skipped): {', '.join(res['skipped'])}.")
        lines.append("")
    lines.append("Deployment: where the models fit the instances (here), each peer runs static per-model pools "
                 "split by the workload's offered demand (deployment.py; an exact forecast, which favours the "
                 "peers) and never switches; talaria starts from an even split and its router resizes the pools "
                 "online from the demand it measures (services/router/hot_pools.py; `repins`).")
    lines.append("")
    lines.append("| policy | deployment | status | SCT p50 | SCT p95 | TTFT p50 | TTFT p95 | oracle SCT p50 | avoidable cold opens | switches | calls done / total | events | virtual end (s) | simulator wall (s) | mean policy decision (us) |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for pol, s in res["policies"].items():
        status = "complete" if s.get("complete", True) else ("CAPPED (stopped at the wall cap)" if s.get("capped") else "incomplete")
        total = s.get("calls_total", s["calls"])
        lines.append(
            f"| {pol} | {s.get('deployment', 'cold instances (time-share every model)')}"
            + (f", {s['repins']} repins" if s.get("repins") else "") + f" | {status} | {_f(s['sct_p50'])} | {_f(s['sct_p95'])} | {_f(s['ttft_p50'], 2)} | {_f(s['ttft_p95'], 2)} | {_f(s['oracle']['sct_p50'])} "
            f"| {s['avoidable_cold_opens']} | {s['switch']['count']} | {s['calls']} / {total} | {s.get('events', '')} "
            f"| {_f(s['virtual_s']) if 'virtual_s' in s else ''} | {_f(s['run_time_s'])} | {_f(s['router']['mean_decision_us'])} |"
        )
    pols = res["policies"]
    if any(not s.get("complete", True) for s in pols.values()):
        lines += ["", "SCT/TTFT of a capped run cover only the sessions it finished (biased low)."]
    t, f = pols.get("talaria"), pols.get("talaria-forecast-pools")
    if t and f and t.get("complete", True) and f.get("complete", True):
        lines += ["", f"talaria with its online hot pools: SCT p50 / p95 {_f(t['sct_p50'])} / {_f(t['sct_p95'])} s "
                  f"({t.get('repins', 0)} repins, {t['avoidable_cold_opens']} avoidable cold opens); given the peers' "
                  f"forecast pools (talaria-forecast-pools, an ablation): {_f(f['sct_p50'])} / {_f(f['sct_p95'])} s. "
                  "The difference is the online controller's (services/router/hot_pools.py), not placement "
                  "inside the pools; results/matrix_notes.md discusses it."]
    if res.get("sessions", 0) < 10_000:
        lines += ["", f"A reduced run ({res['sessions']:,} sessions, `--scale-sessions {res['sessions']}`): with "
                  "per-model pools a 10,000-session run takes several minutes per policy on this shared machine."]
    lines += ["", "Simulator cost per event (wall / events): " + ", ".join(
        f"{p} {s['run_time_s'] / s['events'] * 1e6:.0f} us" for p, s in pols.items() if s.get("events")) + "."]
    lp, pa = pols.get("least-pressure"), pols.get("prefix-aware")
    if lp and pa and lp["sct_p50"] == pa["sct_p50"] and lp["sct_p95"] == pa["sct_p95"]:
        lines += ["", "prefix-aware equals least-pressure here: the synthetic catalogue gives every session "
                  "its own prefix, so there is no cross-session cache hit to follow and sgl-router's rule "
                  "falls back to load balancing."]
    if "kv-cost" in pols and not pols["kv-cost"].get("complete", True):
        lines += ["", "kv-cost never keeps up with arrivals (its virtual clock runs far past the last "
                  "arrival): Dynamo's cost counts prompt blocks and active decode blocks but not model "
                  "residency, so with 20 models on 64 time-shared instances it spreads every model over "
                  "many instances and rounds fill with switches. It runs under its own, shorter wall cap "
                  "(`--scale-policies kv-cost --scale-cap-s 300`)."]
    return lines + [""]


def goals_section(results: dict) -> list[str]:
    """Issue 6's goals, judged from the results in this report (only those present)."""
    rows = []
    fixed = results.get("fixed-replay")
    if fixed:
        pr, t, r = fixed["paired"], fixed["configs"]["talaria"], fixed["configs"]["round-only"]
        rows.append(("Talaria / Round-only SCT p50 >= 5.3x (TP=8 fixed replay)",
                     f"{pr['speedup_p50']:.2f}x ({t['sct_p50']:,.0f} s vs {r['sct_p50']:,.0f} s)", pr["speedup_p50"] >= 5.3))
        rows.append(("Talaria / Round-only SCT p95 >= 2.6x",
                     f"{pr['speedup_p95']:.2f}x ({t['sct_p95']:,.0f} s vs {r['sct_p95']:,.0f} s)", pr["speedup_p95"] >= 2.6))
        ratio = pr["talaria_over_oracle_p50"]
        rows.append(("Talaria within 1.5x of the oracle bound at p50",
                     f"{ratio:.2f}x ({t['sct_p50']:,.0f} s vs {t['oracle']['sct_p50']:,.0f} s); see the notes: "
                     "three models time-share one server", ratio <= 1.5))
        bound = fixed.get("bound")
        if bound:
            rc = t["sct_p50"] / bound["sct_p50"]
            rows.append(("Talaria within 1.3x of the capacity-aware bound at p50 (same server, memory and "
                         "transfers free; see the fixed replay section)",
                         f"{rc:.2f}x ({t['sct_p50']:,.0f} s vs {bound['sct_p50']:,.0f} s)", rc <= 1.3))
        rows.append(("Talaria / Round-only SCT p50 >= 6x and p95 >= 3x (issue 10)",
                     f"{pr['speedup_p50']:.2f}x / {pr['speedup_p95']:.2f}x",
                     pr["speedup_p50"] >= 6 and pr["speedup_p95"] >= 3))
    router = results.get("router")
    for load in ("medium", "high"):
        pols = (router or {}).get("loads", {}).get(load)
        if not pols or "talaria" not in pols:
            continue
        seeded = "seeds" in pols["talaria"]

        def get(s: dict) -> float:
            return _seed_mean(s, "sct_p95") if seeded else s["sct_p95"]

        best = min((p for p in pols if p != "talaria" and "transplanted" not in p), key=lambda p: get(pols[p]))
        t0, b0 = pols["talaria"]["sct_p95"], pols[best]["sct_p95"]
        how = f"mean of {router.get('seeds', 1)} gap seeds" if seeded else "one seed"
        rows.append((f"Talaria ahead of every faithful peer (as deployed) on SCT p95, router testbed, {load} load",
                     f"{get(pols['talaria']):.1f} s vs {best} {get(pols[best]):.1f} s ({how}; seed 0: "
                     f"{t0:.1f} vs {b0:.1f} s)", get(pols["talaria"]) < get(pols[best])))
    scale = results.get("scale")
    if scale and scale.get("sessions", 0) >= 10_000:
        walls = ", ".join(f"{p} {s['run_time_s']:.0f} s" + ("" if s.get("complete", True) else " (capped)")
                          for p, s in scale["policies"].items())
        ok = all(s.get("complete", True) and s["run_time_s"] < 60 for s in scale["policies"].values())
        rows.append((f"{scale['sessions']:,} sessions / {scale['instances']} instances / {scale['models']} models in < 60 s",
                     walls, ok))
    if not rows:
        return []
    lines = ["## Goals (issue 6) against this report", "", "| goal | result | met? |", "|---|---|---|"]
    lines += [f"| {g} | {r} | {'yes' if ok else 'no'} |" for g, r, ok in rows]
    return lines + [""]


NOTES = """How to read this report (details in talaria/sim/*.py docstrings):

- Regenerate: `python -m talaria.sim.experiments all --out results/` (scale defaults to 10,000
  sessions at 0.25 sessions/s; `--scale-sessions N`, `--scale-rate R` (sessions per second) and
  `--scale-cap-s S` (wall-clock cap per policy, reported as CAPPED) change it). Each experiment
  run alone (`fixed-replay|router|tau-sweep|scale`) rewrites its entry of sim_report.json and then
  this report from every experiment in the folder; `report` only rewrites the report.
- Instances: the instance agent's own core (`AgentCore`, services/instance_agent/agent_core.py, with
  its `RoundScheduler`) makes every instance decision and writes every record; the simulator's
  executor only prices actions with the profile and keeps device-KV occupancy; the host KV
  registry is the agent's own `HkvrCore` (512-token sim pages) and weight staging the agent's own
  `StagingPlanner` (4 GiB sim chunks, written at H2D bandwidth, dirtied by KV growth). Decode runs
  as multi-step actions (`next_action(now, max_decode_steps=4096)`), cut at every scheduler
  boundary and at each submission, so it equals one-token stepping (tested).
- Router: the project's `RouterCore` with registry policies, overload='queue' in every
  experiment (with 'reject' the talaria policy abandoned sessions whose first-call recompute
  exceeds gamma*T_TTFT, which shortened its SCTs unfairly); snapshots heartbeat at 0.5 s,
  lazily at decision times.
- Scheduler settings (talaria/sim/executor.py instance_config, each tagged): T_TTFT 10 s [paper
  §2.4], gamma 0.9 [App. E: <1], T_TPOT 0.2 s [asm: no paper number; scheduler default],
  drain_on_switch False and fill_slot True [§3.4: Dfin spends the remaining protected budget,
  then the slot closes when the round budget is exhausted], SP batch 8, max batch 64 [asm].
  In-flight calls of a switched-out model keep their KV on device while HBM has room (the
  agent's memory/parked_kv.py; two D2D moves per park [asm]); what it offloads under pressure,
  and all of it in round-only (the paper's baseline), is restored on the reopening switch
  at the KV restore rate (half the weight H2D rate [asm]).
- Gaps: the paper's lognormal (p50 0.39 s, p95 1.32 s), capped at 10 s. Fixed replay: 10 WEKA
  sessions (320 calls) x 3 models; prompt/reuse tokens x0.25 (paper p50 25K), outputs as
  recorded (p50 ~230 tokens, capped 2,048).
- Why SCTs exceed the paper's and Talaria/oracle is ~5: the WEKA outputs make decode dominate,
  and three models time-share one server, so each session decodes only in its model's slots.
  The oracle (no queueing, no switch waits, batch-1 decode, the server to itself) is 169 s
  p50; one TP=8 server serving all three models' decode back to back needs roughly 3x that,
  so "within 1.5x of the oracle" is not reachable on this workload by any scheduler.
- Router testbed: the same time-shared instance model on two TP=4 workers, hence SCTs ~5x the
  paper's; load levels are session inter-arrival 6 / 2 / 0.5 s ([asm]). The talaria policy
  runs with its rules beyond the paper (docs/design.md): a return passes admission where its
  KV is; decode is priced by the rotation it joins, over the calls the session will still
  make; a model new to an instance's rotation pays the slot and switch it adds to the
  sessions living there (price_rotation_join); and a session's first call prices the backlog
  and occupancy its session will share; results/router_sensitivity.md adds them one at a time
  (before the rotation-join rule; its effect: results/matrix_notes.md, serverless).
- Peers: the faithful peers (services/router/policy/, each citing its source, round-robin
  included) are deployed as in talaria/sim/deployment.py: serverless on-demand loading where
  the models outnumber the instances (router testbed), per-model pools split by the
  workload's demand where they fit (scale); the model-blind routers of the earlier tables
  appear only as "(transplanted)" rows of the router testbed.
"""


def write_report(results: dict, out: Path, notes: str = NOTES) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Talaria simulator report", "", notes, ""]
    if "fixed-replay" in results:
        title = "TP=8 fixed replay (the instance agent's core and RoundScheduler)"
        lines += fixed_replay_section(results["fixed-replay"], out, title, "fixed")
    if "router" in results:
        lines += router_section(results["router"], out)
    if "tau-sweep" in results:
        lines += tau_section(results["tau-sweep"], out)
    if "scale" in results:
        lines += scale_section(results["scale"], out)
    if "matrix" in results:
        lines += matrix_section(results["matrix"])
    lines += goals_section(results)
    path = out / "sim_report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
