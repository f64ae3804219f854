"""What the real-client tests share: the clients `scripts/setup` installs, one fleet per
test module, and a stand-in for the internet that records what a client tries to reach.

The fleet is the one an operator runs for coding agents: a router that requires client
keys, and an agent with `--engine vllm` in front of the simulated engine run on its own
(`python -m sim`, a vLLM look-alike) with a 128k context: coding agents send a few
thousand words of system prompt and ask for long answers, which the agent's built-in
sim (4,096) would refuse as a real 4k model would. The simulated engine answers
`sim:call NAME {args}` in a prompt with a call to that tool (sim/tools.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from tests.fleet import VENV_BIN, Agent, Fleet, Proc, Router, free_port, wait_until

CLIENTS = Path(__file__).parent / "clients"
NODE_MODULES = CLIENTS / "node_modules"
MODEL = "code-model"
CLIENT_KEY = "client-test-key"
TENANT = "client-tests"
# A coding agent's context: its system prompt, tools and answer fit with room to spare.
CONTEXT = 131_072


def installed_stamp() -> Path:
    """The file `scripts/setup` writes once npm installed this package-lock."""
    import hashlib

    digest = hashlib.sha1((CLIENTS / "package-lock.json").read_bytes()).hexdigest()[:12]
    return NODE_MODULES / f".installed-{digest}"


def require_node_clients(*programs: str) -> None:
    """Skip (fail under CI) when the npm clients are not installed as the lock says."""
    missing = []
    if not installed_stamp().exists():
        missing.append("tests/clients/node_modules (as tests/clients/package-lock.json pins)")
    for program in programs:
        if not (NODE_MODULES / ".bin" / program).exists():
            missing.append(f"tests/clients/node_modules/.bin/{program}")
    if shutil.which("node") is None:
        missing.append("node")
    if missing:
        why = f"{', '.join(missing)} missing: run scripts/setup"
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI must run the client tests, not pass over them)")
        pytest.skip(why)


def run_node(script: str, env: dict[str, str], timeout: float = 120) -> str:
    """Run `tests/clients/<script>` with node; its stdout, or a failure showing both."""
    done = subprocess.run(
        ["node", str(CLIENTS / script)],
        cwd=CLIENTS,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@dataclass
class ClientFleet:
    fleet: Fleet
    router: Router
    agent: Agent
    engine_url: str

    @property
    def url(self) -> str:
        """The router's base URL, without `/v1` (each client adds what it needs)."""
        return self.router.url

    def served(self, endpoint: str) -> float:
        """Requests of the client key's tenant the router answered 200 on `endpoint`."""
        return self.router.metric(
            "hivenet_router_http_requests_total", endpoint=endpoint, status="200", tenant=TENANT
        )

    def engine_requests(self) -> int:
        return httpx.get(self.engine_url + "/sim/state", timeout=5).json()["requests_total"]


@contextmanager
def client_fleet(directory: Path, token_latency: str = "0.002") -> Iterator[ClientFleet]:
    fleet = Fleet(directory)
    try:
        port = free_port()
        argv = [str(VENV_BIN / "python"), "-m", "sim", "--model", MODEL, "--port", str(port)]
        argv += ["--max-context", str(CONTEXT), "--token-latency", token_latency]
        engine = Proc("sim", argv, dict(os.environ), directory / "sim.log").start()
        fleet.procs.append(engine)
        engine_url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: httpx.get(engine_url + "/health", timeout=2).status_code == 200,
            20,
            "the simulated engine",
        )
        router = fleet.router(env={"HIVENET_ROUTER_API_KEYS": f"{CLIENT_KEY}:{TENANT}"})
        agent = fleet.agent(router, MODEL, "--backend-url", engine_url, engine="vllm")
        yield ClientFleet(fleet, router, agent, engine_url)
    finally:
        fleet.close()


class EgressRecorder:
    """An HTTP proxy that refuses everything and writes down what it was asked for.

    A client given it as `HTTPS_PROXY`/`HTTP_PROXY` (with the router's loopback address
    in `NO_PROXY`) sends every request that is not for the router here: the test then
    knows whether it tried to reach the internet, and the client fails fast instead of
    waiting on a network that is not there."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.log_path = directory / "egress.log"
        self.log_path.touch()
        argv = [sys.executable, "-m", "tests.egress_recorder", str(self.port), str(self.log_path)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
        self.proc = Proc("egress", argv, env, directory / "egress.out").start()
        wait_until(lambda: self.log_path.read_text().startswith("listening"), 10, "egress recorder")

    def env(self) -> dict[str, str]:
        proxy = f"http://127.0.0.1:{self.port}"
        return {
            "HTTPS_PROXY": proxy,
            "HTTP_PROXY": proxy,
            "https_proxy": proxy,
            "http_proxy": proxy,
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }

    def attempts(self) -> list[str]:
        """The request lines received (`CONNECT host:443 HTTP/1.1`), oldest first."""
        return self.log_path.read_text().splitlines()[1:]

    def close(self) -> None:
        self.proc.stop()


class ClientRun:
    """A client program's own home (no settings, login or history of the machine's user)
    and project folder, beside the fleet it talks to and the recorder of its other
    traffic. Subclasses run the program."""

    def __init__(self, fleet: ClientFleet, egress: EgressRecorder, directory: Path) -> None:
        self.fleet = fleet
        self.egress = egress
        self.home = directory / "home"
        self.home.mkdir()
        self.project = directory / "project"
        self.project.mkdir()


RunT = TypeVar("RunT", bound=ClientRun)


@contextmanager
def client_run(
    tmp_path_factory: pytest.TempPathFactory, program: str, kind: type[RunT]
) -> Iterator[RunT]:
    """A fleet, an egress recorder and a `kind` for the installed client `program`: the
    body of a module-scoped fixture."""
    require_node_clients(program)
    directory = Path(tmp_path_factory.mktemp(program))
    egress = EgressRecorder(directory)
    try:
        with client_fleet(directory) as fleet:
            yield kind(fleet, egress, directory)
    finally:
        egress.close()
