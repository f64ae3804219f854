"""Router throughput with 1 and 2 workers on this host, and what sharing costs.

    python -m bench.scale [--duration 5] [--concurrency 64] [--rounds 2] [--rate N]
                          [--limits-only] [--before CHECKOUT]

Rows, one after the other, each against the same simulated engine through one agent:
one router process; `--workers 2`; then, `--rounds` times interleaved (A, B, A, B on a
shared host), one router with `--state-url` and a tenant whose key has no limits (A),
and the same router with the tenant's requests per minute, concurrency and tokens per
day counted in Redis (B: leased, router/tenants/shared.py: one admission script per
grant of up to 64 requests, the requests between counted from the lease), and the
same limits counted by the router alone (C: no `--state-url`). `--before CHECKOUT`
adds B run from another checkout (a `git worktree` or `git archive` of an older build)
in each round. Then, in-process, the
per-request cost of the shared capacity (the agent's count over every router, the
router's `elsewhere` bookkeeping). CPU is the router's (all its workers) and Redis's,
in seconds per 1,000 requests; the ratios are each row's over A's of the same round. The load
generator shares the host's cores: on a small or busy machine it, not the router, can
be what limits requests/s.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import redis
import trio

from agent.capacity import SharedCapacity
from bench.loadgen import Result, chat_request, run_load
from bench.procs import Procs, free_port
from router.capacity import report_elsewhere
from router.peers import AgentMetadata, Peer
from router.tenants.config import hash_key

MODEL = "bench-model"
KEY = "bench-tenant-key"
# Limits that never refuse in a run but make every request count: a place taken and
# given back, a token from the bucket, the day's tokens charged and read back.
LIMITS = (
    "    requests_per_minute: 1000000000\n"
    "    burst: 1000000000\n"
    "    max_concurrent: 100000\n"
    "    tokens_per_day: 1000000000000\n"
)


@dataclass
class Row:
    name: str
    result: Result
    router_cpu_per_1k: float
    redis_cpu_per_1k: float | None


def cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
    return total


def router_processes(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def wait_workers(metrics_port: int, workers: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for i in range(workers):
        while True:
            try:
                text = httpx.get(f"http://127.0.0.1:{metrics_port + i}/metrics", timeout=2).text
                if "hivenet_router_agents_healthy 1.0" in text:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {i} never had the agent")
            time.sleep(0.2)


def measure(
    procs: Procs,
    name: str,
    sim_port: int,
    args: argparse.Namespace,
    extra: tuple[str, ...] = (),
    workers: int = 1,
    redis_pid: int | None = None,
    headers: dict[str, str] | None = None,
    root: Path | None = None,
) -> Row:
    http, metrics, p2p = free_port(), free_port(), free_port()
    flags = ("--queue-depth", "1024", *extra)
    if workers > 1:
        flags = (*flags, "--workers", str(workers))
    router, addr = procs.router(http, metrics, p2p, *flags, root=root)
    agent = procs.agent(addr, MODEL, f"http://127.0.0.1:{sim_port}")
    try:
        # By the metrics ports: /v1/models needs a key once there are tenants.
        wait_workers(metrics, workers)
        request = chat_request("127.0.0.1", http, MODEL, False, args.tokens, headers)
        warm = min(1.0, args.duration / 4)
        trio.run(run_load, "127.0.0.1", http, request, args.concurrency, warm, False)
        watched = router_processes(router.pid)
        redis_proc = [psutil.Process(redis_pid)] if redis_pid else []
        before, redis_before = cpu(watched), cpu(redis_proc)
        result = trio.run(
            run_load, "127.0.0.1", http, request, args.concurrency, args.duration, False, args.rate
        )
        per_1k = 1000 / max(result.count, 1)
        router_cpu = (cpu(watched) - before) * per_1k
        redis_cpu = (cpu(redis_proc) - redis_before) * per_1k if redis_pid else None
    finally:
        for proc in (agent, router):
            proc.terminate()
            proc.wait(30)
    return Row(name, result, router_cpu, redis_cpu)


def shared_capacity_cost(rounds: int = 200_000) -> tuple[float, float]:
    """Microseconds per request: on the agent (take, report, give back) and on the
    router (one `elsewhere` report on response_end)."""
    shared = SharedCapacity(64)
    mine, other = shared.join(lambda: None), shared.join(lambda: None)
    shared.try_take(other)
    started = time.perf_counter()
    for _ in range(rounds):
        shared.try_take(mine)
        shared.elsewhere(mine)
        shared.give_back(mine)
    agent_us = (time.perf_counter() - started) / rounds * 1e6

    async def send(msg: dict) -> None:
        raise AssertionError

    meta = AgentMetadata(model=MODEL, capability="llm", engine="sim", capacity=64)
    peer = Peer("p", meta, send, connected_at=0.0, last_seen=0.0)
    started = time.perf_counter()
    for i in range(rounds):
        report_elsewhere(peer, i & 7)
    router_us = (time.perf_counter() - started) / rounds * 1e6
    return agent_us, router_us


def start_redis(procs: Procs) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (scripts/setup installs it)")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    proc = procs.spawn("redis", [*argv, "--appendonly", "no", "--dir", str(procs.dir)])
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def flush(url: str) -> None:
    client = redis.Redis.from_url(url, socket_timeout=5)
    client.flushall()
    client.close()


def auth_file(procs: Procs, name: str, limits: str) -> Path:
    path = Path(procs.dir) / f"auth-{name}.yaml"
    path.write_text(f'tenants:\n  bench:\n    keys: ["{hash_key(KEY)}"]\n{limits}')
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="A, B pairs of the limits rows")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="requests/s in all (0: as fast as answers come); a rate every row reaches"
        " compares their CPU per request at one load on a busy host",
    )
    parser.add_argument("--limits-only", action="store_true", help="skip the 1 and 2 worker rows")
    parser.add_argument(
        "--before", type=Path, help="a checkout whose router also runs the limits row"
    )
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} at the start")

    procs = Procs()
    pairs: list[list[Row]] = []
    try:
        sim_port = free_port()
        procs.sim(MODEL, sim_port)
        rows = []
        if not args.limits_only:
            rows.append(measure(procs, "1 worker", sim_port, args))
            rows.append(measure(procs, "2 workers (--workers 2)", sim_port, args, workers=2))
        redis_proc, url = start_redis(procs)
        bearer = {"Authorization": f"Bearer {KEY}"}
        plain, limited = auth_file(procs, "plain", ""), auth_file(procs, "limited", LIMITS)
        shared = ("--state-url", url)
        variants = [
            ("A: --state-url, a tenant, no limits", plain, None, shared),
            ("B: --state-url, the limits leased from Redis", limited, None, shared),
            ("C: the same limits counted locally (no --state-url)", limited, None, ()),
        ]
        if args.before is not None:
            variants.append((f"B at {args.before.name}", limited, args.before, shared))
        for _ in range(args.rounds):
            pair = []
            for name, auth, root, store in variants:
                # Routers on one Redis share their auth file through it (the first one
                # up publishes it): each row starts on an empty Redis, with its own.
                flush(url)
                flags = (*store, "--auth-file", str(auth))
                pair.append(
                    measure(
                        procs,
                        name,
                        sim_port,
                        args,
                        extra=flags,
                        redis_pid=redis_proc.pid,
                        headers=bearer,
                        root=root,
                    )
                )
            pairs.append(pair)
            rows.extend(pair)
    finally:
        procs.close()
    agent_us, router_us = shared_capacity_cost()
    report(rows, agent_us, router_us, args)
    ratios(pairs)


def ratios(pairs: list[list[Row]]) -> None:
    """Each round's limits rows over its row without limits."""
    if not pairs:
        return
    print()
    print("| round | row | router CPU / A | req/s / A |")
    print("|---|---|---:|---:|")
    for i, (base, *others) in enumerate(pairs, 1):
        for r in others:
            cpu_x = r.router_cpu_per_1k / max(base.router_cpu_per_1k, 1e-9)
            rps_x = r.result.rps / max(base.result.rps, 1e-9)
            print(f"| {i} | {r.name} | {cpu_x:.2f} | {rps_x:.2f} |")


def report(rows: list[Row], agent_us: float, router_us: float, args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(
        f"machine: {platform.machine()}, {psutil.cpu_count()} CPUs, load average "
        f"{load[0]:.1f} at the end, Python {platform.python_version()}"
    )
    print(
        f"{args.concurrency} keep-alive clients, {args.duration:g}s per row, "
        f"{args.tokens} tokens per answer, engine latency 0"
        + (f", paced to {args.rate:g} requests/s" if args.rate else "")
    )
    print()
    print("| routers | req/s | p50/p99 ms | errors | router CPU s/1k req | Redis CPU s/1k req |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        s = r.result.summary()
        redis_cpu = f"{r.redis_cpu_per_1k:.3f}" if r.redis_cpu_per_1k is not None else "-"
        print(
            f"| {r.name} | {s['rps']:.0f} | {s['p50_ms']:.2f}/{s['p99_ms']:.2f} "
            f"| {s['errors']} | {r.router_cpu_per_1k:.3f} | {redis_cpu} |"
        )
    print()
    print(
        f"shared capacity, per request: agent {agent_us:.2f} µs (take, report, give back), "
        f"router {router_us:.2f} µs (one `elsewhere` report); no extra frame"
    )


if __name__ == "__main__":
    main()
