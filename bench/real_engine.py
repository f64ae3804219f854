"""Routed against direct on a real engine: the same streams sent straight to a running
vLLM and through a router and one agent in front of it, in one run.

    python -m bench.real_engine --engine-url http://127.0.0.1:8000 --model tiny \\
        [--concurrency 1,16,64] [--duration 20] [--tokens 128] [--staggered] [--think S]

Each of `concurrency` clients sends greedy streams of `--tokens` output tokens
(`ignore_eos`, so every answer has the same length) with `include_usage`, one after
another, for `--duration` seconds. Reported per level: output tokens per second (from
the engine's usage chunks) direct and routed and their ratio, and the time to the first
content token, p50 and p99, direct and routed and the difference. Direct and routed
levels alternate, so a machine that slows down mid-run affects both alike; `--rounds N`
runs every level N times over and reports each cell's median round. Clients start
together (every answer has the same length, so they stay in step: their requests reach
the engine in one burst), or with `--staggered` spread over one stream's length, as
independent users' requests arrive. `--think S`: each client pauses a random time
between its streams (exponential, mean S seconds; the same pauses direct and routed),
so that a request does not leave the instant the engine's step that ended the last
one does.

Each run's machine stalls are reported beside it: the CPU-seconds in which a process
pinned to each CPU could not run at all (bench/stalls.py). These machines stop a CPU
for up to seconds under a CPU vLLM's load, and a run that lost more of them than the
run it is compared to measured the machine.

`--router-cpus 1` runs the router and the agent on those CPUs only, and the load
generator too (`--client-cpus`, the same by default): with the engine started on the
others (`taskset -c 0 vllm serve ...`), the router and agent take no CPU from the
engine, as on a GPU host, where the engine's work is not on the router's cores. Without
it everything shares every core, and each CPU-second the router spends is one a
CPU-only engine does not get.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from bench.procs import Procs, free_port, wait_models
from bench.stalls import Stalls


@dataclass
class Run:
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed: float = 0.0
    # The measured span (time.monotonic()), and the machine's stalls in it, CPU-seconds.
    began: float = 0.0
    ended: float = 0.0
    stalled: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed if self.elapsed else 0.0

    def pct(self, q: float) -> float:
        values = sorted(self.ttft)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one_stream(client: httpx.AsyncClient, url: str, body: dict, run: Run) -> None:
    started = time.perf_counter()
    first = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            run.errors += 1
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and any(
                (c.get("delta") or {}).get("content") for c in event.get("choices") or ()
            ):
                first = time.perf_counter() - started
            if not event.get("choices") and event.get("usage"):
                run.tokens += event["usage"]["completion_tokens"]
    if first is not None:
        run.ttft.append(first)


async def load(
    base: str,
    model: str,
    concurrency: int,
    duration: float,
    tokens: int,
    staggered: bool = False,
    think: float = 0.0,
) -> Run:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = base + "/v1/chat/completions"
    run = Run()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        # Warm-up: connections open, the engine's first requests done.
        warm = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(one_stream, client, url, body, Run())
        # Staggered: client i starts i/N of a stream's length late, so that streams
        # begin and end spread over time as independent users' do, not all in one
        # engine step (every answer has the same length: clients that start together
        # stay together). The count starts once every client runs.
        ramp = (time.perf_counter() - warm) if staggered else 0.0
        started = time.perf_counter() + ramp
        run.began = time.monotonic() + ramp
        deadline = started + duration

        # The same pauses for direct and routed: one seeded sequence per client.
        async def worker(offset: float, pauses: random.Random) -> None:
            await trio.sleep(offset)
            while time.perf_counter() < deadline:
                mine = run if time.perf_counter() >= started else Run()
                await one_stream(client, url, body, mine)
                if think:
                    await trio.sleep(pauses.expovariate(1 / think))

        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(worker, ramp * i / concurrency, random.Random(i))
        run.elapsed = time.perf_counter() - started
        run.ended = time.monotonic()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-url", required=True, help="a running vLLM")
    parser.add_argument("--model", required=True, help="its served model name")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--router-cpus", default="", help="e.g. 1: the router's and agent's")
    parser.add_argument("--client-cpus", default="", help="the load's (default: --router-cpus)")
    parser.add_argument("--policy-file", help="the router's policy (e.g. stream_continuation)")
    parser.add_argument(
        "--staggered",
        action="store_true",
        help="clients start spread over a stream's length, not together",
    )
    parser.add_argument(
        "--think",
        type=float,
        default=0.0,
        help="mean seconds a client pauses between its streams (exponential; 0: none)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    router_cpus = _cpus(args.router_cpus)
    client_cpus = _cpus(args.client_cpus) or router_cpus
    # Every CPU watched, before this process keeps to its own.
    stalls = Stalls(Path(tempfile.mkdtemp(prefix="bench-stalls-")))
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    procs = Procs()
    try:
        http, metrics, p2p = free_port(), free_port(), free_port()
        policy = ("--policy-file", args.policy_file) if args.policy_file else ()
        router, addr = procs.router(http, metrics, p2p, *policy)
        agent = procs.agent(addr, args.model, args.engine_url)
        if router_cpus:
            for proc in (router, agent):
                os.sched_setaffinity(proc.pid, router_cpus)
        routed_url = f"http://127.0.0.1:{http}"
        wait_models(routed_url, args.model, 1)
        runs: dict[int, list[tuple[Run, Run]]] = {level: [] for level in levels}
        for _ in range(args.rounds):
            for level in levels:
                for_level = (level, args.duration, args.tokens, args.staggered, args.think)
                d = trio.run(load, args.engine_url, args.model, *for_level)
                r = trio.run(load, routed_url, args.model, *for_level)
                for run in (d, r):
                    run.stalled = stalls.lost(run.began, run.ended)
                runs[level].append((d, r))
    finally:
        stalls.close()
        procs.close()
    report([(level, *_median(pairs)) for level, pairs in runs.items()], args)


def _cpus(text: str) -> set[int]:
    return {int(c) for c in text.split(",") if c.strip()}


def _median(pairs: list[tuple[Run, Run]]) -> tuple[Run, Run]:
    """The round whose routed/direct ratio is the median of the rounds'."""
    ratios = [r.tokens_per_s / d.tokens_per_s if d.tokens_per_s else 0.0 for d, r in pairs]
    middle = statistics.median_low(ratios)
    return pairs[ratios.index(middle)]


