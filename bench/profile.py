"""Profile the router or the agent under load with py-spy, and print where time goes.

    pip install -e '.[bench]'     # py-spy; not a dependency of the daemons
    python -m bench.profile router --concurrency 64 [--stream] [--seconds 8]
    python -m bench.profile fleet --agents 500 [--seconds 20]    # an idle fleet's router

Prints the functions holding the largest share of busy samples (idle time in epoll
left out), inclusive of what they call.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import trio

from bench.fleet import join_agents, joined, start_router
from bench.loadgen import chat_request, run_load
from bench.procs import Procs, free_port, wait_models

MODEL = "bench-model"


def summarize(raw: Path, top: int, callers_of: str | None) -> None:
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    callers: Counter[str] = Counter()
    total = idle = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        if "get_events" in frames[-1]:
            idle += n
            continue
        seen = set()
        key = "-"
        for parent, frame in zip(["-", *frames], frames, strict=False):
            if callers_of and frame.startswith(callers_of + " "):
                callers[parent.partition(" (")[0]] += n
            name, _, where = frame.partition(" (")
            path = where.rsplit(":", 1)[0].split("site-packages/")[-1]
            key = f"{name} [{path}]"
            if key not in seen:
                seen.add(key)
                inclusive[key] += n
        own[key] += n
    busy = total - idle
    print(f"samples: {total}, idle {idle}, busy {busy}")
    for key, n in inclusive.most_common(top):
        print(f"{n / max(busy, 1) * 100:5.1f}%  {key}")
    print("self (the function itself, not what it calls):")
    for key, n in own.most_common(top):
        print(f"{n / max(busy, 1) * 100:5.1f}%  {key}")
    for key, n in callers.most_common(15):
        print(f"caller of {callers_of}: {n / max(busy, 1) * 100:5.1f}%  {key}")


def record(spy: str, pid: int, seconds: float, raw: Path) -> subprocess.Popen[bytes]:
    argv = [spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-f", "raw", "-o", str(raw)]
    return subprocess.Popen(
        [*argv, "-r", "200"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def profile_fleet(spy: str, raw: Path, agents: int, seconds: float) -> None:
    procs = Procs()
    try:
        router, url, addr, _ = start_router(procs)
        join_agents(procs, url, addr, agents)
        time.sleep(5)  # let the join burst settle
        recorder = record(spy, router.pid, seconds, raw)
        recorder.wait()
        print(f"{joined(url)} agent sessions")
    finally:
        procs.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", choices=("router", "agent", "fleet"))
    parser.add_argument("--agents", type=int, default=500, help="fleet: sessions to hold")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--callers", default=None, help="also list who calls this function")
    parser.add_argument("--keep", type=Path, default=None, help="write py-spy's raw stacks here")
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    raw = args.keep or Path(tempfile.mkdtemp()) / "profile.txt"
    if args.target == "fleet":
        profile_fleet(spy, raw, args.agents, args.seconds)
        summarize(raw, args.top, args.callers)
        return
    procs = Procs()
    try:
        sim, http, metrics, p2p = free_port(), free_port(), free_port(), free_port()
        procs.sim(MODEL, sim)
        router, addr = procs.router(http, metrics, p2p, "--queue-depth", "1024")
        agent = procs.agent(addr, MODEL, f"http://127.0.0.1:{sim}")
        wait_models(f"http://127.0.0.1:{http}", MODEL, 1)
        pid = router.pid if args.target == "router" else agent.pid
        recorder = record(spy, pid, args.seconds, raw)
        request = chat_request("127.0.0.1", http, MODEL, args.stream, 16)
        result = trio.run(
            run_load, "127.0.0.1", http, request, args.concurrency, args.seconds + 1, args.stream
        )
        recorder.wait()
        print(result.summary())
    finally:
        procs.close()
    summarize(raw, args.top, args.callers)


if __name__ == "__main__":
    main()
