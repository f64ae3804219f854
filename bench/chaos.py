"""A chaos soak: two routers sharing a Redis, three agents joined to both (one of them
over a lossy path), clients sending chat requests, streaming and not, to the routers
in turn, while routers, agents and Redis are killed and restarted at random.

    python -m bench.chaos [--minutes 10] [--seed N] [--clients 8]

The lossy path is a TCP proxy in this process between one agent and each router (no
root or network namespace needed): every chunk it passes waits 0-20 ms, and about one
connection in 50 is cut each second, as a path dropping packets long enough for TCP to
give up would. The agent redials through it.

At the end it prints the requests sent, answered, failed (by cause: the HTTP status and
error code, or the client's exception), answered twice (an answer whose echo names a
request already answered, or another request: a duplicate or a crossed answer), the
kills, and each process's resident memory at its start and at the end (the last
incarnation of a restarted process). A client whose router refuses the connection (it
is down) tries the other router once, as a load balancer does; nothing was sent then.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import trio

from bench.procs import ADMIN_KEY, BIN, SECRET, free_port

MODEL = "m1"
REQUEST_TIMEOUT = 30.0
# Lossy path: each chunk waits up to this long; each connection is cut with this
# chance per second of its life.
MAX_DELAY = 0.02
CUT_PER_SECOND = 0.02


@dataclass
class Proc:
    """A daemon the soak kills and starts again with the same arguments."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    ready: str  # a URL that answers once it runs ("" : a short wait)
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    rss_start: int = 0

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def rss(self) -> int:
        if not self.alive():
            return 0
        assert self.popen is not None
        try:
            return int(psutil.Process(self.popen.pid).memory_info().rss)
        except psutil.Error:
            return 0

    def kill(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            self.popen.send_signal(sig)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


READY_WITHIN = 120.0
AGENTS_WITHIN = 120.0


async def wait_ready(proc: Proc) -> float:
    """Seconds until `proc` answers (a process without a URL: half a second);
    RuntimeError past READY_WITHIN, its log kept."""
    started = trio.current_time()
    if not proc.ready:
        await trio.sleep(0.5)
        return 0.5
    with trio.move_on_after(READY_WITHIN):
        async with httpx.AsyncClient(timeout=2) as client:
            while True:
                try:
                    await client.get(proc.ready)
                    return trio.current_time() - started
                except httpx.HTTPError:
                    await trio.sleep(0.1)
    raise RuntimeError(f"{proc.name} did not come up in {READY_WITHIN:g} s (log: {proc.log})")


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    twice: int = 0
    seen: set[str] = field(default_factory=set)
    kills: Counter[str] = field(default_factory=Counter)
    slowest_start: float = 0.0

    def answer(self, nonce: str, text: str) -> None:
        if nonce not in text or nonce in self.seen:
            self.twice += 1
        self.seen.add(nonce)
        self.answered += 1


class LossyProxy:
    """One port per router: the lossy agent dials these instead of the routers'."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def serve(
        self,
        listen: int,
        target: int,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def handle(inbound: trio.SocketStream) -> None:
            try:
                outbound = await trio.open_tcp_stream("127.0.0.1", target)
            except OSError:
                await inbound.aclose()
                return
            async with outbound, inbound, trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, inbound, outbound, nursery.cancel_scope)
                nursery.start_soon(self._pump, outbound, inbound, nursery.cancel_scope)
                nursery.start_soon(self._cutter, nursery.cancel_scope)

        listeners = await trio.open_tcp_listeners(listen, host="127.0.0.1")
        task_status.started()
        await trio.serve_listeners(handle, listeners)

    async def _pump(
        self, src: trio.SocketStream, dst: trio.SocketStream, scope: trio.CancelScope
    ) -> None:
        try:
            while data := await src.receive_some(65536):
                await trio.sleep(self.rng.uniform(0, MAX_DELAY))
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()

    async def _cutter(self, scope: trio.CancelScope) -> None:
        while True:
            await trio.sleep(1)
            if self.rng.random() < CUT_PER_SECOND:
                scope.cancel()


class Soak:
    def __init__(self, minutes: float, seed: int, clients: int) -> None:
        self.minutes = minutes
        self.rng = random.Random(seed)
        self.seed = seed
        self.clients = clients
        self.dir = Path(tempfile.mkdtemp(prefix="hivenet-chaos-"))
        self.env = {
            **os.environ,
            "HIVENET_ROUTER_JWT_SECRET": SECRET,
            "HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY,
            "HIVENET_LOG_LEVEL": "warn",
        }
        self.tally = Tally()
        self.procs: list[Proc] = []
        self.routers: list[Proc] = []
        self.urls: list[str] = []

    def _proc(self, name: str, argv: list[str], ready: str = "") -> Proc:
        proc = Proc(name, argv, self.dir / f"{name}.log", self.env, ready)
        self.procs.append(proc)
        return proc

    def build(self) -> list[tuple[int, int]]:
        """The processes (not started); the lossy proxy's (listen, router p2p) ports."""
        redis_port = free_port()
        redis_bin = shutil.which("redis-server")
        if redis_bin is None:
            raise SystemExit("redis-server is not installed: run scripts/setup")
        self._proc(
            "redis",
            [redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir)],
        )  # fmt: skip
        state = f"redis://127.0.0.1:{redis_port}/0"
        addrs, proxied, proxies = [], [], []
        for i in range(2):
            http, metrics, p2p = free_port(), free_port(), free_port()
            key = self.dir / f"router-{i}.key"
            out = subprocess.run(
                [str(BIN / "hivenet-router"), "identity", "--identity-path", str(key),
                 "--p2p-port", str(p2p)],
                env=self.env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            addr = out.stdout.strip().splitlines()[-1]
            addrs.append(addr)
            proxy = free_port()
            proxies.append((proxy, p2p))
            proxied.append(addr.replace(f"/tcp/{p2p}/", f"/tcp/{proxy}/"))
            url = f"http://127.0.0.1:{http}"
            self.urls.append(url)
            self.routers.append(
                self._proc(
                    f"router-{i}",
                    [str(BIN / "hivenet-router"), "serve", "--http-port", f"127.0.0.1:{http}",
                     "--metrics-port", f"127.0.0.1:{metrics}", "--p2p-port", str(p2p),
                     "--identity-path", str(key), "--state-url", state,
                     "--request-timeout", f"{REQUEST_TIMEOUT - 5:.0f}s"],
                    url + "/health",
                )
            )  # fmt: skip
        for i in range(3):
            routers = proxied if i == 2 else addrs
            argv = [str(BIN / "hivenet-agent"), "--model", MODEL, "--engine", "sim",
                    "--identity-path", str(self.dir / f"agent-{i}.key"),
                    "--sim-token-latency", "5ms"]  # fmt: skip
            for r in routers:
                argv += ["--router", r]
            self._proc(f"agent-{i}{'-lossy' if i == 2 else ''}", argv)
        return proxies

    async def run(self) -> None:
        proxies = self.build()
        async with trio.open_nursery() as nursery:
            lossy = LossyProxy(random.Random(self.seed + 1))
            for listen, target in proxies:
                await nursery.start(lossy.serve, listen, target)
            for proc in self.procs:
                proc.start()
                await wait_ready(proc)
            await self._wait_agents(3)
            for proc in self.procs:
                proc.rss_start = proc.rss()
            deadline = trio.current_time() + self.minutes * 60
            with trio.move_on_at(deadline):
                async with trio.open_nursery() as load:
                    for i in range(self.clients):
                        load.start_soon(self._client, i)
                    load.start_soon(self._chaos)
            # Everything up again before the memory is read.
            for proc in self.procs:
                if not proc.alive():
                    proc.start()
                    await wait_ready(proc)
            await trio.sleep(2)
            self.report()
            nursery.cancel_scope.cancel()

    async def _wait_agents(self, count: int) -> None:
        with trio.move_on_after(AGENTS_WITHIN):
            async with httpx.AsyncClient(timeout=5) as client:
                while True:
                    try:
                        cards = [
                            (await client.get(f"{u}/v1/models/{MODEL}")).json() for u in self.urls
                        ]
                        if all(c.get("agents", {}).get("healthy") == count for c in cards):
                            return
                    except (httpx.HTTPError, ValueError):
                        pass
                    await trio.sleep(0.2)
        raise RuntimeError(f"{count} agents did not join both routers (logs in {self.dir})")

    async def _chaos(self) -> None:
        """One victim at a time: killed (SIGKILL mostly, SIGTERM sometimes), down 0.5-3 s,
        started again; 1-5 s between victims. A router dies only while the other runs."""
        while True:
            await trio.sleep(self.rng.uniform(1, 5))
            victim = self.rng.choice(self.procs)
            sig = signal.SIGKILL if self.rng.random() < 0.7 else signal.SIGTERM
            await trio.to_thread.run_sync(victim.kill, sig)
            self.tally.kills[f"{victim.name} {signal.Signals(sig).name}"] += 1
            await trio.sleep(self.rng.uniform(0.5, 3))
            victim.restarts += 1
            victim.start()
            took = await wait_ready(victim)
            self.tally.slowest_start = max(self.tally.slowest_start, took)

    async def _client(self, index: int) -> None:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as client:
            n = index
            while True:
                n += 1
                await self._one(client, n, stream=n % 2 == 0)

    async def _one(self, client: httpx.AsyncClient, n: int, stream: bool) -> None:
        nonce = uuid.uuid4().hex
        body = {"model": MODEL, "messages": [{"role": "user", "content": nonce}],
                "max_tokens": 8, "stream": stream}  # fmt: skip
        self.tally.sent += 1
        cause = ""
        for attempt in range(2):
            url = self.urls[(n + attempt) % len(self.urls)] + "/v1/chat/completions"
            try:
                text, cause = await (self._stream if stream else self._plain)(client, url, body)
            except httpx.ConnectError:
                cause = "connect_refused (both routers)"
                await trio.sleep(0.2)
                continue  # nothing was sent: the other router
            except httpx.HTTPError as exc:
                cause = type(exc).__name__
            else:
                if not cause:
                    self.tally.answer(nonce, text)
                    return
            break
        self.tally.failed[cause] += 1
        await trio.sleep(0.1)

    async def _plain(self, client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, str]:
        r = await client.post(url, json=body)
        if r.status_code != 200:
            return "", _cause(r.status_code, r.content)
        return r.json()["choices"][0]["message"]["content"] or "", ""

    async def _stream(self, client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, str]:
        parts: list[str] = []
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return "", _cause(r.status_code, await r.aread())
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return "", f"stream error {event['error'].get('code', '?')}"
                for choice in event.get("choices", []):
                    parts.append((choice.get("delta") or {}).get("content") or "")
            if not done:
                return "", "stream cut without [DONE]"
        return "".join(parts), ""

    def report(self) -> None:
        t = self.tally
        print(f"chaos soak: {self.minutes:g} min, seed {self.seed}, {self.clients} clients")
        print(f"requests sent:     {t.sent}")
        print(f"answered:          {t.answered}")
        print(f"failed:            {sum(t.failed.values())}")
        for cause, count in t.failed.most_common():
            print(f"  {count:6d}  {cause}")
        print(f"answered twice:    {t.twice}")
        print(f"in flight at end:  {t.sent - t.answered - sum(t.failed.values())}")
        print(f"slowest restart:   {t.slowest_start:.1f} s (until it answered HTTP)")
        print("kills:")
        for what, count in sorted(t.kills.items()):
            print(f"  {count:6d}  {what}")
        # A restarted process: its first start's memory, and its last incarnation's.
        print("memory (RSS MiB): process, at start, at end, restarts")
        for proc in self.procs:
            print(
                f"  {proc.name:16s} {proc.rss_start / 2**20:8.1f} {proc.rss() / 2**20:8.1f}"
                f" {proc.restarts:4d}"
            )

    def close(self, keep: bool = False) -> None:
        for proc in reversed(self.procs):
            proc.kill(signal.SIGTERM)
        if keep:
            print(f"logs kept in {self.dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def _cause(status: int, raw: bytes) -> str:
    try:
        error = json.loads(raw).get("error")
        code = error.get("code") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        code = None
    return f"HTTP {status} {code or ''}".strip()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--clients", type=int, default=8)
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    soak = Soak(args.minutes, seed, args.clients)
    failed = True
    try:
        trio.run(soak.run)
        failed = False
    finally:
        soak.close(keep=failed)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
