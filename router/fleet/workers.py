"""`hivenet-router serve --workers N`: N router processes on one host.

One trio process uses one core, so a many-core host runs one router per core. Each
worker is a whole router: its own libp2p port (`--p2p-port` + i, WebSocket ports too)
and identity (`<identity-path>.worker<i>` for i > 0), its own metrics port
(`--metrics-port` + i). They share the HTTP port: the supervisor binds one SO_REUSEPORT
socket per worker and holds it, and steers new connections to the workers that serve
(router/fleet/shared_port.py), so a worker being replaced resets no connection. Agents
need only the first worker's address: its welcome names the others (`workers`), and
the agent dials them too.

What is per worker: the peer table's statistics, the capacity queue and the metrics,
as with any routers; with `--state-url` tenant counts and the configuration are
shared (router/fleet/config_sync.py) and an agent's capacity holds across all of them
(agent/capacity.py). The supervisor restarts a worker that dies (after RESTART_DELAY,
so a worker that cannot start does not spin) and passes SIGTERM/SIGINT (each worker
drains as a single router does) and SIGHUP on to every worker; SIGUSR2 restarts the
workers one at a time (`roll`). Each worker holds one end of a socket pair with the
supervisor: when the supervisor dies, SIGKILLed even, the worker reads its end of file
and stops, so no worker is left holding the HTTP port. A worker whose first
start ends with CONFIG_ERROR stops the host with that status, as a single router's
configuration error does: a restart reads the same files, and the unit's
RestartPreventExitStatus=2 can act only on the supervisor's status.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

import trio

from protocol.logs import quote
from protocol.p2p import load_or_create_identity, peer_id_of
from router.fleet.shared_port import steer
from router.settings import CONFIG_ERROR

log = logging.getLogger("router")

RESTART_DELAY = 1.0
# A welcome names at most this many workers; agents ignore the rest.
MAX_WORKERS = 64


def worker_identity_path(path: str, index: int) -> str:
    return path if index == 0 else f"{path}.worker{index}"


def worker_peers(identity_path: str, p2p_port: int, count: int) -> list[dict]:
    """The welcome's `workers`: workers 1..count-1, creating their identities."""
    peers = []
    for index in range(1, count):
        key = load_or_create_identity(worker_identity_path(identity_path, index))
        peers.append({"tcp_port": p2p_port + index, "peer_id": str(peer_id_of(key))})
    return peers


def worker_argv(argv: list[str], index: int, count: int) -> list[str]:
    """The `serve` arguments of worker `index`: the supervisor's without `--workers`,
    plus `--worker-index`/`--worker-count` (not for operators), from which the worker
    takes its own ports and identity (router/cli.py). `--workers 1` is said outright:
    a worker inherits the supervisor's environment, and a HIVENET_ROUTER_WORKERS there
    would make each worker a supervisor of its own, without end."""
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        name, eq, _ = arg.partition("=")
        if name == "--workers":
            if not eq:
                next(args, None)
            continue
        out.append(arg)
    return [*out, "--workers", "1", "--worker-index", str(index), "--worker-count", str(count)]


# A rolling restart steers new connections off a worker this long before it tells the
# worker to close: a handshake the kernel began on its socket completes in a round trip,
# and the worker accepts what is queued before it closes (what comes later still waits
# for its successor, on the socket the supervisor holds).
ROLL_SETTLE = 0.25
# A rolling restart waits this long for each new worker to say it is ready before it
# gives up on the rest (a worker that cannot start is restarted, as ever).
READY_TIMEOUT = 60.0


@dataclass
class Worker:
    index: int
    argv: list[str]
    # Its share of the HTTP port, held by the supervisor across the worker's restarts;
    # closed when the host stops.
    listener: socket.socket | None = None
    process: Any = None
    # open_process runs in a thread: the listener must stay open until it returns.
    starting: bool = False
    starts: int = 0
    # The supervisor's end of the socket pair shared with the running process.
    line: Any = None
    # Set when the next (or running) process says it is ready; a new one after each exit.
    ready: trio.Event = field(default_factory=trio.Event)
    # Set when the running process has exited.
    exited: trio.Event = field(default_factory=trio.Event)
    rolling: bool = False


