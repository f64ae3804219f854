"""Real router and agent processes on loopback for end-to-end tests."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from protocol.p2p import load_or_create_identity, peer_id_of

SECRET = "test-secret-0123456789-abcdefghijklmnop"
ADMIN_KEY = "test-admin-key"
VENV_BIN = Path(sys.executable).parent


# Daemons bind the ports a test picks for them a moment after the pick. A port the
# kernel may hand out to any outgoing connection (another test's client, the other
# worker's) can be taken in between, which failed suite runs with Errno 98. Picks
# come from below that range, where the kernel never hands out ports on its own, and
# each xdist worker from its own slice, so the two never pick the same.
LOWEST_PICK = 10_000


def ephemeral_floor() -> int:
    """The lowest port the kernel hands out for outgoing connections (0: unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def pick_span(floor: int, worker: str, workers: int) -> range | None:
    """This worker's ports below `floor`; None when there is too little room there."""
    width = (floor - LOWEST_PICK) // max(workers, 1)
    if width < 1_000:
        return None
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    start = LOWEST_PICK + min(index, max(workers, 1) - 1) * width
    return range(start, start + width)


class _Picks:
    """Ports in turn from a random place in a span (another suite running on the same
    host starts elsewhere in it), each one nothing holds when it is picked."""

    def __init__(self, span: range) -> None:
        self.span = span
        self.cursor = random.randrange(len(span))

    def take(self, count: int) -> int | None:
        """The first of `count` consecutive free ports, which no later pick returns
        until the span comes round again; None when the span has none."""
        for _ in range(len(self.span)):
            first = self.span[self.cursor % len(self.span)]
            self.cursor += 1
            if first + count <= self.span.stop and all(
                _bindable(port) for port in range(first, first + count)
            ):
                self.cursor += count - 1
                return first
        return None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_SPAN = pick_span(
    ephemeral_floor(),
    os.environ.get("PYTEST_XDIST_WORKER", ""),
    int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1),
)
_PICKS = _Picks(_SPAN) if _SPAN is not None else None


