"""Long streams through router and agent: relayed events per second of CPU.

    python -m bench.stream_relay [--tokens 512] [--concurrency 8] [--duration 5]
                                 [--rounds 2] [--against /path/to/other/checkout]
    python -m bench.stream_relay --tokens 16 --concurrency 64 [--whole] --against ...
    python -m bench.stream_relay --token-latency 0.02 --concurrency 64 --duration 12

Clients stream chat completions of `--tokens` tokens each from a simulated engine
through a router and an agent. By default the engine has no token latency: it writes
its events as fast as it can, one HTTP chunk each, and how many of them each hop finds
waiting in one read depends on how fast the hops are. `--token-latency` paces each
stream as an engine decodes (seconds per token), so that every event travels alone.
Reported per build: SSE events relayed (what the client's SDK sees as chunks), events
per second of router CPU and of agent CPU, and how many HTTP chunks
the client received per event (below 1 when events that arrived together left
together), and the router's and the agent's CPU per request. `--whole` asks for
whole answers instead of streams (the CPU per request of `bench.overhead`'s cells).

With `--against DIR`, a second router, agent and engine run from that checkout (its
`.venv` when it has one, else this interpreter with DIR first on the path), and the
two builds are measured in turn, round after round, so both see the same host load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import trio

from bench.procs import ADMIN_KEY, SECRET, free_port, python_of, wait_http, wait_models

MODEL = "relay-model"
HERE = Path(__file__).resolve().parent.parent


@dataclass
class Tally:
    requests: int = 0
    events: int = 0
    http_chunks: int = 0
    errors: int = 0
    router_cpu: float = 0.0
    agent_cpu: float = 0.0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def p50_ms(self) -> float:
        return statistics.median(self.latencies) * 1000 if self.latencies else 0.0


@dataclass
class Build:
    """One checkout's router, agent and engine, started as processes."""

    name: str
    tree: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    http: int = 0
    router: psutil.Process | None = None
    agent: psutil.Process | None = None

    def python(self) -> str:
        return python_of(self.tree)

    def spawn(self, logs: Path, name: str, *argv: str) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "PYTHONPATH": str(self.tree),
            "HIVENET_ROUTER_JWT_SECRET": SECRET,
            "HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY,
            "HIVENET_LOG_LEVEL": "warn",
        }
        log = open(logs / f"{self.name}-{name}.log", "wb")  # noqa: SIM115 - lives with the process
        proc = subprocess.Popen(
            [self.python(), *argv], env=env, cwd=self.tree, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs.append(proc)
        return proc

    def start(self, logs: Path, token_latency: float) -> None:
        sim, metrics, p2p = free_port(), free_port(), free_port()
        self.http = free_port()
        # The engine is always this checkout's, so both builds relay the same events.
        env = {**os.environ, "PYTHONPATH": str(HERE)}
        engine = ("--model", MODEL, "--port", str(sim), "--token-latency", str(token_latency))
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "sim", *engine],
                env=env,
                cwd=HERE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        wait_http(f"http://127.0.0.1:{sim}/health")
        key = logs / f"{self.name}-router.key"
        p2p_flag = ("--p2p-port", str(p2p))
        out = subprocess.run(
            [self.python(), "-m", "router.cli", "identity", "--identity-path", str(key), *p2p_flag],
            capture_output=True,
            text=True,
            check=True,
            cwd=self.tree,
            env={**os.environ, "PYTHONPATH": str(self.tree)},
        )
        addr = out.stdout.strip().splitlines()[-1]
        router = self.spawn(
            logs,
            "router",
            *("-m", "router.cli", "serve", "--http-port", f"127.0.0.1:{self.http}"),
            *("--metrics-port", f"127.0.0.1:{metrics}", "--p2p-port", str(p2p)),
            *("--identity-path", str(key), "--queue-depth", "1024"),
        )
        wait_http(f"http://127.0.0.1:{self.http}/health")
        agent = self.spawn(
            logs,
            "agent",
            *("-m", "agent.cli", "--router", addr, "--model", MODEL, "--engine", "vllm"),
            *("--backend-url", f"http://127.0.0.1:{sim}", "--capacity", "1024"),
            *("--identity-path", str(logs / f"{self.name}-agent.key")),
        )
        wait_models(f"http://127.0.0.1:{self.http}", MODEL, 1)
        self.router, self.agent = psutil.Process(router.pid), psutil.Process(agent.pid)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def read_answer(stream: trio.SocketStream, buf: bytearray, tally: Tally) -> bool:
    """One answer; counts a stream's events and HTTP chunks. False: not a 200."""

    async def fill() -> None:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        buf.extend(data)

    while (end := buf.find(b"\r\n\r\n")) < 0:
        await fill()
    ok = buf[9:12] == b"200"
    head = bytes(buf[:end]).lower()
    del buf[: end + 4]
    if b"transfer-encoding: chunked" not in head:
        length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        while len(buf) < length:
            await fill()
        del buf[:length]
        tally.requests += ok
        return ok
    events = chunks = 0
    while True:
        while (end := buf.find(b"\r\n")) < 0:
            await fill()
        size = int(bytes(buf[:end]).split(b";")[0], 16)
        while len(buf) < end + 2 + size + 2:
            await fill()
        if size == 0:
            del buf[: end + 4]
            break
        events += buf.count(b"data:", end + 2, end + 2 + size)
        chunks += 1
        del buf[: end + 2 + size + 2]
    if ok:
        tally.requests += 1
        tally.events += events
        tally.http_chunks += chunks
    return ok


