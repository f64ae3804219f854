"""`hivenet-router serve --workers N`: N router processes on one host.

One trio process uses one core, so a many-core host runs one router per core. Each
worker is a whole router: its own libp2p port (`--p2p-port` + i, WebSocket ports too)
and identity (`<identity-path>.worker<i>` for i > 0), its own metrics port
(`--metrics-port` + i). They share the HTTP port through SO_REUSEPORT, where the
kernel spreads new connections over them. Agents need only the first worker's
address: its welcome names the others (`workers`), and the agent dials them too.

What is per worker: the peer table's statistics, the capacity queue and the metrics,
as with any routers; with `--state-url` tenant counts and the configuration are
shared (router/fleet/config_sync.py) and an agent's capacity holds across all of them
(agent/capacity.py). The supervisor restarts a worker that dies (after RESTART_DELAY,
so a worker that cannot start does not spin) and passes SIGTERM/SIGINT (each worker
drains as a single router does) and SIGHUP on to every worker. A worker whose first
start ends with CONFIG_ERROR stops the host with that status, as a single router's
configuration error does: a restart reads the same files, and the unit's
RestartPreventExitStatus=2 can act only on the supervisor's status.
"""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any

import trio

from protocol.logs import quote
from protocol.p2p import load_or_create_identity, peer_id_of
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


@dataclass
class Worker:
    index: int
    argv: list[str]
    process: Any = None
    starts: int = 0


class Supervisor:
    def __init__(self, argv: list[str], count: int) -> None:
        self.workers = [Worker(i, worker_argv(argv, i, count)) for i in range(count)]
        self.stopping = False
        self.exit_code = 0

    def __repr__(self) -> str:
        alive = sum(1 for w in self.workers if w.process is not None)
        return f"<Supervisor {alive}/{len(self.workers)} workers, stopping={self.stopping}>"

    async def run(self) -> int:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._signals)
            async with trio.open_nursery() as keepers:
                for worker in self.workers:
                    keepers.start_soon(self._keep, worker)
            nursery.cancel_scope.cancel()
        log.info("workers_stopped count=%d code=%d", len(self.workers), self.exit_code)
        return self.exit_code

    async def _keep(self, worker: Worker) -> None:
        while True:
            argv = [sys.executable, "-m", "router.cli", "serve", *worker.argv]
            # The workers inherit stdout/stderr: one log stream, each line naming its
            # router by peer_id as a single router's do.
            worker.process = await trio.lowlevel.open_process(argv)
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
            with trio.CancelScope(shield=True):
                code = await worker.process.wait()
            worker.process = None
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

    async def _signals(self) -> None:
        """Passed on to every worker; the first SIGTERM/SIGINT also stops restarts, and
        a second one reaches the workers too (each then stops at once, as a router does)."""
        with trio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        if signum != signal.SIGHUP:
            self.stopping = True
        for worker in self.workers:
            if worker.process is not None:
                worker.process.send_signal(signum)