def free_port() -> int:
    """A loopback port nothing holds now, from this worker's span when there is one."""
    return free_ports(1)


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (`serve --workers N` takes port + i)."""
    first = _PICKS.take(count) if _PICKS is not None else None
    if first is not None:
        return first
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count <= 65536 and all(_bindable(p) for p in range(first + 1, first + count)):
            return first


def wait_until(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, OSError):
            last = None
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextmanager
def sim_process(*flags: str) -> Iterator[str]:
    """`python -m sim FLAGS` on a free port, as an operator runs it beside an agent; its
    URL once `/v1/models` answers (20 s at the most), stopped when the block ends."""
    port = free_port()
    argv = [sys.executable, "-m", "sim", *flags, "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, 20, f"sim {' '.join(flags)}")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


class Proc:
    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log: Path,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd
            )
        return self

    def start_on_free_ports(self, ready: Callable[[], object], repick: Callable[[], None]) -> None:
        """Start it and wait for `ready`. A port free when picked can be taken before
        the process binds it (the other worker's sockets, any client's ephemeral port):
        a first start that fails on that alone starts again, up to twice, on the ports
        `repick` chooses. A restart keeps its ports, which its peers were given."""
        retries = 2 if self.popen is None else 0
        while True:
            logged = self.log_path.stat().st_size if self.log_path.exists() else 0
            Proc.start(self)
            try:
                ready()
                return
            except AssertionError:
                taken = "Address already in use" in self.log()[logged:]
                if not (retries and taken and not self.alive()):
                    raise
                retries -= 1
                repick()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float = 15.0) -> re.Match[str]:
        """The first match of `pattern` in the log; a failure that shows the log's end
        when the process exits without it or the time runs out."""

        def check() -> re.Match[str] | None:
            found = re.search(pattern, self.log())
            if found is None and self.popen is not None and self.popen.poll() is not None:
                # It may have written the line and exited since the read above.
                if (found := re.search(pattern, self.log())) is not None:
                    return found
                raise AssertionError(
                    f"{self.name} exited ({self.popen.returncode}) before {pattern!r}:\n"
                    + self.log()[-3000:]
                )
            return found

        try:
            return wait_until(check, timeout, f"{self.name}: {pattern}")
        except AssertionError as exc:
            if "timed out" not in str(exc):
                raise
            raise AssertionError(f"{exc}; its log ends:\n{self.log()[-3000:]}") from None

    def send_signal(self, sig: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode


class Router(Proc):
    def __init__(self, fleet: Fleet, flags: list[str], env: dict[str, str]) -> None:
        self.fleet = fleet
        self.workers = int(flags[flags.index("--workers") + 1]) if "--workers" in flags else 1
        self.flags = flags
        # Named by its place in the fleet: its ports may change before it first runs.
        name = f"router-{sum(isinstance(p, Router) for p in fleet.procs)}"
        self.identity = fleet.dir / f"{name}.key"
        self.peer_id = str(peer_id_of(load_or_create_identity(self.identity)))
        self._pick_ports()
        super().__init__("router", self.argv, env, fleet.dir / f"{name}.log")

    def _pick_ports(self, again: bool = False) -> None:
        if again and "--p2p-ws-port" in self.flags:
            # Picked by the caller, and as likely as the others to have been taken.
            self.flags[self.flags.index("--p2p-ws-port") + 1] = str(free_port())
        self.http_port = free_port()
        self.metrics_port = free_ports(self.workers)
        self.p2p_port = free_ports(self.workers)
        self.argv = [str(VENV_BIN / "hivenet-router"), "serve", *self.port_flags(), *self.flags]

    def port_flags(self) -> list[str]:
        return [
            "--http-port",
            f"127.0.0.1:{self.http_port}",
            "--metrics-port",
            f"127.0.0.1:{self.metrics_port}",
            "--p2p-port",
            str(self.p2p_port),
            "--identity-path",
            str(self.identity),
        ]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def multiaddr(self) -> str:
        """The address agents dial: WebSocket when the router listens on one."""
        if "--p2p-ws-port" in self.flags:
            ws = self.flags[self.flags.index("--p2p-ws-port") + 1]
            return f"/ip4/127.0.0.1/tcp/{ws}/ws/p2p/{self.peer_id}"
        return f"/ip4/127.0.0.1/tcp/{self.p2p_port}/p2p/{self.peer_id}"

    def start(self) -> Router:
        self.start_on_free_ports(
            lambda: self.wait_log("router_ready"), lambda: self._pick_ports(again=True)
        )
        return self

    def admin(self, path: str) -> Any:
        r = httpx.get(self.url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
        r.raise_for_status()
        return r.json()

    def agents(self) -> list[dict]:
        return self.admin("/admin/routing-table")["agents"]

    def agent(self, peer_id: str) -> dict | None:
        return next((a for a in self.agents() if a["peer_id"] == peer_id), None)

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a sample's values whose labels include `labels`."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            sample, _, label_text = head.partition("{")
            if sample != name:
                continue
            if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                total += float(value)
        return total

    def wait_agent(self, peer_id: str, timeout: float = 20.0, healthy: bool = True) -> dict:
        def check() -> dict | None:
            a = self.agent(peer_id)
            return a if a is not None and a["status"]["healthy"] == healthy else None

        return wait_until(check, timeout, f"agent {peer_id} healthy={healthy}")


class Agent(Proc):
    def __init__(
        self,
        fleet: Fleet,
        routers: list[Router],
        model: str,
        flags: list[str],
        env: dict[str, str],
        engine: str = "sim",
    ) -> None:
        self.identity = fleet.dir / f"agent-{len(fleet.procs)}-{model.replace('/', '_')}.key"
        self.peer_id = str(peer_id_of(load_or_create_identity(self.identity)))
        argv = [str(VENV_BIN / "hivenet-agent"), "--model", model, "--engine", engine]
        for r in routers:
            argv += ["--router", r.multiaddr]
        argv += ["--identity-path", str(self.identity), *flags]
        super().__init__(f"agent-{model}", argv, env, fleet.dir / f"{self.identity.stem}.log")
        self.routers = routers

    def sim_url(self) -> str:
        return self.wait_log(r"sim_engine_listening url=(\S+)").group(1)

    def sim_state(self, **changes: Any) -> dict:
        url = self.sim_url() + "/sim/state"
        if changes:
            return httpx.post(url, json=changes, timeout=5).json()
        return httpx.get(url, timeout=5).json()


class Fleet:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.procs: list[Proc] = []
        self.env = {
            **os.environ,
            "HIVENET_ROUTER_JWT_SECRET": SECRET,
            "HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY,
            "HIVENET_LOG_LEVEL": "info",
            # No load balancer to wait for: a stopped router closes its listener at once
            # (tests of the delay set --drain-delay).
            "HIVENET_ROUTER_DRAIN_DELAY": "0s",
        }

    def router(self, *flags: str, env: dict[str, str] | None = None, start: bool = True) -> Router:
        r = Router(self, list(flags), {**self.env, **(env or {})})
        self.procs.append(r)
        return r.start() if start else r

    def agent(
        self,
        router: Router | list[Router],
        model: str = "m1",
        *flags: str,
        env: dict[str, str] | None = None,
        wait: bool = True,
        engine: str = "sim",
    ) -> Agent:
        """An agent process; `engine` other than "sim" needs `--backend-url` in `flags`."""
        routers = router if isinstance(router, list) else [router]
        a = Agent(self, routers, model, list(flags), {**self.env, **(env or {})}, engine)
        self.procs.append(a)
        a.start()
        if wait:
            self.join(a)
        return a

    def join(self, *agents: Agent) -> None:
        """Wait until each agent, started with `wait=False`, is healthy on its routers.
        Agents started together this way start up side by side: about a second less
        for each agent after the first than starting each after the last has joined."""
        for a in agents:
            for r in a.routers:
                r.wait_agent(a.peer_id)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@contextmanager
def router_and_agent(directory: Path, *router_flags: str) -> Iterator[tuple[Fleet, Router, Agent]]:
    """A fleet of one router (with `router_flags`) and one agent of m1, closed after."""
    fleet = Fleet(directory)
    try:
        router = fleet.router(*router_flags)
        yield fleet, router, fleet.agent(router, "m1")
    finally:
        fleet.close()


def inference_audit_lines(path: Path) -> list[dict]:
    """The audit lines of inference calls: model discovery and every admin call (the
    fleet's own polling of /admin/routing-table too) have lines of their own."""
    from router.http.client import ENDPOINTS

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [line for line in lines if line.get("endpoint") in ENDPOINTS]
