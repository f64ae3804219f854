"""Hivenet against the routers an operator would pick instead, in one run on one machine.

    python -m bench.peers [--duration 4] [--concurrency 1,16,64] [--peers vllm-router] [--setup]

The same simulated engine (zero token latency, 16-token answers) is reached directly,
through hivenet (router -> agent -> engine), through the LiteLLM proxy and through
vLLM's router (`vllm-router`, Rust), each pointed at that engine, with and without
streaming. Peers live in their own virtual environments under bench/.peers/ (git
ignored), made on first use or by `--setup`; never in the product's dependencies.
A peer that cannot be installed or started here gets a row that says why.
`trio-relays` is no router: two bare byte relays on trio in series (bench/relay.py),
the floor under hivenet's two Python processes, router and agent, in one's path.

"Router CPU" is the CPU seconds of the router's process tree per 1,000 requests;
hivenet's agent, a hop the others do not have, is shown beside its router.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import trio

from bench.loadgen import Result, chat_request, run_load
from bench.procs import Procs, free_port, wait_http, wait_models

MODEL = "bench-model"
PEERS_DIR = Path(__file__).parent / ".peers"
# Pinned so that two runs of this benchmark compare the same peers.
PEER_PACKAGES = {
    "litellm": ["litellm[proxy]==1.108.7"],
    "vllm-router": ["vllm-router==0.1.17"],
}
INSTALL_TIMEOUT = 600.0
# Peers made here, with nothing to install.
LOCAL_PEERS = ("trio-relays",)
LITELLM_KEY = "sk-bench-0123456789abcdef"


@dataclass
class Target:
    name: str
    port: int = 0
    procs: list[psutil.Process] = field(default_factory=list)
    agent: psutil.Process | None = None
    headers: dict[str, str] = field(default_factory=dict)
    missing: str = ""


@dataclass
class Cell:
    target: str
    stream: bool
    clients: int
    result: Result | None
    cpu_per_1k: float | None = None
    agent_cpu_per_1k: float | None = None
    note: str = ""


def venv_bin(name: str, command: str) -> Path:
    return PEERS_DIR / name / "bin" / command


def setup(name: str) -> str:
    """Make the peer's virtual environment if it is missing; '' or why it failed."""
    marker = PEERS_DIR / name / ".installed"
    if marker.exists() and marker.read_text() == " ".join(PEER_PACKAGES[name]):
        return ""
    venv = PEERS_DIR / name
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        out = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", *PEER_PACKAGES[name]],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        return f"install failed: {type(exc).__name__}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"pip install failed: {last[:120]}"
    marker.write_text(" ".join(PEER_PACKAGES[name]))
    return ""


def tree(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):  # a child that already exited
            total += sum(p.cpu_times()[:2])
    return total


def start_hivenet(procs: Procs, engine: int) -> Target:
    http, metrics, p2p = free_port(), free_port(), free_port()
    router, addr = procs.router(http, metrics, p2p, "--queue-depth", "1024")
    agent = procs.agent(addr, MODEL, f"http://127.0.0.1:{engine}")
    wait_models(f"http://127.0.0.1:{http}", MODEL, 1)
    return Target("hivenet", http, [psutil.Process(router.pid)], psutil.Process(agent.pid))


def start_litellm(procs: Procs, engine: int) -> Target:
    target = Target("LiteLLM proxy", headers={"Authorization": f"Bearer {LITELLM_KEY}"})
    if why := setup("litellm"):
        target.missing = why
        return target
    config = procs.dir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{engine}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    target.port = free_port()
    # Its model price list is read from the package, not fetched.
    procs.env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    procs.env["LITELLM_MASTER_KEY"] = LITELLM_KEY
    argv = [str(venv_bin("litellm", "litellm")), "--config", str(config)]
    proc = procs.spawn(
        "litellm",
        [*argv, "--host", "127.0.0.1", "--port", str(target.port), "--num_workers", "1"],
    )
    return started(procs, "litellm", target, proc, "/health/liveliness")


def start_vllm_router(procs: Procs, engine: int) -> Target:
    target = Target("vllm-router")
    if why := setup("vllm-router"):
        target.missing = why
        return target
    target.port = free_port()
    argv = [str(venv_bin("vllm-router", "vllm-router")), "--host", "127.0.0.1"]
    proc = procs.spawn(
        "vllm-router",
        [
            *argv,
            "--port",
            str(target.port),
            "--worker-urls",
            f"http://127.0.0.1:{engine}",
            "--policy",
            "round_robin",
            "--log-level",
            "warning",
        ],
    )
    return started(procs, "vllm-router", target, proc, "/health")


def start_trio_relays(procs: Procs, engine: int) -> Target:
    inner, outer = free_port(), free_port()
    relay = [sys.executable, "-m", "bench.relay"]
    first = procs.spawn("relay-inner", [*relay, str(inner), str(engine)])
    second = procs.spawn("relay-outer", [*relay, str(outer), str(inner)])
    target = started(procs, "relay-outer", Target("trio-relays", outer), second, "/health")
    if not target.missing:
        target.procs += tree(first)
    return target


