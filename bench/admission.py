"""Admission control (issue 20): what the gates cost per request, and what B2 does
under an overload.

    python -m bench.admission [--keys 1000] [--models 100] [--requests 20000]
                              [--capacity 8] [--duration 8]

1. In process, no I/O: one request's whole admission path at `--keys` serverless keys
   and `--models` models with every check on (key lookup by hash, the input estimate,
   B1, the daily budget's check-and-charge, B4's buckets and share, B2's reservation,
   then the true-up, the output charge and the release), 256 requests held in flight
   so the pools are never empty. Reported in CPU-µs per request (process time, the
   target is 20 µs) and wall-clock percentiles.
2. Through a real router, one agent and a simulated engine that runs `--capacity`
   requests at once and queues the rest: `--capacity` closed-loop clients give the 1x
   rate and p99; then requests arrive open-loop at 4x that rate for the same time,
   alternately to a router with B2 on (`max_inflight: capacity`, park timeout 0) and
   one with it off. Reports accepted requests/s and their p50/p99, the share refused
   and the p99 time to a 429, and the router's CPU per request.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import psutil
import trio

from bench.loadgen import _Conn, chat_request
from bench.procs import Procs, free_port, wait_models
from router.admission.control import Admission, Admitted
from router.admission.limits import AdmissionLimits, AdmitSettings
from router.metrics import RouterMetrics
from router.tenants.config import load_auth
from router.tenants.counters import LocalCounters

MODEL = "bench-model"
HELD = 256
PAYLOAD = {
    "model": MODEL,
    "max_tokens": 256,
    "messages": [
        {"role": "system", "content": "You are a careful assistant. " * 8},
        {"role": "user", "content": "Summarise the following text. " * 20},
        {"role": "assistant", "content": "Here is a summary of the text. " * 6},
        {"role": "user", "content": "Shorter, please, and in French."},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ],
}


def _auth(keys: int) -> tuple[str, list[str]]:
    raws = [f"sk-hivenet-{i:064x}" for i in range(keys)]
    entries = "".join(
        f'    - key_hash: "{hashlib.sha256(raw.encode()).hexdigest()}"\n'
        f"      metadata: {{name: k{i}, owner: t{i % 50}}}\n"
        "      mode: serverless\n      max_occupancy_share: 0.5\n"
        "      quota: {tokens_per_day: 1000000000, input_tokens_per_minute: 100000000,"
        " output_tokens_per_minute: 100000000}\n"
        for i, raw in enumerate(raws)
    )
    return f"api:\n  mode: api-key\n  keys:\n{entries}admin:\n  mode: api-key\n", raws


async def gate_cost(keys: int, models: int, requests: int) -> dict:
    text, raws = _auth(keys)
    config = load_auth(text)
    admission = Admission(AdmitSettings(park_timeout=0), RouterMetrics(), lambda model: 4)
    limits = AdmissionLimits(
        mode="serverless",
        max_input_tokens=100_000,
        images_max=4,
        admit_budget_tokens=10**9,
        max_inflight=10**6,
    )
    counters = LocalCounters()
    names = [f"model-{i}" for i in range(models)]
    held: deque[tuple[Admitted, str, str]] = deque()
    usage = {"prompt_tokens": 300, "completion_tokens": 40}
    times: list[float] = []
    cpu0 = time.process_time()
    for i in range(requests):
        raw, model = raws[i % keys], names[(i * 7) % models]
        started = time.perf_counter()
        key = config.key_for(raw)
        assert key is not None
        tenant = config.tenants[key.tenant].for_model(model, 4)
        estimate = admission.estimate(model, PAYLOAD)
        assert admission.caps(model, limits, key.limits_for(model), estimate) is None
        ticket = f"t{i}"
        assert counters.admit(tenant, ticket, estimate.footprint, estimate.tokens).code is None
        admitted = await admission.reserve(model, limits, key, estimate)
        assert isinstance(admitted, Admitted)
        held.append((admitted, tenant.name, ticket))
        if len(held) > HELD:
            done, name, old = held.popleft()
            done.usage = usage
            await admission.finish(done)
            counters.release(name, old, 340 - done.estimate.tokens)
        times.append(time.perf_counter() - started)
    cpu = time.process_time() - cpu0
    times.sort()
    return {
        # Process CPU time over the loop: robust to other processes' load (wall times
        # below include the time this process was descheduled).
        "cpu_us": round(cpu / requests * 1e6, 2),
        "keys": keys,
        "models": models,
        "requests": requests,
        "mean_us": round(statistics.fmean(times) * 1e6, 2),
        "p50_us": round(times[len(times) // 2] * 1e6, 2),
        "p99_us": round(times[int(len(times) * 0.99)] * 1e6, 2),
        "estimate_tokens": admission.estimate(names[0], PAYLOAD).tokens,
    }


@dataclass
class Outcome:
    accepted: list[float] = field(default_factory=list)
    refused: list[float] = field(default_factory=list)
    other: int = 0
    elapsed: float = 0.0


class _Conns:
    """Keep-alive connections, reused by whichever request comes next."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[_Conn] = []

    async def take(self) -> _Conn:
        return (
            self.idle.pop()
            if self.idle
            else _Conn(await trio.open_tcp_stream("127.0.0.1", self.port))
        )

    def give(self, conn: _Conn) -> None:
        self.idle.append(conn)


