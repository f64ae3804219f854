"""Router cost of a connected fleet: CPU share and resident memory with 10, 100 and
1,000 agent sessions heartbeating at the default period, and the steadiness of its event
loop while requests run through one more, real agent to a simulated engine.

    python -m bench.fleet [--sizes 10,100,1000] [--measure 20] [--settle 5]
                          [--rate 100] [--clients 4] [--tokens 16]
                          [--against /path/to/other/checkout --rounds 3]

`--rate` streamed requests per second (0: none) come from `--clients` keep-alive
connections, each paced to its share of the rate; their latency's p50, p99 and p99.9 are
reported. The router's own `hivenet_router_event_loop_lag_seconds` (each run batch of its
trio loop, wall clock), `..._event_loop_busy_seconds` (the same batches' CPU time) and
`hivenet_router_gc_pause_seconds` are read before and after the measured window: the
longest batch and collector pass (the upper bound of their histogram bucket), the
batches' p99.9, and how many ran over 5 ms (wall clock, then CPU; "the scheduler's": the
difference, turns that ran long only because another process had the core), the
collector's CPU in the window (ms per second); then how long the last /metrics scrape took
(its batch is in the window, as a Prometheus scrape's would be). A checkout without
them shows n/a.

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
import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import Result, _Conn, chat_request
from bench.procs import ADMIN_KEY, Procs, free_port, python_of, wait_models

PER_PROCESS = 250
HERE = Path(__file__).resolve().parent.parent
TRAFFIC_MODEL = "fleet-traffic"
LAG = "hivenet_router_event_loop_lag_seconds"
BUSY = "hivenet_router_event_loop_busy_seconds"
GC = "hivenet_router_gc_pause_seconds"
STALL = 0.005  # the longest pause of the loop the fleet should see


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


def start_router(procs: Procs, root: Path = HERE) -> tuple[subprocess.Popen[bytes], str, str, str]:
    """A router from checkout `root`; returns it, its URL, its p2p address and its
    metrics URL."""
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
    return router, f"http://127.0.0.1:{http}", addr, f"http://127.0.0.1:{metrics}/metrics"


def join_agents(
    procs: Procs, url: str, addr: str, size: int, root: Path = HERE, already: int = 0
) -> None:
    """`size` agent sessions from checkout `root`, `PER_PROCESS` to a process, all joined."""
    remaining = size
    while remaining > 0:
        count = min(PER_PROCESS, remaining)
        argv = [python_of(root), "-m", "bench.fleet_agents", "--router", addr, "--count"]
        procs.spawn(f"agents-{remaining}", [*argv, str(count)], cwd=root)
        remaining -= count
    deadline = time.monotonic() + 120 + size / 10
    n = 0
    while n < size:
        try:
            n = joined(url) - already
        except httpx.HTTPError:  # a router busy with a join burst may drop a poll
            n = 0
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {n}/{size} agents joined")
        time.sleep(1)


Buckets = dict[float, float]  # upper bound -> cumulative count


def histograms(metrics_url: str) -> dict[str, Buckets]:
    """The lag histogram and the collector's (`GC` all generations summed, `GC` + N
    generation N's), as scraped."""
    text = httpx.get(metrics_url, timeout=10).text
    out: dict[str, Buckets] = {LAG: {}, BUSY: {}, GC: {}, GC + "0": {}, GC + "1": {}, GC + "2": {}}
    for family in text_string_to_metric_families(text):
        if family.name not in (LAG, BUSY, GC):
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):  # seconds in all, under the key inf
                sums = out.setdefault(family.name + "_sum", {})
                sums[-1.0] = sums.get(-1.0, 0.0) + sample.value
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                keys = [family.name]
                if "generation" in sample.labels:
                    keys.append(GC + sample.labels["generation"])
                for key in keys:
                    out[key][le] = out[key].get(le, 0.0) + sample.value
    return out


def window(before: Buckets, after: Buckets) -> dict:
    """What the histogram counted between two scrapes: count, the longest's bucket bound,
    p99.9's bound and how many were over `STALL`."""
    if not after:
        return {}
    if not after[max(after)] - before.get(max(after), 0.0):
        return {"count": 0, "over_5ms": 0}
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    longest = next((b for b, c in zip(bounds, counts, strict=True) if c == total), bounds[-1])
    p999 = next((b for b, c in zip(bounds, counts, strict=True) if c >= 0.999 * total), longest)
    at_stall = next(c for b, c in zip(bounds, counts, strict=True) if b >= STALL)
    return {
        "count": int(total),
        "max_le": longest,
        "p999_le": p999,
        "over_5ms": int(total - at_stall),
    }


async def paced_load(port: int, rate: float, clients: int, tokens: int, duration: float) -> Result:
    """`clients` keep-alive connections, each sending a stream every `clients / rate` s."""
    result = Result()
    request = chat_request("127.0.0.1", port, TRAFFIC_MODEL, True, tokens)
    period = clients / rate
    began = trio.current_time()
    stop_at = began + duration

    async def client(offset: float) -> None:
        conn = _Conn(await trio.open_tcp_stream("127.0.0.1", port))
        due = began + offset
        try:
            while due < stop_at:
                await trio.sleep_until(due)
                if conn.closing:
                    await conn.stream.aclose()
                    conn = _Conn(await trio.open_tcp_stream("127.0.0.1", port))
                started = trio.current_time()
                chunk_times: list[float] = []
                await conn.stream.send_all(request)
                if await conn.response(chunk_times) != 200:
                    result.errors += 1
                else:
                    result.latencies.append(trio.current_time() - started)
                due += period
        finally:
            await conn.stream.aclose()

    async with trio.open_nursery() as nursery:
        for i in range(clients):
            nursery.start_soon(client, period * i / clients)
    result.elapsed = trio.current_time() - began
    return result


