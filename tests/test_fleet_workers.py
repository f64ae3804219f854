"""`hivenet-router serve --workers N`: one host, N router processes (issue 21, item 3)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import stat
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair

from agent.app import MAX_WORKERS, AgentDaemon
from agent.link import RouterConnection
from agent.settings import AgentSettings
from protocol.p2p import peer_id_of
from router.cli import build_parser
from router.fleet.shared_port import bind_shared
from router.fleet.workers import ROLL_SETTLE, Supervisor, worker_argv
from tests.fleet import Fleet, Proc, Router, wait_until

PEER_A = str(peer_id_of(create_new_key_pair()))
PEER_B = str(peer_id_of(create_new_key_pair()))


def metric(router: Router, worker: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{router.metrics_port + worker}/metrics", timeout=5).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def ask(router: Router, text: str) -> httpx.Response:
    return httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": text}]},
        timeout=30,
    )


def test_two_workers_share_the_http_port_and_agents_learn_the_second_from_the_first(
    fleet: Fleet,
) -> None:
    router = fleet.router("--workers", "2")
    wait_until(lambda: router.log().count("router_ready") == 2, 20, "both workers ready")
    agent = fleet.agent(router, "m1", wait=False)
    agent.wait_log(r"router_worker_added router=/ip4/127\.0\.0\.1/tcp/\d+/p2p/\S+ via=")
    wait_until(lambda: agent.log().count("router_joined") == 2, 45, "a session per worker")
    for worker in (0, 1):
        wait_until(
            lambda w=worker: metric(router, w, "hivenet_router_agents_healthy") == 1,
            20,
            f"worker {worker} has the agent",
        )

    # New connections are spread by the kernel: each worker serves some of them.
    for i in range(24):
        r = ask(router, f"request {i}")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == f"Echo: request {i}"
    served = [metric(router, w, "hivenet_router_routing_requests_routed_total") for w in (0, 1)]
    assert sum(served) == 24 and min(served) >= 1, served

    # A worker that dies is started again, and the agent rejoins it.
    pid = int(re.findall(r"worker_started index=1 pid=(\d+)", router.log())[-1])
    os.kill(pid, signal.SIGKILL)
    router.wait_log(r"worker_exited index=1 code=-9")
    router.wait_log(r"worker_started index=1 pid=\d+ starts=2")
    wait_until(
        lambda: metric(router, 1, "hivenet_router_agents_healthy") == 1, 30, "agent rejoined"
    )

    # SIGTERM stops every worker; each drains as a single router does.
    assert router.stop(signal.SIGTERM, timeout=30) == 0
    log = router.log()
    assert log.count("router_stopped") == 2
    assert "worker_stopped index=0 code=0" in log and "worker_stopped index=1 code=0" in log


def test_workers_out_of_range_exit_with_the_reason(fleet: Fleet) -> None:
    router = fleet.router("--workers", "0", start=False)
    Proc.start(router)  # it never gets to router_ready
    assert router.popen is not None and router.popen.wait(20) == 2
    assert "--workers must be 1 to 64, got 0" in router.log()


def test_a_port_in_use_stops_the_supervisor_before_any_worker_starts(fleet: Fleet) -> None:
    router = fleet.router("--workers", "2", start=False)
    with socket.socket() as taken:  # not SO_REUSEPORT: the workers' sockets cannot join it
        taken.bind(("127.0.0.1", router.http_port))
        taken.listen()
        Proc.start(router)
        assert router.popen is not None and router.popen.wait(20) == 1
    assert f"cannot listen on 127.0.0.1:{router.http_port}: " in router.log()
    assert "worker_started" not in router.log()


class _Nursery:
    def __init__(self) -> None:
        self.started: list[object] = []

    def start_soon(self, fn: object, *args: object) -> None:
        self.started.append(fn)


def test_a_hostile_workers_list_adds_only_well_formed_new_routers(tmp_path: Path) -> None:
    first = "/ip4/10.0.0.5/tcp/9000/p2p/" + PEER_A
    daemon = AgentDaemon(AgentSettings([first], identity_path=str(tmp_path / "a.key")))
    daemon.connections.append(RouterConnection(None, first, lambda stream: None))
    nursery = _Nursery()
    daemon._dial = (None, nursery, lambda address: lambda stream: None)
    hostile: list = [
        "not a map",
        {"tcp_port": "9001", "peer_id": PEER_B},
        {"tcp_port": 0, "peer_id": PEER_B},
        {"tcp_port": 70000, "peer_id": PEER_B},
        {"tcp_port": True, "peer_id": PEER_B},
        {"tcp_port": 9001, "peer_id": "not-a-peer-id"},
        {"tcp_port": 9002, "peer_id": PEER_A},  # the router we have, on another port
        {"tcp_port": 9001, "peer_id": PEER_B},
        {"tcp_port": 9001, "peer_id": PEER_B},  # named twice
    ]
    daemon._dial_workers(first, hostile)
    assert [c.address for c in daemon.connections] == [
        first,
        "/ip4/10.0.0.5/tcp/9001/p2p/" + PEER_B,
    ]
    assert len(nursery.started) == 1
    # Welcomes naming ever more workers add MAX_WORKERS in all, at most.
    flood = [
        {"tcp_port": 10000 + i, "peer_id": str(peer_id_of(create_new_key_pair()))}
        for i in range(MAX_WORKERS + 10)
    ]
    daemon._dial_workers(first, flood[:40])
    daemon._dial_workers(first, flood[40:])
    assert len(daemon.connections) == 1 + MAX_WORKERS


def test_a_worker_is_one_router_even_with_hivenet_router_workers_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The workers inherit the supervisor's environment: read as a count of workers
    # there, the variable would make every worker a supervisor of its own.
    monkeypatch.setenv("HIVENET_ROUTER_WORKERS", "3")
    supervisor = build_parser().parse_args(["serve", "--http-port", ":0"])
    assert supervisor.workers == 3
    for index in range(3):
        argv = worker_argv(["--http-port", ":0", "--workers=3"], index, 3)
        args = build_parser().parse_args(["serve", *argv])
        assert (args.workers, args.worker_index, args.worker_count) == (1, index, 3)


def test_a_worker_refusing_its_configuration_stops_the_host_with_status_2(
    fleet: Fleet, tmp_path: Path
) -> None:
    # The flags pass the supervisor's check; the policy is read by each worker. Started
    # again, the worker would read the same file: the host stops as one router would.
    policy = tmp_path / "policy.yaml"
    policy.write_text("routing_policy:\n  strategy: no-such-strategy\n")
    router = fleet.router("--workers", "2", "--policy-file", str(policy), start=False)
    Proc.start(router)
    assert router.popen is not None and router.popen.wait(30) == 2
    log = router.log()
    assert "worker_config_error index=" in log
    assert "workers_stopped count=2 code=2" in log
    assert "worker_exited" not in log


class _SlowToStart:
    """A worker process that runs until it gets SIGTERM, or is killed an hour later
    (in virtual time: systemd's TimeoutStopSec, say)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.signals: list[int] = []
        self._stopped = trio.Event()

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)
        if signum == signal.SIGTERM:
            self._stopped.set()

    async def wait(self) -> int:
        with trio.move_on_after(3600):
            await self._stopped.wait()
            return 0
        return -signal.SIGKILL


