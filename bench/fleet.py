"""Router cost of a connected fleet: CPU share and resident memory with 10, 100 and
1,000 agent sessions heartbeating at the default period.

    python -m bench.fleet [--sizes 10,100,1000] [--measure 20] [--settle 5]
                          [--against /path/to/other/checkout --rounds 3]

With `--against DIR` each size is measured `--rounds` times from this checkout and from
that one (its router and its agents, each run from its own tree, its `.venv` when it
has one), in alternating order, so both see the same host load; a row per run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

import httpx
import psutil

from bench.procs import ADMIN_KEY, Procs, free_port, python_of

PER_PROCESS = 250
HERE = Path(__file__).resolve().parent.parent


def joined(url: str) -> int:
    """Agents with a live session (healthy or not: a starved bench process may be late)."""
    r = httpx.get(
        url + "/admin/routing-table", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
    )
    return sum(1 for a in r.json()["agents"] if a["status"]["connected"])


def healthy(url: str) -> int:
    r = httpx.get(
        url + "/admin/routing-table", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
    )
    return sum(1 for a in r.json()["agents"] if a["status"]["healthy"])


def start_router(procs: Procs, root: Path = HERE) -> tuple[subprocess.Popen[bytes], str, str]:
    """A router from checkout `root`; returns it, its URL and its p2p address."""
    http, metrics, p2p = free_port(), free_port(), free_port()
    # Every bench agent dials from 127.0.0.1: one source, far over the per-address
    # defaults (32 live connections, 64 before their hello) a real fleet's NAT sizes.
    # Older checkouts have no such limits, nor the flags.
    helps = subprocess.run(
        [python_of(root), "-m", "router.cli", "serve", "--help"],
        cwd=root,
        env=procs.env,
        capture_output=True,
        text=True,
    )
    limits = ("--p2p-max-conns-per-ip", "4096", "--max-unjoined-per-ip", "4096")
    extra = limits if limits[0] in helps.stdout else ()
    router, addr = procs.router(http, metrics, p2p, *extra, root=root)
    return router, f"http://127.0.0.1:{http}", addr


def join_agents(procs: Procs, url: str, addr: str, size: int, root: Path = HERE) -> None:
    """`size` agent sessions from checkout `root`, `PER_PROCESS` to a process, all joined."""
    remaining = size
    while remaining > 0:
        count = min(PER_PROCESS, remaining)
        argv = [python_of(root), "-m", "bench.fleet_agents", "--router", addr, "--count"]
        procs.spawn(f"agents-{remaining}", [*argv, str(count)], cwd=root)
        remaining -= count
    deadline = time.monotonic() + 120 + size / 10
    while (n := joined(url)) < size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {n}/{size} agents joined")
        time.sleep(1)


def run(size: int, measure: float, settle: float, root: Path = HERE) -> dict:
    procs = Procs()
    # The checkout's own modules first, whatever this interpreter has installed.
    procs.env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(root), os.environ.get("PYTHONPATH")])
    )
    try:
        router, url, addr = start_router(procs, root)
        router_ps = psutil.Process(router.pid)
        idle_rss = router_ps.memory_info().rss
        join_agents(procs, url, addr, size, root)
        time.sleep(settle)  # let the join burst settle
        cpu0 = sum(router_ps.cpu_times()[:2])
        t0 = time.monotonic()
        time.sleep(measure)
        cpu = sum(router_ps.cpu_times()[:2]) - cpu0
        share = cpu / (time.monotonic() - t0)
        return {
            "agents": size,
            "joined": joined(url),
            "healthy": healthy(url),
            "router_cpu_share_of_one_core": round(share, 4),
            "router_rss_mib": round(router_ps.memory_info().rss / 2**20, 1),
            "router_rss_idle_mib": round(idle_rss / 2**20, 1),
        }
    finally:
        procs.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--measure", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after the joins")
    parser.add_argument("--against", type=Path, default=None, help="another checkout")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    builds = [("this", HERE)]
    if args.against is not None:
        builds.insert(0, (args.against.name, args.against.resolve()))
    print(
        "| build | agents | sessions | healthy | router CPU (share of one core) "
        "| router RSS MiB (idle) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        for round_ in range(args.rounds):
            for name, root in builds if round_ % 2 == 0 else reversed(builds):
                r = run(size, args.measure, args.settle, root)
                print(
                    f"| {name} | {r['agents']} | {r['joined']} | {r['healthy']} "
                    f"| {r['router_cpu_share_of_one_core']:.3f} "
                    f"| {r['router_rss_mib']} ({r['router_rss_idle_mib']}) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
