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
`trio-floor` is no router either: a router and an agent of hivenet's shape that only
carry requests (bench/floor.py), the least such a pair on trio spends per request.

"Router CPU" is the CPU seconds of the router's process tree per 1,000 requests;
hivenet's agent, a hop the others do not have, is shown beside its router.

`--rounds N` runs the whole sweep N times, each cell's routers in an order turned by one
each round (direct always first, the base of "added"), and prints each cell's median over
the rounds; with vllm-router in the run, it then checks issue 51's targets round by round
(the ratios that one run's host noise moves across a bound) and says in how many rounds
each was met.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
LOCAL_PEERS = ("trio-relays", "trio-floor")
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


def start_trio_floor(procs: Procs, engine: int) -> Target:
    link, outer = free_port(), free_port()
    floor = [sys.executable, "-m", "bench.floor"]
    agent = procs.spawn("floor-agent", [*floor, "agent", str(link), str(engine)])
    router = procs.spawn("floor-router", [*floor, "router", str(outer), str(link)])
    target = started(procs, "floor-router", Target("trio-floor", outer), router, "/health")
    target.agent = psutil.Process(agent.pid)
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
    targets: list[Target], streams: list[bool], levels: list[int], duration: float, turn: int
) -> list[Cell]:
    """One sweep; `turn` rotates the order of the routers after `direct`."""
    first, rest = targets[:1], targets[1:]
    if rest:
        turn %= len(rest)
        rest = rest[turn:] + rest[:turn]
    cells = []
    for stream in streams:
        for clients in levels:
            for target in first + rest:
                cells.append(run_cell(target, stream, clients, duration))
    return cells


def run_cell(target: Target, stream: bool, clients: int, duration: float) -> Cell:
    if target.missing:
        return Cell(target.name, stream, clients, None, note=target.missing)
    cpu0 = cpu_seconds(target.procs)
    agent0 = cpu_seconds([target.agent]) if target.agent else 0.0
    result = trio.run(measure, target, stream, clients, duration)
    if result is None:
        return Cell(target.name, stream, clients, None, note="stalled")
    served = max(result.count * 1.25, 1)  # the warm-up ran a quarter as long
    cell = Cell(target.name, stream, clients, result)
    cell.cpu_per_1k = (cpu_seconds(target.procs) - cpu0) / served * 1000
    if target.agent:
        cell.agent_cpu_per_1k = (cpu_seconds([target.agent]) - agent0) / served * 1000
    return cell


@dataclass
class Row:
    """One cell's figures, the median over the rounds where it has several."""

    target: str
    stream: bool
    clients: int
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_per_1k: float | None
    agent_cpu_per_1k: float | None
    errors: int
    note: str = ""


def rows_of(rounds: list[list[Cell]]) -> list[Row]:
    """The cells of all rounds, one row per (target, mode, clients) in the first round's
    order; a cell that failed in any round gives its note instead of figures."""
    by_key: dict[tuple[str, bool, int], list[Cell]] = {}
    for cells in rounds:
        for cell in cells:
            by_key.setdefault((cell.target, cell.stream, cell.clients), []).append(cell)
    order = sorted(by_key, key=lambda k: (k[1], k[2], k[0] != "direct"))
    rows = []
    for key in order:
        cells = by_key[key]
        failed = next((c for c in cells if c.result is None), None)
        if failed is not None:
            rows.append(Row(*key, 0, 0, 0, None, None, 0, note=failed.note))
            continue
        summaries = [c.result.summary() for c in cells if c.result is not None]
        rows.append(
            Row(
                *key,
                rps=statistics.median([s["rps"] for s in summaries]),
                p50_ms=statistics.median([s["p50_ms"] for s in summaries]),
                p99_ms=statistics.median([s["p99_ms"] for s in summaries]),
                cpu_per_1k=_median_or_none([c.cpu_per_1k for c in cells]),
                agent_cpu_per_1k=_median_or_none([c.agent_cpu_per_1k for c in cells]),
                errors=sum(s["errors"] for s in summaries),
            )
        )
    return rows