def test_a_stop_while_a_worker_is_being_started_reaches_that_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listeners = bind_shared(("127.0.0.1", 0), 2)
    supervisor = Supervisor(["--http-port", ":0"], listeners)
    started: list[_SlowToStart] = []
    passed: list[tuple[int, ...]] = []

    async def open_process(argv: list[str], **kwargs: Any) -> _SlowToStart:
        if not started:
            # SIGTERM arrives while the first worker's process is being made (in a
            # thread, in trio): no worker has a process to pass it to yet.
            supervisor._on_signal(signal.SIGTERM)
        # The socket the worker inherits is still open while it is being made.
        passed.append(tuple(stat.S_ISSOCK(os.fstat(fd).st_mode) for fd in kwargs["pass_fds"]))
        started.append(_SlowToStart(1000 + len(started)))
        return started[-1]

    monkeypatch.setattr(trio.lowlevel, "open_process", open_process)

    assert trio.run(supervisor.run, clock=trio.testing.MockClock(autojump_threshold=0)) == 0
    # The one being made gets the stop; the other, not started yet, is not started.
    assert [p.signals for p in started] == [[signal.SIGTERM]]
    assert passed == [(True, True)]
    assert all(sock.fileno() == -1 for sock in listeners)  # the supervisor let go of them