async def _one(conns: _Conns, request: bytes, out: Outcome) -> None:
    conn = await conns.take()
    started = trio.current_time()
    try:
        await conn.stream.send_all(request)
        status = await conn.response([])
    except (OSError, ConnectionError, trio.BrokenResourceError):
        out.other += 1
        return
    took = trio.current_time() - started
    if status == 200:
        out.accepted.append(took)
    elif status == 429:
        out.refused.append(took)
    else:
        out.other += 1
    if conn.closing:
        await conn.stream.aclose()
    else:
        conns.give(conn)


async def closed_loop(port: int, clients: int, duration: float, tokens: int) -> Outcome:
    """`clients` clients, each sending its next request when its last one is answered."""
    out = Outcome()
    request = chat_request("127.0.0.1", port, MODEL, False, tokens)
    conns = _Conns(port)
    stop_at = trio.current_time() + duration

    async def client() -> None:
        while trio.current_time() < stop_at:
            await _one(conns, request, out)

    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)
    out.elapsed = trio.current_time() - began
    return out


async def open_loop(port: int, rate: float, duration: float, tokens: int) -> Outcome:
    """Requests arriving at `rate` per second whatever the answers (an overload does
    not slow its senders down)."""
    out = Outcome()
    request = chat_request("127.0.0.1", port, MODEL, False, tokens)
    conns = _Conns(port)
    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        sent = 0
        while (now := trio.current_time()) < began + duration:
            due = int((now - began) * rate) + 1
            for _ in range(due - sent):
                nursery.start_soon(_one, conns, request, out)
            sent = due
            await trio.sleep(1 / rate)
    out.elapsed = trio.current_time() - began
    for conn in conns.idle:
        await conn.stream.aclose()
    return out


def _pct_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)


def _row(
    load: str, b2: str, out: Outcome, proc: psutil.Process, cpu: float | None, rate: float = 0
) -> dict:
    total = len(out.accepted) + len(out.refused) + out.other
    return {
        "load": load,
        "b2": b2,
        "offered_rps": round(rate, 1) if rate else None,
        "accepted_rps": round(len(out.accepted) / out.elapsed, 1),
        "accepted_p50_ms": _pct_ms(out.accepted, 0.5),
        "accepted_p99_ms": _pct_ms(out.accepted, 0.99),
        "refused_share": round(len(out.refused) / total, 3) if total else 0.0,
        "refused_p99_ms": _pct_ms(out.refused, 0.99),
        "other_errors": out.other,
        "router_cpu_ms_per_request": round(cpu / total * 1000, 3) if cpu and total else None,
    }


def overload(capacity: int, duration: float, tokens: int) -> list[dict]:
    rows: list[dict] = []
    procs = Procs()
    try:
        policies = {}
        for name, extra in (("on", f"max_inflight: {capacity}\n"), ("off", "")):
            path = procs.dir / f"policy-{name}.yaml"
            path.write_text(extra + "routing_policy:\n  strategy: least-loaded\n")
            policies[name] = path
        procs.env["HIVENET_ROUTER_ADMIT_PARK_TIMEOUT"] = "0"
        routers = {}
        for name, path in policies.items():
            http = free_port()
            router, addr = procs.router(
                http, free_port(), free_port(), "--policy-file", str(path), "--queue-size", "10000"
            )
            # An engine each: the queue B2-off leaves behind must not slow B2-on.
            sim_port = free_port()
            procs.sim(MODEL, sim_port, "--capacity", str(capacity), "--token-latency", "0.01")
            procs.agent(addr, MODEL, f"http://127.0.0.1:{sim_port}")
            wait_models(f"http://127.0.0.1:{http}", MODEL, 1)
            routers[name] = (http, psutil.Process(router.pid))
        port, proc = routers["on"]
        trio.run(closed_loop, port, capacity, 1.0, tokens)  # warm-up
        cpu0 = sum(proc.cpu_times()[:2])
        base = trio.run(closed_loop, port, capacity, duration, tokens)
        rate = 4 * len(base.accepted) / base.elapsed
        rows.append(_row("1x", "on", base, proc, sum(proc.cpu_times()[:2]) - cpu0))
        # 4x the rate the pool serves at 1x, B2 on and off, interleaved so that the
        # machine's load falls on both alike.
        for b2 in ("on", "off", "on", "off"):
            port, proc = routers[b2]
            cpu0 = sum(proc.cpu_times()[:2])
            out = trio.run(open_loop, port, rate, duration / 2, tokens)
            rows.append(_row("4x", b2, out, proc, sum(proc.cpu_times()[:2]) - cpu0, rate))
    finally:
        procs.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--skip-overload", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report: dict = {"load_average": os.getloadavg()[0], "cpus": os.cpu_count()}
    report["gates"] = trio.run(gate_cost, args.keys, args.models, args.requests)
    if not args.skip_overload:
        report["overload"] = overload(args.capacity, args.duration, args.tokens)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    g = report["gates"]
    print(
        f"gates at {g['keys']} keys, {g['models']} models: {g['cpu_us']} CPU-µs, wall mean"
        f" {g['mean_us']} µs,"
        f" p50 {g['p50_us']} µs, p99 {g['p99_us']} µs per request"
        f" (load average {report['load_average']:.1f} on {report['cpus']} CPUs)"
    )
    for row in report.get("overload", []):
        print(
            f"{row['load']} B2 {row['b2']:>3}: offered {row['offered_rps']} rps, accepted"
            f" {row['accepted_rps']} rps, p50 {row['accepted_p50_ms']} ms, p99"
            f" {row['accepted_p99_ms']} ms; refused {row['refused_share']:.0%} (p99"
            f" {row['refused_p99_ms']} ms); router {row['router_cpu_ms_per_request']}"
            " CPU-ms/request"
        )


if __name__ == "__main__":
    main()