def _median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass
class Check:
    """One target: its value in each round and the bound it must keep."""

    name: str
    values: list[float]
    bound: float
    at_most: bool

    def met(self, value: float) -> bool:
        return value <= self.bound if self.at_most else value >= self.bound

    def line(self) -> str:
        shown = ", ".join(f"{v:.2f}" for v in self.values)
        kept = sum(self.met(v) for v in self.values)
        sign = "≤" if self.at_most else "≥"
        verdict = "met" if self.met(statistics.median(self.values)) else "NOT met"
        return (
            f"- {self.name}: median {statistics.median(self.values):.2f} ({shown}); target {sign} "
            f"{self.bound:g}: {verdict}, in {kept} of {len(self.values)} rounds"
        )


def issue_checks(rounds: list[list[Cell]], busy: int = 64) -> list[Check]:
    """The targets against vllm-router, each a ratio taken within one round: issue 51's
    (router CPU per request at most vllm-router's; the agent's at most 0.5x the
    router's on whole answers, 0.7x on streams) and issue 26's that stand beside them
    (routed/direct requests per second, the lone client's added latency); a target is
    left out of a round that lacks a cell it needs."""
    checks: dict[str, Check] = {}

    def add(name: str, value: float, bound: float, at_most: bool = True) -> None:
        checks.setdefault(name, Check(name, [], bound, at_most)).values.append(value)

    for cells in rounds:
        got = {(c.target, c.stream, c.clients): c for c in cells if c.result is not None}
        for stream in (False, True):
            mode = "streaming" if stream else "non-streaming"
            hive, peer = got.get(("hivenet", stream, busy)), got.get(("vllm-router", stream, busy))
            direct = got.get(("direct", stream, busy))
            if hive and hive.cpu_per_1k:
                if peer and peer.cpu_per_1k:
                    add(
                        f"router CPU / vllm-router's, {mode}, {busy} clients",
                        hive.cpu_per_1k / peer.cpu_per_1k,
                        1.0,
                    )
                if hive.agent_cpu_per_1k is not None:
                    add(
                        f"agent CPU / router's, {mode}, {busy} clients",
                        hive.agent_cpu_per_1k / hive.cpu_per_1k,
                        0.7 if stream else 0.5,
                    )
            floor = got.get(("trio-floor", stream, busy))
            if floor and floor.cpu_per_1k and floor.agent_cpu_per_1k and peer and peer.cpu_per_1k:
                # Items 3 and 4 together: an agent within 0.5x (0.7x) of a router that
                # spends at most vllm-router's. The floor's agent, which only carries
                # requests, shows whether an agent of this shape on trio can.
                add(
                    f"trio-floor agent CPU / vllm-router's, {mode}, {busy} clients "
                    "(the least an agent on trio spends; items 3 and 4 together need this)",
                    floor.agent_cpu_per_1k / peer.cpu_per_1k,
                    0.7 if stream else 0.5,
                )
                add(
                    f"trio-floor router CPU / vllm-router's, {mode}, {busy} clients (the floor)",
                    floor.cpu_per_1k / peer.cpu_per_1k,
                    1.0,
                )
            if hive and direct:
                add(
                    f"routed/direct req/s, {mode}, {busy} clients",
                    _rps(hive) / _rps(direct),
                    0.6 if stream else 0.8,
                    at_most=False,
                )
            base, peer_lone = got.get(("direct", stream, 1)), got.get(("vllm-router", stream, 1))
            if base and peer_lone and _p50(peer_lone) > _p50(base):
                added = _p50(peer_lone) - _p50(base)
                # trio-relays is the floor under any two Python hops: shown, not a target.
                for name, label in (("hivenet", ""), ("trio-relays", " (trio-relays, the floor)")):
                    if ours := got.get((name, stream, 1)):
                        add(
                            f"lone client's added p50 / vllm-router's, {mode}{label}",
                            (_p50(ours) - _p50(base)) / added,
                            2.0,
                        )
    return list(checks.values())