def start_traffic(procs: Procs, url: str, addr: str) -> int:
    """A simulated engine and one real agent for `TRAFFIC_MODEL`; returns the router's
    HTTP port, the load's target."""
    engine = free_port()
    procs.sim(TRAFFIC_MODEL, engine)
    procs.agent(addr, TRAFFIC_MODEL, f"http://127.0.0.1:{engine}")
    wait_models(url, TRAFFIC_MODEL, 1, timeout=120)
    return int(url.rsplit(":", 1)[1])


def run(
    size: int,
    measure: float,
    settle: float,
    root: Path = HERE,
    rate: float = 0.0,
    clients: int = 4,
    tokens: int = 16,
) -> dict:
    procs = Procs()
    # The checkout's own modules first, whatever this interpreter has installed.
    procs.env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(root), os.environ.get("PYTHONPATH")])
    )
    try:
        router, url, addr, metrics_url = start_router(procs, root)
        router_ps = psutil.Process(router.pid)
        idle_rss = router_ps.memory_info().rss
        # The traffic's agent first: a join queued behind 1,000 others waits minutes here.
        port = start_traffic(procs, url, addr) if rate > 0 else 0
        join_agents(procs, url, addr, size, root, already=1 if rate > 0 else 0)
        time.sleep(settle)  # let the join burst settle
        if rate > 0:  # the agent's first streams open its engine connections
            trio.run(paced_load, port, rate, clients, tokens, 2.0)
        before = histograms(metrics_url)
        cpu0 = sum(router_ps.cpu_times()[:2])
        t0 = time.monotonic()
        if rate > 0:
            load = trio.run(paced_load, port, rate, clients, tokens, measure)
        else:
            time.sleep(measure)
            load = Result()
        cpu = sum(router_ps.cpu_times()[:2]) - cpu0
        share = cpu / (time.monotonic() - t0)
        scraped = time.monotonic()
        after = histograms(metrics_url)
        scrape_ms = (time.monotonic() - scraped) * 1000
        return {
            "lag": window(before[LAG], after[LAG]),
            "busy": window(before[BUSY], after[BUSY]),
            "gc": window(before[GC], after[GC]),
            "gc_by_generation": [window(before[GC + g], after[GC + g]) for g in "012"],
            # The collector's CPU in the window, ms per second of it.
            "gc_ms_per_s": (
                (
                    after.get(GC + "_sum", {}).get(-1.0, 0.0)
                    - before.get(GC + "_sum", {}).get(-1.0, 0.0)
                )
                * 1000
                / measure
            ),
            "requests": load.count,
            "errors": load.errors,
            "scrape_ms": scrape_ms,
            "p50_ms": load.pct(load.latencies, 0.5) * 1000,
            "p99_ms": load.pct(load.latencies, 0.99) * 1000,
            "p999_ms": load.pct(load.latencies, 0.999) * 1000,
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
    parser.add_argument("--rate", type=float, default=100.0, help="streams/s; 0: no traffic")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    builds = [("this", HERE)]
    if args.against is not None:
        builds.insert(0, (args.against.name, args.against.resolve()))
    print(
        "| build | agents | sessions | healthy | router CPU (share of one core) "
        "| router RSS MiB (idle) | requests (errors) | p50 / p99 / p99.9 ms "
        "| loop batches | lag max / p99.9 ms | over 5 ms | CPU max / p99.9 ms | over 5 ms "
        "| the scheduler's | GC passes, max CPU ms (generations 0; 1; 2) | GC CPU ms/s "
        "| a /metrics scrape, ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        for round_ in range(args.rounds):
            for name, root in builds if round_ % 2 == 0 else reversed(builds):
                r = run(size, args.measure, args.settle, root, args.rate, args.clients, args.tokens)
                lag, busy, gc = r["lag"], r["busy"], r["gc"]
                print(
                    f"| {name} | {r['agents']} | {r['joined']} | {r['healthy']} "
                    f"| {r['router_cpu_share_of_one_core']:.3f} "
                    f"| {r['router_rss_mib']} ({r['router_rss_idle_mib']}) "
                    f"| {r['requests']} ({r['errors']}) "
                    f"| {r['p50_ms']:.2f} / {r['p99_ms']:.2f} / {r['p999_ms']:.2f} "
                    f"| {lag.get('count', 'n/a')} | {_ms(lag, 'max_le')} / {_ms(lag, 'p999_le')} "
                    f"| {lag.get('over_5ms', 'n/a')} "
                    f"| {_ms(busy, 'max_le')} / {_ms(busy, 'p999_le')} "
                    f"| {busy.get('over_5ms', 'n/a')} | {_scheduled(lag, busy)} "
                    f"| {gc.get('count', 'n/a')}, {_ms(gc, 'max_le')} "
                    f"({'; '.join(_ms(g, 'max_le') for g in r['gc_by_generation'])}) "
                    f"| {r['gc_ms_per_s']:.2f} "
                    f"| {r['scrape_ms']:.0f} |",
                    flush=True,
                )


def _scheduled(lag: dict, busy: dict) -> str:
    """Turns over 5 ms of wall clock less those over 5 ms of CPU: at least this many
    stalled the loop for want of a core, not for the router's own work (the kernel gave
    the time to other processes)."""
    if "over_5ms" not in lag or "over_5ms" not in busy:
        return "n/a"
    return str(max(0, lag["over_5ms"] - busy["over_5ms"]))


def _ms(counted: dict, key: str) -> str:
    """A bucket's upper bound in ms, as "≤ N"."""
    return f"≤ {counted[key] * 1000:g}" if key in counted else "n/a"


if __name__ == "__main__":
    main()