def chat_request(port: int, tokens: int, stream: bool) -> bytes:
    # `ignore_eos`, as vLLM benchmarks use it: exactly `tokens` tokens per answer.
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a long answer please"}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def load(port: int, request: bytes, concurrency: int, duration: float) -> Tally:
    tally = Tally()
    stop_at = trio.current_time() + duration

    async def client() -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        buf = bytearray()
        async with stream:
            while trio.current_time() < stop_at:
                started = trio.current_time()
                await stream.send_all(request)
                if await read_answer(stream, buf, tally):
                    tally.latencies.append(trio.current_time() - started)
                else:
                    tally.errors += 1

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    return tally


def measure(build: Build, args: argparse.Namespace) -> Tally:
    assert build.router is not None and build.agent is not None
    request = chat_request(build.http, args.tokens, not args.whole)
    trio.run(load, build.http, request, args.concurrency, 0.5)  # connections, caches
    cpu = [sum(p.cpu_times()[:2]) for p in (build.router, build.agent)]
    started = time.monotonic()
    tally = trio.run(load, build.http, request, args.concurrency, args.duration)
    tally.seconds = time.monotonic() - started
    tally.router_cpu = sum(build.router.cpu_times()[:2]) - cpu[0]
    tally.agent_cpu = sum(build.agent.cpu_times()[:2]) - cpu[1]
    return tally


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--whole", action="store_true", help="whole answers, not streams")
    parser.add_argument(
        "--token-latency", type=float, default=0.0, help="the engine's seconds per token"
    )
    parser.add_argument("--against", type=Path, default=None, help="another checkout")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    builds = [Build("this", HERE)]
    if args.against is not None:
        builds.insert(0, Build(args.against.name, args.against.resolve()))
    logs = Path(tempfile.mkdtemp(prefix="hivenet-relay-"))
    totals = {b.name: Tally() for b in builds}
    try:
        for build in builds:
            build.start(logs, args.token_latency)
        for round_ in range(args.rounds):
            for build in builds if round_ % 2 == 0 else reversed(builds):
                totals[build.name].add(measure(build, args))
    finally:
        for build in builds:
            build.close()
    report(totals, args)


def report(totals: dict[str, Tally], args: argparse.Namespace) -> None:
    rows = {
        name: {
            "requests": t.requests,
            "events": t.events,
            "errors": t.errors,
            "events_per_s": t.events / max(t.seconds, 1e-9),
            "events_per_router_cpu_s": t.events / max(t.router_cpu, 1e-9),
            "events_per_agent_cpu_s": t.events / max(t.agent_cpu, 1e-9),
            "http_chunks_per_event": t.http_chunks / max(t.events, 1),
            "router_cpu_ms_per_request": t.router_cpu * 1000 / max(t.requests, 1),
            "agent_cpu_ms_per_request": t.agent_cpu * 1000 / max(t.requests, 1),
            "p50_ms": t.p50_ms(),
        }
        for name, t in totals.items()
    }
    if args.json:
        print(json.dumps(rows))
        return
    kind = "whole answers" if args.whole else "streams"
    pace = f", {args.token_latency * 1000:g} ms per token" if args.token_latency else ""
    print(
        f"{args.tokens}-token {kind}{pace}, {args.concurrency} clients, {args.rounds} rounds "
        f"of {args.duration:g} s per build, load average {os.getloadavg()[0]:.1f}"
    )
    print()
    print(
        "| build | requests | events/s | events per router CPU s | events per agent CPU s "
        "| client HTTP chunks per event | router / agent CPU ms per request | p50 ms | errors |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['requests']} | {r['events_per_s']:.0f} "
            f"| {r['events_per_router_cpu_s']:.0f} | {r['events_per_agent_cpu_s']:.0f} "
            f"| {r['http_chunks_per_event']:.2f} | {r['router_cpu_ms_per_request']:.3f} / "
            f"{r['agent_cpu_ms_per_request']:.3f} | {r['p50_ms']:.2f} | {r['errors']} |"
        )


if __name__ == "__main__":
    main()