def _rps(cell: Cell) -> float:
    assert cell.result is not None
    return cell.result.rps


def _p50(cell: Cell) -> float:
    assert cell.result is not None
    return cell.result.pct(cell.result.latencies, 0.5) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--setup", action="store_true", help="only install the peers")
    parser.add_argument("--rounds", type=int, default=1, help="sweeps; each cell's median")
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
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    procs = Procs()
    began, times = time.monotonic(), psutil.cpu_times()
    targets: list[Target] = []
    rounds: list[list[Cell]] = []
    try:
        engine = free_port()
        procs.sim(MODEL, engine)
        targets.append(Target("direct", engine, []))
        targets.append(start_hivenet(procs, engine))
        starters = {
            "litellm": start_litellm,
            "vllm-router": start_vllm_router,
            "trio-relays": start_trio_relays,
            "trio-floor": start_trio_floor,
        }
        for name in chosen:
            targets.append(starters[name](procs, engine))
        for turn in range(args.rounds):
            rounds.append(run_cells(targets, [False, True], levels, args.duration, turn))
    finally:
        procs.close()
        leftovers = [p for t in targets for p in t.procs if p.is_running()]
        for p in leftovers:  # children a peer started for itself
            with contextlib.suppress(psutil.Error):
                p.kill()
    report(rounds, args, time.monotonic() - began, stolen_share(times))


def stolen_share(before: Any) -> float | None:
    """The share of this machine's CPU time since `before` that its hypervisor gave to
    others (steal); None where the kernel does not count it."""
    after = psutil.cpu_times()
    if not hasattr(after, "steal"):
        return None
    total = sum(after) - sum(before)
    return (after.steal - before.steal) / total if total > 0 else None


def report(
    rounds: list[list[Cell]], args: argparse.Namespace, took: float, stolen: float | None
) -> None:
    print(
        f"machine: {platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, load average {psutil.getloadavg()[0]:.2f}"
        + (f", {stolen:.0%} of CPU time stolen by the hypervisor" if stolen is not None else "")
        + f"; {args.duration:g}s per cell, 16 tokens per answer, engine latency 0; "
        f"run took {took:.0f}s"
        + (f"; each figure the median of {len(rounds)} rounds" if len(rounds) > 1 else "")
    )
    print()
    print(
        "| mode | clients | via | req/s | vs direct | p50/p99 ms | added p50/p99 ms "
        "| router CPU s/1k req |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    direct: dict[tuple[bool, int], Row] = {}
    for row in rows_of(rounds):
        mode = "streaming" if row.stream else "non-streaming"
        if row.note:
            print(f"| {mode} | {row.clients} | {row.target} | - | - | - | - | {row.note} |")
            continue
        key = (row.stream, row.clients)
        if row.target == "direct":
            direct[key] = row
            print(
                f"| {mode} | {row.clients} | direct | {row.rps:.0f} | 1.00 "
                f"| {row.p50_ms:.2f}/{row.p99_ms:.2f} | - | - |"
            )
            continue
        d = direct[key]
        cpu = f"{row.cpu_per_1k:.3f}"
        if row.agent_cpu_per_1k is not None:
            cpu += f" (+ agent {row.agent_cpu_per_1k:.3f})"
        errors = f", {row.errors} errors" if row.errors else ""
        print(
            f"| {mode} | {row.clients} | {row.target} | {row.rps:.0f}{errors} "
            f"| {row.rps / d.rps:.2f} | {row.p50_ms:.2f}/{row.p99_ms:.2f} "
            f"| {row.p50_ms - d.p50_ms:.2f}/{row.p99_ms - d.p99_ms:.2f} | {cpu} |"
        )
    if checks := issue_checks(rounds):
        print()
        print("Issue 51's targets (and issue 26's beside them), each a ratio within one round:")
        for check in checks:
            print(check.line())


if __name__ == "__main__":
    main()