class _Ready:
    """A worker process that says it is ready at once (`R` on its line, a copy of which
    it keeps), and runs until `exit_at` (virtual time) or SIGTERM."""

    def __init__(self, pid: int, line_fd: int, exit_at: float = math.inf) -> None:
        self.pid = pid
        self.line = socket.socket(fileno=os.dup(line_fd))
        self.line.send(b"R")
        self.exit_at = exit_at
        self._stopped = trio.Event()

    def send_signal(self, signum: int) -> None:
        if signum == signal.SIGTERM:
            self._stopped.set()

    async def wait(self) -> int:
        with trio.move_on_after(self.exit_at - trio.current_time()):
            await self._stopped.wait()
        return 0

    def heard(self) -> bytes:
        self.line.setblocking(False)
        try:
            return self.line.recv(64)
        except BlockingIOError:
            return b""


def test_a_worker_that_exits_while_its_roll_settles_is_replaced_not_told_to_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker being rolled dies in the quarter second between the steering and its
    drain: it counts as rolled, and its successor, whose line it was then, is not told
    to drain."""
    supervisor = Supervisor(["--http-port", ":0"], bind_shared(("127.0.0.1", 0), 1))
    started: list[_Ready] = []

    async def open_process(argv: list[str], **kwargs: Any) -> _Ready:
        line = next(
            fd for fd in kwargs["pass_fds"] if str(fd) == argv[argv.index("--supervisor-fd") + 1]
        )
        # The first dies during the roll's settle (which begins at 10 s).
        exit_at = 10 + ROLL_SETTLE / 2 if not started else math.inf
        started.append(_Ready(1000 + len(started), line, exit_at))
        return started[-1]

    monkeypatch.setattr(trio.lowlevel, "open_process", open_process)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.run)
            await trio.sleep(10)
            await supervisor.roll()
            supervisor._on_signal(signal.SIGTERM)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(started) == 2, started
    assert started[1].heard() == b"", "the successor was told to drain"
    assert supervisor.workers[0].starts == 2
    for process in started:
        process.line.close()


def _worker_pids(router: Router) -> dict[int, int]:
    """The pid of each worker's latest start, from the supervisor's log."""
    pids: dict[int, int] = {}
    for index, pid in re.findall(r"worker_started index=(\d+) pid=(\d+)", router.log()):
        pids[int(index)] = int(pid)
    return pids


def _running(pid: int) -> bool:
    """Alive and not a zombie (a worker whose parent died is reaped by init, or not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_sigkilled_supervisor_leaves_no_worker_running(fleet: Fleet) -> None:
    router = fleet.router("--workers", "2")
    wait_until(lambda: router.log().count("router_ready") == 2, 20, "both workers ready")
    pids = _worker_pids(router)
    assert len(pids) == 2 and all(_running(p) for p in pids.values())
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200
    try:
        router.stop(signal.SIGKILL)
        # Each worker reads its end of file from the supervisor's socket and stops.
        wait_until(lambda: not any(_running(p) for p in pids.values()), 5, "no worker left running")
        with pytest.raises(httpx.ConnectError):
            httpx.get(router.url + "/health", timeout=5)
        assert router.log().count("worker_orphaned") == 2
    finally:
        for pid in pids.values():  # whatever outlived the test (the failing case)
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigusr2_restarts_the_workers_one_at_a_time_and_loses_no_request(fleet: Fleet) -> None:
    router = fleet.router("--workers", "2", "--drain-timeout", "20s")
    wait_until(lambda: router.log().count("router_ready") == 2, 20, "both workers ready")
    fleet.agent(router, "m1", "--capacity", "32", "--sim-token-latency", "30ms", wait=False)
    for worker in (0, 1):
        wait_until(
            lambda w=worker: metric(router, w, "hivenet_router_agents_healthy") == 1,
            45,
            f"worker {worker} has the agent",
        )
    before = _worker_pids(router)
    results: list[tuple[int, str]] = []
    health: list[int] = []
    retried: Counter[str] = Counter()
    stop = trio.Event()

    async def client(c: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            words = " ".join(f"c{c}.{n}.{k}" for k in range(5 + n % 20))
            body = {"model": "m1", "messages": [{"role": "user", "content": words}]}
            # A new connection per request, as a balancer's new client. One refused is
            # tried again, as HAProxy's `retry-on conn-failure` and the SDKs do: nothing
            # of it was sent. One closed without an answer is a failure (a worker that
            # stopped before serving what it had accepted).
            r: httpx.Response | None = None
            error = "refused five times"
            for _ in range(5):
                try:
                    async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
                        r = await http.post("/v1/chat/completions", json=body)
                    break
                except httpx.ConnectError as exc:
                    retried[type(exc).__name__] += 1
                    await trio.sleep(0.05)
                except httpx.HTTPError as exc:
                    error = repr(exc)
                    break
            if r is None:
                results.append((0, error))
                continue
            ok = r.status_code == 200 and (
                r.json()["choices"][0]["message"]["content"] == f"Echo: {words}"
            )
            results.append((r.status_code, "ok" if ok else r.text))

    async def check_health() -> None:
        while not stop.is_set():
            async with httpx.AsyncClient(base_url=router.url, timeout=10) as http:
                try:
                    health.append((await http.get("/health")).status_code)
                except (httpx.ConnectError, httpx.RemoteProtocolError):
                    health.append(0)
            await trio.sleep(0.1)

    async def main() -> None:
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                for c in range(6):
                    nursery.start_soon(client, c)
                nursery.start_soon(check_health)
                await trio.to_thread.run_sync(
                    lambda: wait_until(lambda: len(results) >= 20, 30, "load")
                )
                router.send_signal(signal.SIGUSR2)
                await trio.to_thread.run_sync(lambda: router.wait_log("workers_rolled", 60))
                for worker in (0, 1):  # the agent joins the new workers
                    await trio.to_thread.run_sync(
                        lambda w=worker: wait_until(
                            lambda: metric(router, w, "hivenet_router_agents_healthy") == 1,
                            45,
                            f"worker {w} has the agent again",
                        )
                    )
                await trio.sleep(1)
                stop.set()

    trio.run(main)
    after = _worker_pids(router)
    assert set(after) == {0, 1} and all(after[i] != before[i] for i in (0, 1)), (before, after)
    assert not any(_running(p) for p in before.values())
    log = router.log()
    assert log.count("worker_rolled index=") == 2 and "worker_exited" not in log
    assert "workers_steering_failed" not in log
    # One at a time: worker 1 was told to drain only after worker 0's successor was ready.
    assert log.index("worker_rolled index=0") < log.index("worker_rolled index=1")
    failures = [r for r in results if r != (200, "ok")]
    assert not failures, failures[:5]
    assert len(results) > 40, len(results)
    # The host stayed in its balancer's pool: /health never failed during the roll.
    assert health and 503 not in health, health
    print(f"workers roll: {len(results)} requests, tried again: {dict(retried)}")


async def test_a_worker_that_dies_loses_only_its_own_requests(fleet: Fleet) -> None:
    router = fleet.router("--workers", "2")
    wait_until(lambda: router.log().count("router_ready") == 2, 20, "both workers ready")
    fleet.agent(router, "m1", "--capacity", "64", "--sim-token-latency", "100ms", wait=False)
    for worker in (0, 1):
        await trio.to_thread.run_sync(
            lambda w=worker: wait_until(
                lambda: metric(router, w, "hivenet_router_agents_healthy") == 1,
                45,
                f"worker {w} has the agent",
            )
        )
    routed = "hivenet_router_routing_requests_routed_total"
    before = [metric(router, w, routed) for w in (0, 1)]
    streams = 24
    words = " ".join(f"w{k}" for k in range(40))  # 4 s of tokens
    started = trio.Semaphore(0)
    outcomes: list[str] = []

    async def one() -> None:
        # Each on its own connection, which the kernel gives to one worker or the other.
        body = {"model": "m1", "stream": True, "messages": [{"role": "user", "content": words}]}
        text, told = "", False
        try:
            async with (
                httpx.AsyncClient(base_url=router.url, timeout=30) as http,
                http.stream("POST", "/v1/chat/completions", json=body) as r,
            ):
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        if not told:
                            told = True
                            started.release()
            outcomes.append("ok" if text == f"Echo: {words}" else f"cut: {text[-20:]!r}")
        except httpx.HTTPError as exc:
            outcomes.append(f"broken: {type(exc).__name__}")
            if not told:
                started.release()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(one)
            for _ in range(streams):
                await started.acquire()
            on = [metric(router, w, routed) - before[w] for w in (0, 1)]
            os.kill(_worker_pids(router)[1], signal.SIGKILL)
    assert sum(on) == streams and min(on) >= 1, on  # the kernel spread them
    lost = [o for o in outcomes if o != "ok"]
    # Worker 0's streams all finished; worker 1's, and only those, were lost.
    assert len(lost) == on[1], (on, outcomes)
    router.wait_log(r"worker_started index=1 pid=\d+ starts=2")