def report(rows: list[tuple[int, Run, Run]], args: argparse.Namespace) -> None:
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "concurrency": level,
                        "direct_tokens_per_s": round(d.tokens_per_s, 1),
                        "routed_tokens_per_s": round(r.tokens_per_s, 1),
                        "ttft_ms": {
                            q: [round(d.pct(p) * 1000, 1), round(r.pct(p) * 1000, 1)]
                            for q, p in (("p50", 0.5), ("p99", 0.99))
                        },
                        "errors": d.errors + r.errors,
                        "stalled_s": [round(d.stalled, 2), round(r.stalled, 2)],
                    }
                    for level, d, r in rows
                ]
            )
        )
        return
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()
    load_cpus = args.client_cpus or args.router_cpus or "all"
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, build {commit}, "
        f"{platform.processor() or platform.machine()}, {args.tokens} tokens a stream, "
        f"{args.duration:g} s a level, median of {args.rounds} round(s),"
        f" {'staggered' if args.staggered else 'lockstep'} clients, think {args.think:g} s,"
        " router and agent"
        f" on CPUs {args.router_cpus or 'all'}, load on {load_cpus}"
    )
    print(
        "| streams | direct tok/s | routed tok/s | ratio | TTFT p50 direct / routed / added ms "
        "| TTFT p99 direct / routed / added ms | errors | stalls s direct / routed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for level, d, r in rows:
        ratio = r.tokens_per_s / d.tokens_per_s if d.tokens_per_s else float("nan")
        cells = []
        for q in (0.5, 0.99):
            dq, rq = d.pct(q) * 1000, r.pct(q) * 1000
            cells.append(f"{dq:.1f} / {rq:.1f} / {rq - dq:+.1f}")
        print(
            f"| {level} | {d.tokens_per_s:.0f} | {r.tokens_per_s:.0f} | {ratio:.3f} "
            f"| {cells[0]} | {cells[1]} | {d.errors + r.errors} "
            f"| {d.stalled:.2f} / {r.stalled:.2f} |"
        )


if __name__ == "__main__":
    main()
