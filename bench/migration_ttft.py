"""TTFT of a moved return on the torch engine or vLLM (CPU): migrate (pull the pages) vs recompute.

    python bench/migration_ttft.py [--engine torch|vllm] [--tokens 4096,16384,65536] [--netns]
                                   [--transports tcp,mooncake] [--out results/migration.md]

A holder process runs the session's first call (N tokens of context, checkpointed to its
host KV registry) and serves its pages (memory/page_server.py, on its engine thread). In
this process a second torch engine takes the session's return (the context plus a short
tool result): recompute = its prefill from nothing; migrate = page_client.pull (page bytes
inline over TCP, or by Mooncake's transfer engine), import into the host registry, then the
prefill restoring them. TTFT = call start to first token, the pull included. Loopback: the
holder on 127.0.0.1. --netns also runs
it across two network hosts of this machine (tests/multihost/hosts.py: network namespaces
on a bridge, the holder's link shaped to 1 Gbit/s by `tc`; this kernel lacks sch_netem, so
the 0.5 ms latency cannot be added and is not). Replaces the "TTFT" section of --out
and writes its plot beside it (.png).

--engine vllm (run it with .ci-vllm-venv's python): the same on vLLM's CPU build
(engine/vllm_engine.py, its host KV connector as the PageStore). vLLM engines take ~30-60 s
to start here, so one holder process serves every size (a session and tenant scope per size)
and one mover engine per link and transport takes every size's return (the scopes keep one
size's pages from serving another); the recompute baseline is a return under a scope nothing
holds, on the first mover. Writes the "TTFT (vLLM)" section, leaving the torch section as it
is. The plot (.png beside --out) has a row of panels per engine, redrawn from both sections.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from talaria.services.instance_agent.engine import Sequence, TorchEngine  # noqa: E402
from talaria.shared.tokenizer import block_hashes, encode  # noqa: E402

MODEL = "qwen3-tiny"
SECTION = "## TTFT"
SECTIONS = {"torch": SECTION, "vllm": "## TTFT (vLLM)"}
TAIL = encode(" Tool output: 3 passed, 1 failed. Next step:", bos=False)


def context(n: int) -> list[int]:
    text = encode("def parse(s): return s.split(',')  # the agent reads, edits and tests the parser\n", bos=False)
    return (text * (n // len(text) + 1))[:n]


def engine(data: Path, n: int, warm: bool = True) -> TorchEngine:
    pages = (n + 4096) // 16 + 64
    eng = TorchEngine(data, [MODEL], kv_pages=pages, host_kv_pages=2 * pages, staging=False)  # a slot per TP rank (2)
    if warm:  # first-call costs (allocations, kernels) out of the timed calls
        eng.generate(Sequence("warm", "warm", MODEL, context(64), 1))
    return eng


def pull_pages(address: str, session: str, hashes: list[int], transport, **bounds):
    """page_client.pull from this (blocking) thread, on an event loop of its own. Not through
    asyncio.run: on Python < 3.13 its exit (restoring SIGINT's handler: signal.getsignal) formats
    the finished task's repr, result included, and nothing of that teardown belongs in the timed
    pull (what it once cost: results/migration.md, "Reading (vLLM)")."""
    from talaria.services.instance_agent.memory.page_client import pull

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(pull(address, session, MODEL, hashes, transport=transport, **bounds))
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


def holder_main(n: int, host: str, port: int, data: Path, segment_host: str) -> None:
    """The holder: the first call, then serve its pages until stdin closes (by Mooncake to a
    puller that has it too, when `segment_host` is set and the engine starts)."""
    from talaria.services.instance_agent.memory.mooncake_transport import open_transport
    from talaria.services.instance_agent.memory.page_server import PageServer

    torch.set_num_threads(1)
    eng = engine(data, n, warm=False)
    eng.generate(Sequence("c1", "s1", MODEL, context(n), 1))
    transport = open_transport(segment_host)[0] if segment_host else None

    async def serve():
        server = PageServer(lambda m, s, h, k: asyncio.to_thread(eng.export_pages, m, s, h, k), host, port,
                            transport=transport)
        await server.start()
        print(f"ready {server.port}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.close()

    asyncio.run(serve())


def first_token_s(eng: TorchEngine, seq: Sequence) -> float:
    t0 = time.perf_counter()
    step = eng.prefill([seq])[0]
    while not step.token_id and not step.finished:  # chunked: until the first token
        step = eng.prefill([], more=[seq])[0]
    dt = time.perf_counter() - t0
    eng.finish(seq)
    return dt


def recompute_s(n: int, data: Path) -> float:
    return first_token_s(engine(data, n), Sequence("r", "r", MODEL, context(n) + TAIL, 1))


def vllm_engine(data: Path, sizes: list[int]):
    """A vLLM CPU engine whose context fits the largest return and whose host pool holds every
    size's session at once (the pages one size moved must not be evicted by the next)."""
    from talaria.services.instance_agent.engine.vllm_engine import VllmEngine
    from talaria.shared.catalog import BUILTIN_MODELS

    spec = BUILTIN_MODELS.get(MODEL)
    per_token = spec.layers * 2 * spec.kv_heads * spec.head_dim * 4  # float32 at most
    eng = VllmEngine(data, [MODEL], hkvr=True, max_model_len=max(sizes) + 1024,
                     host_kv_bytes=max(256 << 20, 2 * sum(sizes) * per_token))
    vllm_first_token_s(eng, Sequence("warm", "warm", MODEL, context(64), 1, kv_scope="warm"))
    return eng


def vllm_first_token_s(eng, seq: Sequence) -> float:
    t0 = time.perf_counter()
    eng.prefill([seq])  # vLLM chunks the prompt itself: back with the first token
    dt = time.perf_counter() - t0
    eng.finish(seq)
    return dt


def vllm_holder_main(sizes: list[int], host: str, port: int, data: Path, segment_host: str) -> None:
    """The vLLM holder: every size's first call (session s<N>, scope ctx-<N>), then serve."""
    from talaria.services.instance_agent.memory.mooncake_transport import open_transport
    from talaria.services.instance_agent.memory.page_server import PageServer

    eng = vllm_engine(data, sizes)
    for n in sizes:
        seq = Sequence(f"c{n}", f"s{n}", MODEL, context(n), 1, kv_scope=f"ctx-{n}")
        eng.prefill([seq])
        eng.finish(seq)
    transport = open_transport(segment_host)[0] if segment_host else None
    owner = ThreadPoolExecutor(1, thread_name_prefix="holder-engine")  # the engine's one thread, as the agent's

    async def serve():
        loop = asyncio.get_running_loop()
        server = PageServer(lambda m, s, h, k: loop.run_in_executor(owner, eng.export_pages, m, s, h, k), host, port,
                            transport=transport)
        await server.start()
        print(f"ready {server.port}", flush=True)
        await loop.run_in_executor(None, sys.stdin.read)
        await server.close()

    # vLLM's engine core was started from this (the main) thread: the holder's engine thread is
    # the owner from here on
    asyncio.run(serve())
    owner.submit(eng.close).result()


def vllm_measure(n: int, address: str, mover, transport, recompute: float | None) -> dict:
    """One moved return of size `n` on vLLM: pull session s<N>'s pages (scope ctx-<N>), import
    them into `mover`, then its first token; `recompute`: the baseline, or None to measure it
    (a return under a scope no engine holds)."""
    prompt = context(n) + TAIL
    if recompute is None:
        recompute = vllm_first_token_s(mover, Sequence(f"r{n}", f"r{n}", MODEL, prompt, 1, kv_scope=f"recompute-{n}"))
    hashes = mover.page_hashes(MODEL, prompt[:-1], f"ctx-{n}")
    first = pull_pages(address, f"s{n}", hashes[:1], transport, timeout_s=60, max_bytes=1 << 30)
    t0 = time.perf_counter()
    got = pull_pages(address, f"s{n}", hashes, transport, timeout_s=600, max_bytes=1 << 34)
    lay = got.layout
    t_import = time.perf_counter()
    tokens = mover.import_pages(MODEL, f"s{n}", got.hashes, got.slabs, lay.dtype, tuple(lay.shape), lay.ranks)
    pulled = time.perf_counter() - t0
    t_import = time.perf_counter() - t_import
    seq = Sequence(f"m{n}", f"s{n}", MODEL, prompt, 1, kv_scope=f"ctx-{n}", migrated_tokens=tokens)
    migrate = pulled + vllm_first_token_s(mover, seq)
    assert seq.kv_source == "migrated" and seq.host_restored_tokens == tokens > 0, (seq.kv_source, got.why, tokens)
    assert got.transport == ("mooncake" if transport else "tcp"), got.transport
    return {"n": n, "migrate": migrate, "pull": got.seconds, "bytes": got.bytes, "tokens": tokens,
            "transport": got.transport, "first_contact": first.seconds, "recompute": recompute, "import": t_import}


def measure(n: int, address: str, data: Path, transport) -> dict:
    """One moved return migrated from the holder at `address` (`transport`: a Mooncake one, or
    None for the bytes inline over TCP)."""
    prompt = context(n) + TAIL
    mover = engine(data, n)
    hashes = block_hashes(prompt[:-1], mover.page_size)
    # one page first, untimed: the holder's first export and Mooncake's handshake with a new peer
    # (both paid once per pair of agents, not per call) stay out of the measured pull
    first = pull_pages(address, "s1", hashes[:1], transport, timeout_s=60, max_bytes=1 << 30)
    t0 = time.perf_counter()
    got = pull_pages(address, "s1", hashes, transport, timeout_s=600, max_bytes=1 << 34)
    lay = got.layout
    tokens = mover.import_pages(MODEL, "s1", got.hashes, got.slabs, lay.dtype, tuple(lay.shape), lay.ranks)
    pulled = time.perf_counter() - t0
    seq = Sequence("m", "s1", MODEL, prompt, 1, migrated_tokens=tokens)
    migrate = pulled + first_token_s(mover, seq)
    assert seq.kv_source == "migrated", (seq.kv_source, got.why, tokens)
    assert got.transport == ("mooncake" if transport else "tcp"), got.transport
    mover.close()
    return {"n": n, "migrate": migrate, "pull": got.seconds, "bytes": got.bytes, "tokens": tokens,
            "transport": got.transport, "first_contact": first.seconds}


def run_holder(n: int | str, data: Path, argv_prefix: list[str], host: str, segment_host: str, engine: str = "torch"
               ) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([*argv_prefix, sys.executable, __file__, "--holder", str(n), "--host", host,
                             "--data", str(data), "--segment-host", segment_host, "--engine", engine],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for raw in proc.stdout:  # its engine logs first
        line = raw.split()
        if line[:1] == ["ready"]:
            return proc, int(line[1])
    proc.kill()
    raise RuntimeError(f"the holder did not start (N={n})")


def plot(text: str, path: Path) -> None:
    """TTFT by context size, migrate vs recompute (log scale): a row of panels per engine
    section of `text` (--out's markdown), one panel per link."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [(name, rows) for name, section in SECTIONS.items() if (rows := parse_table(text, section))]
    if not engines:
        return
    cols = max(len({r["link"] for r in rows}) for _, rows in engines)
    fig, axes = plt.subplots(len(engines), cols, figsize=(5 * cols, 3.6 * len(engines)), squeeze=False)
    for row_axes, (engine, rows) in zip(axes, engines):
        _plot_engine(row_axes, engine, rows)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_engine(axes, engine: str, rows: list[dict]) -> None:
    links = list(dict.fromkeys(r["link"] for r in rows))
    transports = list(dict.fromkeys(r["transport"] for r in rows))
    width = 0.8 / (1 + len(transports))
    for ax in axes[len(links):]:
        ax.axis("off")
    for ax, link in zip(axes, links):
        sizes = sorted({r["n"] for r in rows if r["link"] == link})
        xs = range(len(sizes))
        first = {r["n"]: r for r in rows if r["link"] == link}
        ax.bar([x - 0.4 + width / 2 for x in xs], [first[n]["recompute"] for n in sizes], width, label="recompute")
        for i, t in enumerate(transports, 1):
            mine = {r["n"]: r for r in rows if r["link"] == link and r["transport"] == t}
            at = [x - 0.4 + width * (i + 0.5) for x in xs]
            ax.bar(at, [mine[n]["migrate"] if n in mine else 0 for n in sizes], width,
                   label=f"migrate, {t} (pull included)")
            for x, n in zip(at, sizes):
                if n in mine:
                    ax.annotate(f"{mine[n]['migrate'] / mine[n]['recompute']:.2f}x", (x, mine[n]["migrate"]),
                                ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [f"{n // 1024}K" for n in sizes])
        ax.set_yscale("log")
        ax.set_title(f"{engine}: {link.split(' (')[0]}")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("TTFT of the moved return (s)")
        ax.legend(fontsize=8)


def parse_table(text: str, section: str = SECTION) -> list[dict]:
    """The rows of --out's TTFT table (to redraw the plot without rerunning)."""
    rows = []
    body = text.partition(section + "\n")[2]
    for line in (body[: body.find("\n## ")] if "\n## " in body else body).splitlines():
        c = [x.strip().strip("*") for x in line.strip().strip("|").split("|")]
        if len(c) == 8 and c[2].replace(",", "").isdigit():
            rows.append({"link": c[0], "transport": c[1], "n": int(c[2].replace(",", "")), "recompute": float(c[3]),
                         "migrate": float(c[4])})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                    help="vllm: vLLM's CPU build (run with .ci-vllm-venv's python)")
    ap.add_argument("--tokens", default="4096,16384,65536")
    ap.add_argument("--netns", action="store_true", help="also across two network namespaces (root)")
    ap.add_argument("--transports", default="tcp,mooncake",
                    help="how the page bytes move: tcp (inline), mooncake (its transfer engine, `tcp` protocol)")
    ap.add_argument("--out", type=Path, default=Path("results/migration.md"))
    ap.add_argument("--replot", action="store_true", help="redraw the PNG from --out's table, run nothing")
    ap.add_argument("--holder", default="", help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--segment-host", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    section = SECTIONS[args.engine]
    png = args.out.with_suffix(".png")
    if args.holder:
        if args.engine == "vllm":
            vllm_holder_main([int(x) for x in args.holder.split(",")], args.host, 0, args.data, args.segment_host)
        else:
            holder_main(int(args.holder), args.host, 0, args.data, args.segment_host)
        return 0
    if args.replot:
        plot(args.out.read_text(), png)
        return 0
    torch.set_num_threads(1)
    try:
        sizes = [int(x) for x in args.tokens.split(",") if x]
    except ValueError:
        ap.error("--tokens: comma-separated token counts")
    transports = [t for t in args.transports.split(",") if t]
    if not transports or set(transports) - {"tcp", "mooncake"}:
        ap.error("--transports: tcp and/or mooncake")
    if "mooncake" in transports:
        from talaria.services.instance_agent.memory.mooncake_transport import open_transport
        probe, why = open_transport("127.0.0.1")
        if probe is None:
            ap.error(f"--transports mooncake: {why}")
        probe.close()
    data = Path(tempfile.mkdtemp(prefix="migration-ttft-"))
    links = [("loopback", [], "127.0.0.1", "127.0.0.1")]
    net = None
    if args.netns:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.multihost.hosts import Network, available
        why = available()
        if why:
            ap.error(f"--netns: {why}")
        net = Network(("holder",)).create()
        shaped = net.shape("holder", 0.5, "1gbit")
        h = net.hosts["holder"]
        # this process (the puller) is .254 on the hosts' bridge
        links.append((f"two hosts ({shaped})", ["ip", "netns", "exec", h.name], h.ip, h.ip.rsplit(".", 1)[0] + ".254"))
    rows = []
    try:
        for label, prefix, host, local in links:
            movers = {t: open_transport(local)[0] if t == "mooncake" else None for t in transports}
            if args.engine == "vllm":
                rows += vllm_link(label, prefix, host, sizes, data, transports, movers)
                continue
            for n in sizes:
                proc, port = run_holder(n, data, prefix, "0.0.0.0" if prefix else host,
                                        host if "mooncake" in transports else "")
                try:
                    recompute = recompute_s(n, data)  # one baseline per size and link, beside its migrations
                    for t in transports:
                        r = {**measure(n, f"{host}:{port}", data, movers[t]), "recompute": recompute, "link": label}
                        rows.append(r)
                        print(f"{label} {t} N={n}: recompute {recompute:.3f} s, migrate {r['migrate']:.3f} s "
                              f"({r['migrate'] / recompute:.2f}x; pull {r['pull']:.3f} s, {r['bytes'] / 1e6:.1f} MB; "
                              f"first one-page pull {r['first_contact'] * 1e3:.1f} ms)",
                              flush=True)
                finally:
                    proc.stdin.close()
                    proc.wait(60)
    finally:
        if net is not None:
            net.destroy()
    table = ["| link | page bytes by | context tokens | recompute TTFT (s) | migrate TTFT (s) | migrate / recompute "
             "| pull (s) | MB moved |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    table += [f"| {r['link']} | {r['transport']} | {r['n']:,} | {r['recompute']:.3f} | {r['migrate']:.3f} | "
              f"**{r['migrate'] / r['recompute']:.2f}x** | {r['pull']:.3f} | {r['bytes'] / 1e6:.1f} |" for r in rows]
    cmd = (f"python bench/migration_ttft.py{' --engine vllm' if args.engine == 'vllm' else ''} --tokens {args.tokens}"
           f"{' --netns' if args.netns else ''} --transports {args.transports}")
    what = "torch engine" if args.engine == "torch" else f"vLLM {_vllm_version()} CPU build, its host KV connector"
    body = [section, "", f"`{cmd}` ({what}, {MODEL} on CPU, {os.cpu_count()} cores shared with other jobs; one run "
            "each). The return is the context plus a short tool result; TTFT includes the pull. The recompute "
            "baseline is measured in the same run, once per size and link; each transport's pull is from the same "
            "holder, after an untimed one-page pull (the holder's first export, Mooncake's handshake with a new "
            "peer). `tcp`: the page bytes inline in the page protocol's TCP stream; `mooncake`: read by Mooncake's "
            "transfer engine (`tcp` protocol) from the holder's staging slots.", "", *table, ""]
    print("\n".join(body))
    text = args.out.read_text() if args.out.exists() else "# KV migration (issue 40)\n\n"
    head, found, rest = text.partition(section + "\n")
    tail = rest[rest.find("\n## "):] if found and "\n## " in rest else ""
    args.out.write_text(head.rstrip() + "\n\n" + "\n".join(body) + tail)
    plot(args.out.read_text(), png)
    return 0


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def vllm_link(label: str, prefix: list[str], host: str, sizes: list[int], data: Path, transports: list[str],
              movers: dict) -> list[dict]:
    """Every size over one link on vLLM: one holder process for all sizes, a mover engine per
    transport (a fresh one, so no transport finds the pages another imported), the recompute
    baseline on the first."""
    rows: list[dict] = []
    proc, port = run_holder(",".join(map(str, sizes)), data, prefix, "0.0.0.0" if prefix else host,
                            host if "mooncake" in transports else "", engine="vllm")
    try:
        base: dict[int, float] = {}
        for t in transports:
            mover = vllm_engine(data, sizes)
            try:
                for n in sizes:
                    r = {**vllm_measure(n, f"{host}:{port}", mover, movers[t], base.get(n)), "link": label}
                    base[n] = r["recompute"]
                    rows.append(r)
                    print(f"{label} {t} N={n}: recompute {r['recompute']:.3f} s, migrate {r['migrate']:.3f} s "
                          f"({r['migrate'] / r['recompute']:.2f}x; pull {r['pull']:.3f} s, {r['bytes'] / 1e6:.1f} MB; "
                          f"import {r['import']:.3f} s; first one-page pull {r['first_contact'] * 1e3:.1f} ms)",
                          flush=True)
            finally:
                mover.close()
    finally:
        proc.stdin.close()
        proc.wait(120)
    return rows


if __name__ == "__main__":
    sys.exit(main())