class Supervisor:
    def __init__(self, argv: list[str], listeners: list[socket.socket]) -> None:
        """`listeners`: one per worker, from shared_port.bind_shared, in bind order."""
        count = len(listeners)
        self.workers = [
            Worker(i, worker_argv(argv, i, count), listener) for i, listener in enumerate(listeners)
        ]
        self.stopping = False
        self.rolling = False
        self.exit_code = 0
        # The workers whose sockets get new connections: those that said they are
        # ready and were not told to drain since.
        self.serving: set[int] = set()
        self.steering_failed = False

    def __repr__(self) -> str:
        alive = sum(1 for w in self.workers if w.process is not None)
        return f"<Supervisor {alive}/{len(self.workers)} workers, stopping={self.stopping}>"

    async def run(self) -> int:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._signals)
                async with trio.open_nursery() as keepers:
                    for worker in self.workers:
                        keepers.start_soon(self._keep, worker)
                nursery.cancel_scope.cancel()
        finally:
            for worker in self.workers:
                self._release(worker)
        log.info("workers_stopped count=%d code=%d", len(self.workers), self.exit_code)
        return self.exit_code

    async def _keep(self, worker: Worker) -> None:
        while True:
            # The worker's line to this process: it says when it is ready, hears when to
            # drain, and its end of file tells the worker that this supervisor is gone
            # (SIGKILL included), so no worker outlives it (router/app.py `_supervised`).
            if worker.listener is None:  # the host stopped
                return
            mine, theirs = socket.socketpair()
            argv = [sys.executable, "-m", "router.cli", "serve", *worker.argv]
            argv += ["--supervisor-fd", str(theirs.fileno())]
            argv += ["--listen-fd", str(worker.listener.fileno())]
            if worker.starts:
                # Its siblings serve the shared port meanwhile: it takes clients once
                # its agents are back (router/app.py `_wait_for_agents`).
                argv.append("--worker-wait-agents")
            # The workers inherit stdout/stderr: one log stream, each line naming its
            # router by peer_id as a single router's do.
            worker.starting = True
            try:
                worker.process = await trio.lowlevel.open_process(
                    argv, pass_fds=(theirs.fileno(), worker.listener.fileno())
                )
            except BaseException:
                mine.close()
                raise
            finally:
                worker.starting = False
                theirs.close()
            worker.line = trio.socket.from_stdlib_socket(mine)
            exited = worker.exited = trio.Event()
            worker.starts += 1
            log.info(
                "worker_started index=%d pid=%d starts=%d",
                worker.index,
                worker.process.pid,
                worker.starts,
            )
            if self.stopping:
                # The stop came while this worker was being started (open_process
                # runs in a thread), so it was not passed on: the worker would run on.
                worker.process.send_signal(signal.SIGTERM)
                self._release(worker)
            with trio.CancelScope(shield=True):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._hear, worker)
                    code = await worker.process.wait()
                    nursery.cancel_scope.cancel()
            worker.line.close()
            worker.process = worker.line = None
            worker.ready = trio.Event()
            self._serve(worker, False)
            exited.set()
            if worker.rolling and not self.stopping:
                worker.rolling = False
                log.info("worker_rolled index=%d code=%d", worker.index, code)
                continue  # the new code starts at once: the other workers serve meanwhile
            if self.stopping:
                log.info("worker_stopped index=%d code=%d", worker.index, code)
                return
            if code == CONFIG_ERROR and worker.starts == 1:
                log.error(
                    "worker_config_error index=%d code=%d reason=%s",
                    worker.index,
                    code,
                    quote("the worker refused its configuration; stopping every worker"),
                )
                self.exit_code = CONFIG_ERROR
                self._on_signal(signal.SIGTERM)
                return
            log.warning(
                "worker_exited index=%d code=%d restart_in_s=%g", worker.index, code, RESTART_DELAY
            )
            await trio.sleep(RESTART_DELAY)
            if self.stopping:
                return

    async def _hear(self, worker: Worker) -> None:
        """The worker's `R` (ready); its end of file is its exit, which wait() sees."""
        ready = worker.ready
        try:
            while data := await worker.line.recv(64):
                if b"R" in data and not ready.is_set():
                    ready.set()
                    if not worker.rolling:
                        self._serve(worker, True)
        except OSError:
            pass

    async def _signals(self) -> None:
        """SIGTERM/SIGINT/SIGHUP passed on to every worker; the first SIGTERM/SIGINT also
        stops restarts, and a second one reaches the workers too (each then stops at
        once, as a router does). SIGUSR2: a rolling restart, one worker at a time."""
        sigs = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(*sigs) as signals:
                async for signum in signals:
                    if signum == signal.SIGUSR2:
                        if not self.rolling and not self.stopping:
                            nursery.start_soon(self.roll)
                    else:
                        self._on_signal(signum)

    async def roll(self) -> None:
        """Restart every worker, one at a time, on the code now installed: new
        connections are steered off the worker, which then accepts what was queued for
        it, closes its listener (its siblings go on serving the shared port, so /health
        stays 200 and the host stays in its balancer's pool), drains what it holds as a
        stopped router does, and exits; its successor starts on the same socket, and the
        next worker goes only once that one is ready."""
        self.rolling = True
        log.info("workers_rolling count=%d", len(self.workers))
        try:
            for worker in self.workers:
                if self.stopping:
                    return
                if worker.process is None or worker.line is None:
                    continue
                exited = worker.exited
                worker.rolling = True
                self._serve(worker, False)
                await trio.sleep(ROLL_SETTLE)
                # One that exited meanwhile counts as rolled (`_keep`), and its line may
                # be its successor's by now: the successor is waited for as below.
                if not exited.is_set():
                    try:
                        await worker.line.send(b"D")
                    except OSError:
                        worker.rolling = False
                        continue
                # The old one drains (its --drain-timeout bounds that), then its
                # successor gets READY_TIMEOUT to say it is ready.
                await exited.wait()
                ready = worker.ready
                with trio.move_on_after(READY_TIMEOUT):
                    await ready.wait()
                if self.stopping:
                    return
                if not ready.is_set():
                    log.warning(
                        "workers_roll_stopped index=%d reason=%s",
                        worker.index,
                        quote("the new worker did not get ready"),
                    )
                    return
            log.info("workers_rolled count=%d", len(self.workers))
        finally:
            self.rolling = False

    def _serve(self, worker: Worker, serving: bool) -> None:
        """Steer new connections to `worker`'s socket, or off it."""
        if serving == (worker.index in self.serving) or self.stopping:
            return
        (self.serving.add if serving else self.serving.discard)(worker.index)
        listener = next((w.listener for w in self.workers if w.listener is not None), None)
        if listener is None or self.steering_failed:
            return
        try:
            steer(listener, sorted(self.serving))
        except OSError as exc:
            # The kernel's hash spreads connections over every worker's socket then: a
            # worker being replaced still gets its share, which waits for its successor.
            self.steering_failed = True
            log.warning("workers_steering_failed error=%s", quote(str(exc)))

    def _release(self, worker: Worker) -> None:
        """Close the supervisor's copy of the worker's socket: the running worker's is
        then the last, and its close refuses new connections, as a single router's."""
        if worker.listener is not None and not worker.starting:
            worker.listener.close()
            worker.listener = None

    def _on_signal(self, signum: int) -> None:
        if signum != signal.SIGHUP:
            self.stopping = True
        for worker in self.workers:
            if worker.process is not None:
                worker.process.send_signal(signum)
            if self.stopping:
                self._release(worker)
