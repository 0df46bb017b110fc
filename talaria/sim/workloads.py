"""Workload builders: which sessions a run replays, on which models, starting when.

- `fixed_replay`: the paper's headline shape (§5.1): 10 sessions x 3 models = 30
  model-sessions, ~960 calls, all released at t=0, closed loop. The 10 sessions come from
  the WEKA trace (`select_sessions`, shipped in talaria/sim/data/ so runs need no 460 MB
  pass); their token counts are scaled to the paper's regime (see `scale_tokens`).
- `router_testbed`: 120 calls, 30 model-sessions (10 sessions x first 4 calls x 3 models)
  on the TP=4 testbed's models, with session starts spread by an offered-load level.
- `synthetic_catalogue`: thousands of sessions over many models with Zipf popularity,
  Poisson session arrivals, and depth/prompt/output distributions fitted to the paper's
  Fig. 2 (calibration.md) — the scale experiment.

Token scaling (fixed replay and router testbed): WEKA prompts are ~4x the paper's (p50
104,644 vs 25K, shared/traces/README.md), so prompt and reusable-prefix tokens are
multiplied by 0.25 and capped at the model context (131,072); outputs are capped at 2,048.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from importlib import resources
from pathlib import Path

from talaria.traces.format import Session, TraceCall
from talaria.traces.load import load_trace
from talaria.traces.format import save_sessions, sessions_from_calls
from talaria.traces.weka import iter_weka_sessions
from talaria.traces.gaps import PAPER_GAP_P50_S, PAPER_GAP_P95_S

DATA = Path(str(resources.files("talaria.sim").joinpath("data")))  # package data in the wheel
FIXED_REPLAY_FILE = DATA / "fixed_replay_sessions.jsonl"
ROUTER_FILE = DATA / "router_sessions.jsonl"
WEKA_DEFAULT = Path("/work/shared/traces/weka_cc_traces.jsonl.xz")

TOKEN_SCALE = 0.25  # [der] paper p50 25K / WEKA p50 104,644
# The system prompt + tool schema every Claude Code session of a model opens with, as
# bench/session_attribution.py models it (16K tokens); the WEKA replays share it per model
# (RunConfig.shared_prefix), scaled with their prompts where they are scaled.
SYSTEM_PROMPT_TOKENS = 16_384  # [asm]
CONTEXT_CAP = 131_072
OUTPUT_CAP = 2_048
PAPER_MODELS = ("qwen3-235b", "glm5-nvfp4", "qwen3.5-122b-a10b")
TESTBED_MODELS = ("qwen3-32b", "qwen2.5-32b-instruct", "qwen3.5-35b-a3b")


def scale_tokens(session: Session, factor: float = TOKEN_SCALE, cap: int = CONTEXT_CAP) -> Session:
    calls = []
    for c in session.calls:
        prompt = max(1, min(cap, round(c.prompt_tokens * factor)))
        reusable = min(prompt - 1 if prompt > 1 else 0, round(c.reusable_prefix_tokens * factor))
        calls.append(
            replace(
                c,
                prompt_tokens=prompt,
                reusable_prefix_tokens=reusable if c.call_index else 0,
                output_tokens=min(OUTPUT_CAP, c.output_tokens),
            )
        )
    return Session(session.id, tuple(calls))


def on_model(session: Session, model: str, start_s: float = 0.0, suffix: bool = True) -> Session:
    """The session replayed on `model` (a model-session), starting at `start_s`."""
    sid = f"{session.id}@{model}" if suffix else session.id
    calls = tuple(
        replace(c, session=sid, model=model, gap_before_s=start_s if c.call_index == 0 else c.gap_before_s)
        for c in session.calls
    )
    return Session(sid, calls)


def truncate(session: Session, n: int) -> Session:
    return Session(session.id, session.calls[:n])


def select_sessions(
    sessions: list[Session], count: int, total_calls: int, lo: int, hi: int, seed: int = 7
) -> list[Session]:
    """`count` parent sessions with depth in [lo, hi] whose depths sum to `total_calls`.

    Deterministic for a seed; tries shuffles until the last pick can close the sum.
    """
    pool = [s for s in sessions if "/" not in s.id and lo <= len(s.calls) <= hi]
    by_depth: dict[int, list[Session]] = {}
    for s in pool:
        by_depth.setdefault(len(s.calls), []).append(s)
    rng = random.Random(seed)
    for _ in range(10_000):
        picks = rng.sample(pool, count - 1)
        need = total_calls - sum(len(s.calls) for s in picks)
        ids = {s.id for s in picks}
        last = [s for s in by_depth.get(need, []) if s.id not in ids]
        if last:
            return sorted(picks + [last[0]], key=lambda s: s.id)
    raise ValueError(f"no {count} sessions in depth [{lo}, {hi}] sum to {total_calls}")


def build_data_files(weka: Path = WEKA_DEFAULT, out: Path = DATA) -> tuple[Path, Path]:
    """Regenerate the shipped session selections from the WEKA trace (streaming pass)."""
    # Sessions whose prompts stay <= 420K tokens (105K after scaling: the paper's p95).
    parents = [
        s
        for s in (sessions_from_calls(c)[0] for c in iter_weka_sessions(weka, subagents="drop"))
        if max(c.prompt_tokens for c in s.calls) <= 420_000
    ]
    fixed = select_sessions(parents, 10, 320, 24, 44, seed=7)
    used = {s.id for s in fixed}
    router = select_sessions([s for s in parents if s.id not in used], 10, 200, 8, 40, seed=11)
    out.mkdir(parents=True, exist_ok=True)
    save_sessions(fixed, out / FIXED_REPLAY_FILE.name)
    save_sessions(router, out / ROUTER_FILE.name)
    return out / FIXED_REPLAY_FILE.name, out / ROUTER_FILE.name


def fixed_replay(path: Path = FIXED_REPLAY_FILE, models=PAPER_MODELS, scale: float = TOKEN_SCALE) -> list[Session]:
    """10 sessions x 3 models, all released at t=0 (the paper's closed-loop fixed replay)."""
    base = [scale_tokens(s, scale) for s in load_trace(path)]
    return [on_model(s, m) for s in base for m in models]


LOAD_INTERARRIVAL_S = {"low": 6.0, "medium": 2.0, "high": 0.5}  # [asm] see module doc


def router_testbed(
    load: str, path: Path = ROUTER_FILE, models=TESTBED_MODELS, calls_per_session: int = 4,
    scale: float = TOKEN_SCALE,
) -> list[Session]:
    """120 calls, 30 model-sessions; model-sessions start every LOAD_INTERARRIVAL_S[load]."""
    try:
        every = LOAD_INTERARRIVAL_S[load]
    except KeyError:
        raise KeyError(f"unknown load {load!r}; use {', '.join(LOAD_INTERARRIVAL_S)}") from None
    base = [truncate(scale_tokens(s, scale), calls_per_session) for s in load_trace(path)]
    out = []
    k = 0
    for s in base:
        for m in models:
            out.append(on_model(s, m, start_s=k * every))
            k += 1
    # interleave so that start order does not group a model's sessions together
    return out


def _lognormal(rng: random.Random, p50: float, p95: float) -> float:
    sigma = math.log(p95 / p50) / 1.6448536269514722
    return rng.lognormvariate(math.log(p50), sigma)


def synthetic_catalogue(
    sessions: int,
    models: list[str],
    arrival_rate_s: float,
    zipf_s: float = 1.0,
    seed: int = 0,
    max_depth: int = 187,
) -> list[Session]:
    """Sessions drawn from the paper's Fig. 2 distributions over a Zipf-skewed catalogue.

    Depth: lognormal p50 11 / p95 49, capped at 187 [cal]. First prompt: lognormal p50 8K /
    p95 40K [asm]; each call appends the previous output plus a tool result (lognormal p50
    1.5K / p95 8K [asm]) so prompts reach ~25K at p50 [cal target]; prompts are capped at
    131,072 with the oldest context dropped (reuse = 0 on that call). Outputs: lognormal
    p50 216 / p95 1,543 [WEKA README], capped at 2,048. Model k has weight 1/(k+1)**zipf_s.
    Session starts: Poisson with `arrival_rate_s` sessions per second.
    """
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf_s for k in range(len(models))]
    t = 0.0
    out: list[Session] = []
    for i in range(sessions):
        t += rng.expovariate(arrival_rate_s)
        model = rng.choices(models, weights)[0]
        depth = max(1, min(max_depth, round(_lognormal(rng, 11, 49))))
        sid = f"s{i:05d}"
        calls = []
        prompt = max(256, round(_lognormal(rng, 8_000, 40_000)))
        prev_total = 0
        for idx in range(depth):
            if idx:
                grown = prev_total + max(16, round(_lognormal(rng, 1_500, 8_000)))
                prompt, reusable = (grown, prev_total) if grown <= CONTEXT_CAP else (min(grown, CONTEXT_CAP) // 2, 0)
            else:
                reusable = 0
            prompt = min(prompt, CONTEXT_CAP)
            output = max(1, min(OUTPUT_CAP, round(_lognormal(rng, 216, 1_543))))
            calls.append(
                TraceCall(sid, idx, model, prompt, min(reusable, prompt), output, t if idx == 0 else 1.0,
                          "start" if idx == 0 else "tool", "synthetic")
            )
            prev_total = prompt + output
        out.append(Session(sid, tuple(calls)))
    return out


HEAVY_GAP_P50_S = 0.39  # [cal] the paper's tool-gap median ...
HEAVY_GAP_OVER_5S = 0.10  # ... with a heavy tail: 10 % of gaps exceed 5 s (issue 10)
HEAVY_GAP_CAP_S = 120.0  # [asm] a tool that runs longer than 2 minutes is cut off
Z90 = 1.2815515655446004


# Human turns [asm]: in a coding-agent session a person reads, tests and types between some
# calls. A fifth of the returns are human turns (p50 1 min, p95 10 min, cap 30 min); the
# rest are the paper's tool gaps. Agent traces do not separate the two, so these are not fitted.
HUMAN_TURN_SHARE = 0.2
HUMAN_GAP_P50_S = 60.0
HUMAN_GAP_P95_S = 600.0
HUMAN_GAP_CAP_S = 1800.0
# Mixed depths [asm]: (p50 depth, weight) -- quick lookups, ordinary tasks and long agent
# runs in one stream, in place of one typical depth.
MIXED_DEPTHS = ((5, 0.5), (30, 0.35), (100, 0.15))


def _gap(rng: random.Random, kind: str) -> tuple[float, str]:
    """(gap seconds, the call's kind) for a return."""
    if kind == "human":
        if rng.random() < HUMAN_TURN_SHARE:
            return min(HUMAN_GAP_CAP_S, _lognormal(rng, HUMAN_GAP_P50_S, HUMAN_GAP_P95_S)), "user"
        kind = "paper"
    return _tool_gap(rng, kind), "tool"


def _tool_gap(rng: random.Random, kind: str) -> float:
    if kind == "paper":  # the paper's lognormal, capped at 10 s like GapModel("paper")
        return min(10.0, _lognormal(rng, PAPER_GAP_P50_S, PAPER_GAP_P95_S))
    if kind == "heavy":
        sigma = math.log(5.0 / HEAVY_GAP_P50_S) / Z90
        return min(HEAVY_GAP_CAP_S, rng.lognormvariate(math.log(HEAVY_GAP_P50_S), sigma))
    raise ValueError(f"unknown gap kind {kind!r}; use paper|heavy|human")


def agent_sessions(
    sessions: int,
    models: list[str],
    depth: int,
    prompt: int,
    output: int,
    gaps: str = "paper",
    arrivals: str = "poisson",
    zipf_s: float = 0.0,
    seed: int = 0,
    burst: int = 8,
    shared: int = 0,
    mixed_depth: bool = False,
) -> list[Session]:
    """Agent sessions with the given typical shape, started at a rate of ONE session per
    second (scale the start times for another rate: `at_rate`). Each draw is lognormal
    around the typical value [asm: shapes follow Fig. 2 of the paper, not fitted]:

    depth    p50 `depth`, p95 2.3x, capped at 3x (>= 1)
    prompt   the first prompt p50 `prompt`/2; each call appends the previous output plus a
             tool result (p50 max(200, prompt/depth), p95 5x), so the context grows; past
             2x `prompt` (or the model context) it is compacted to `prompt`/2 and that call
             reuses nothing. Prompts thus sit around `prompt` at the median.
    output   p50 `output`, p95 3x, capped at 4x and 4,096
    gaps     baked into the trace (replay with recorded gaps, no cap): 'paper' = the
             paper's lognormal (p50 0.39 s, p95 1.32 s, cap 10 s); 'heavy' = p50 0.39 s with
             10 % of gaps above 5 s (cap 120 s); 'human' = paper tool gaps, and a fifth of
             the returns human turns of minutes (HUMAN_*)
    shared   every prompt that starts afresh (call 0, after compaction) opens with the
             model's `shared`-token system prompt + tool schema, on top of the sizes above
             (replay with RunConfig.shared_prefix = {model: shared} so hashes and caches see it)
    mixed_depth  draw each session's depth p50 from MIXED_DEPTHS instead of `depth`
    arrivals 'poisson' = exponential inter-arrivals; 'bursts' = groups of `burst` sessions
             within 0.5 s, the groups Poisson at 1/`burst` per second
    models   weight 1/(k+1)**zipf_s (0 = equal)
    """
    if arrivals not in ("poisson", "bursts"):
        raise ValueError(f"unknown arrivals {arrivals!r}; use poisson|bursts")
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf_s for k in range(len(models))]
    ceiling = min(2 * prompt + shared, CONTEXT_CAP)
    t = 0.0
    out: list[Session] = []
    for i in range(sessions):
        if arrivals == "poisson":
            t += rng.expovariate(1.0)
            start = t
        else:
            if i % burst == 0:
                t += rng.expovariate(1.0 / burst)
            start = t + rng.uniform(0.0, 0.5)
        model = rng.choices(models, weights)[0]
        typical = rng.choices([d for d, _ in MIXED_DEPTHS], [w for _, w in MIXED_DEPTHS])[0] if mixed_depth else depth
        tool_p50 = max(200, prompt // typical)
        n = max(1, min(3 * typical, round(_lognormal(rng, typical, 2.3 * typical))))
        sid = f"s{i:05d}"
        calls = []
        ctx = 0  # previous prompt + output (what the next call can reuse)
        for idx in range(n):
            out_tok = max(1, min(4 * output, 4096, round(_lognormal(rng, output, 3 * output))))
            if idx == 0:
                p, reuse = shared + max(256, round(_lognormal(rng, prompt / 2, 2 * prompt))), 0
                p = min(p, ceiling)
                gap, kind = start, "start"
            else:
                p, reuse = ctx + max(16, round(_lognormal(rng, tool_p50, 5 * tool_p50))), ctx
                if p + out_tok > ceiling:
                    p, reuse = shared + max(256, prompt // 2), 0  # compaction
                gap, kind = _gap(rng, gaps)
            calls.append(TraceCall(sid, idx, model, p, min(reuse, p - 1), out_tok, gap, kind, "generated"))
            ctx = p + out_tok
        out.append(Session(sid, tuple(calls)))
    return out


def at_rate(sessions: list[Session], rate_s: float) -> list[Session]:
    """The same sessions with their start times scaled from 1/s to `rate_s` sessions/s."""
    scaled = []
    for s in sessions:
        first = replace(s.calls[0], gap_before_s=s.calls[0].gap_before_s / rate_s)
        scaled.append(Session(s.id, (first, *s.calls[1:])))
    return scaled
