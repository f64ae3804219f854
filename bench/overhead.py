"""Router overhead: the same load sent directly to a simulated engine and through the
router and one agent to that same engine, in one run.

    python -m bench.overhead [--duration 5] [--concurrency 1,16,64,256]

Reports requests/s, p50/p99 latency, the router's added latency, the router's and the
agent's CPU seconds per 1,000 requests, and for streams time to first chunk and chunks/s.
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import dataclass

import psutil
import trio

from bench.loadgen import Result, chat_request, null_server, run_load
from bench.procs import Procs, free_port, wait_models

MODEL = "bench-model"


@dataclass
class Row:
    mode: str
    concurrency: int
    direct: Result
    routed: Result
    router_cpu_per_1k: float
    agent_cpu_per_1k: float


async def measure(
    port: int, stream: bool, concurrency: int, duration: float, tokens: int
) -> Result:
    request = chat_request("127.0.0.1", port, MODEL, stream, tokens)
    # A short warm-up opens connections and fills caches on both sides.
    await run_load("127.0.0.1", port, request, concurrency, min(1.0, duration / 4), stream)
    return await run_load("127.0.0.1", port, request, concurrency, duration, stream)


async def generator_ceiling(duration: float, concurrency: int) -> Result:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(null_server)
        request = chat_request("127.0.0.1", port, MODEL, False, 16)
        result = await run_load("127.0.0.1", port, request, concurrency, duration, False)
        nursery.cancel_scope.cancel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    procs = Procs()
    try:
        sim_port, http, metrics, p2p = free_port(), free_port(), free_port(), free_port()
        procs.sim(MODEL, sim_port)
        router, addr = procs.router(http, metrics, p2p, "--queue-depth", "1024")
        agent = procs.agent(addr, MODEL, f"http://127.0.0.1:{sim_port}")
        wait_models(f"http://127.0.0.1:{http}", MODEL, 1)
        watched = [psutil.Process(router.pid), psutil.Process(agent.pid)]

        rows: list[Row] = []
        for mode, stream in (("non-streaming", False), ("streaming", True)):
            for c in levels:
                direct = trio.run(measure, sim_port, stream, c, args.duration, args.tokens)
                before = [sum(p.cpu_times()[:2]) for p in watched]
                routed = trio.run(measure, http, stream, c, args.duration, args.tokens)
                # The warm-up ran a quarter of the duration.
                per_1k = 1000 / max(routed.count * 1.25, 1)
                router_cpu, agent_cpu = (
                    (sum(p.cpu_times()[:2]) - b) * per_1k
                    for p, b in zip(watched, before, strict=True)
                )
                rows.append(Row(mode, c, direct, routed, router_cpu, agent_cpu))
        ceiling = trio.run(generator_ceiling, args.duration, 64)
    finally:
        procs.close()
    report(rows, ceiling, args)


def report(rows: list[Row], ceiling: Result, args: argparse.Namespace) -> None:
    if args.json:
        print(
            json.dumps(
                [
                    r.__dict__ | {"direct": r.direct.summary(), "routed": r.routed.summary()}
                    for r in rows
                ],
                default=str,
            )
        )
        return
    print(
        f"machine: {platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"Python {platform.python_version()}"
    )
    print(f"load generator alone (null server, 64 connections): {ceiling.rps:.0f} req/s")
    print(
        f"duration {args.duration:g}s per cell, {args.tokens} tokens per answer, engine latency 0"
    )
    print()
    print(
        "| mode | clients | direct req/s | routed req/s | routed/direct | direct p50/p99 ms "
        "| routed p50/p99 ms | added p50/p99 ms | router CPU s/1k req | agent CPU s/1k req "
        "| TTFC p50 ms direct/routed | chunks/s routed/direct |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        d, x = r.direct.summary(), r.routed.summary()
        ttfc = (
            f"{d['ttfc_p50_ms']:.2f}/{x['ttfc_p50_ms']:.2f}"
            if d["ttfc_p50_ms"] is not None
            else "-"
        )
        chunks = f"{x['chunks_per_s'] / d['chunks_per_s']:.2f}" if d["chunks_per_s"] else "-"
        print(
            f"| {r.mode} | {r.concurrency} | {d['rps']:.0f} | {x['rps']:.0f} "
            f"| {x['rps'] / d['rps']:.2f} | {d['p50_ms']:.2f}/{d['p99_ms']:.2f} "
            f"| {x['p50_ms']:.2f}/{x['p99_ms']:.2f} "
            f"| {x['p50_ms'] - d['p50_ms']:.2f}/{x['p99_ms'] - d['p99_ms']:.2f} "
            f"| {r.router_cpu_per_1k:.3f} | {r.agent_cpu_per_1k:.3f} | {ttfc} | {chunks} |"
        )
        if d["errors"] or x["errors"]:
            print(f"|   errors: direct {d['errors']}, routed {x['errors']} |")


if __name__ == "__main__":
    main()