def started(
    procs: Procs, name: str, target: Target, proc: subprocess.Popen[bytes], health: str
) -> Target:
    try:
        wait_http(f"http://127.0.0.1:{target.port}{health}", timeout=90)
    except RuntimeError:
        lines = (procs.dir / f"{name}.log").read_text(errors="replace").strip().splitlines()
        target.missing = f"did not start (exit code {proc.poll()}): {(lines or ['-'])[-1][:100]}"
        return target
    target.procs = tree(proc)
    return target


async def measure(target: Target, stream: bool, clients: int, duration: float) -> Result | None:
    request = chat_request("127.0.0.1", target.port, MODEL, stream, 16, target.headers)
    # A peer that wedges must not hang the run: a cell gets twice its time, then ends.
    with trio.move_on_after(2 * duration + 30):
        await run_load("127.0.0.1", target.port, request, clients, duration / 4, stream)
        return await run_load("127.0.0.1", target.port, request, clients, duration, stream)
    return None


def run_cells(
    targets: list[Target], streams: list[bool], levels: list[int], duration: float
) -> list[Cell]:
    cells = []
    for stream in streams:
        for clients in levels:
            for target in targets:
                if target.missing:
                    cells.append(Cell(target.name, stream, clients, None, note=target.missing))
                    continue
                cpu0 = cpu_seconds(target.procs)
                agent0 = cpu_seconds([target.agent]) if target.agent else 0.0
                result = trio.run(measure, target, stream, clients, duration)
                if result is None:
                    cells.append(Cell(target.name, stream, clients, None, note="stalled"))
                    continue
                served = max(result.count * 1.25, 1)  # the warm-up ran a quarter as long
                cell = Cell(target.name, stream, clients, result)
                cell.cpu_per_1k = (cpu_seconds(target.procs) - cpu0) / served * 1000
                if target.agent:
                    agent_cpu = cpu_seconds([target.agent]) - agent0
                    cell.agent_cpu_per_1k = agent_cpu / served * 1000
                cells.append(cell)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--setup", action="store_true", help="only install the peers")
    known = [*PEER_PACKAGES, *LOCAL_PEERS]
    parser.add_argument("--peers", default=",".join(known), help="which peers, comma-separated")
    args = parser.parse_args()
    chosen = [name for name in args.peers.split(",") if name]
    if unknown := set(chosen) - set(known):
        parser.error(f"unknown peers {sorted(unknown)}; known: {sorted(known)}")
    if args.setup:
        for name in chosen:
            if name in PEER_PACKAGES:
                print(f"{name}: {setup(name) or 'ready'}", flush=True)
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    procs = Procs()
    began = time.monotonic()
    targets: list[Target] = []
    try:
        engine = free_port()
        procs.sim(MODEL, engine)
        targets.append(Target("direct", engine, []))
        targets.append(start_hivenet(procs, engine))
        starters = {
            "litellm": start_litellm,
            "vllm-router": start_vllm_router,
            "trio-relays": start_trio_relays,
        }
        for name in chosen:
            targets.append(starters[name](procs, engine))
        cells = run_cells(targets, [False, True], levels, args.duration)
    finally:
        procs.close()
        leftovers = [p for t in targets for p in t.procs if p.is_running()]
        for p in leftovers:  # children a peer started for itself
            with contextlib.suppress(psutil.Error):
                p.kill()
    report(cells, args, time.monotonic() - began)


def report(cells: list[Cell], args: argparse.Namespace, took: float) -> None:
    print(
        f"machine: {platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, load average {psutil.getloadavg()[0]:.2f}; "
        f"{args.duration:g}s per cell, 16 tokens per answer, engine latency 0; "
        f"run took {took:.0f}s"
    )
    print()
    print(
        "| mode | clients | via | req/s | vs direct | p50/p99 ms | added p50/p99 ms "
        "| router CPU s/1k req |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    direct: dict[tuple[bool, int], dict] = {}
    for cell in cells:
        mode = "streaming" if cell.stream else "non-streaming"
        if cell.result is None:
            print(f"| {mode} | {cell.clients} | {cell.target} | - | - | - | - | {cell.note} |")
            continue
        s = cell.result.summary()
        key = (cell.stream, cell.clients)
        if cell.target == "direct":
            direct[key] = s
            print(
                f"| {mode} | {cell.clients} | direct | {s['rps']:.0f} | 1.00 "
                f"| {s['p50_ms']:.2f}/{s['p99_ms']:.2f} | - | - |"
            )
            continue
        d = direct[key]
        cpu = f"{cell.cpu_per_1k:.3f}"
        if cell.agent_cpu_per_1k is not None:
            cpu += f" (+ agent {cell.agent_cpu_per_1k:.3f})"
        errors = f", {s['errors']} errors" if s["errors"] else ""
        print(
            f"| {mode} | {cell.clients} | {cell.target} | {s['rps']:.0f}{errors} "
            f"| {s['rps'] / d['rps']:.2f} | {s['p50_ms']:.2f}/{s['p99_ms']:.2f} "
            f"| {s['p50_ms'] - d['p50_ms']:.2f}/{s['p99_ms'] - d['p99_ms']:.2f} | {cpu} |"
        )


if __name__ == "__main__":
    main()
