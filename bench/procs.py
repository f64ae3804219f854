"""Start benchmark processes (simulated engine, router, agents) on loopback ports."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
SECRET = "bench-secret-0123456789-abcdefghijklmnopq"
ADMIN_KEY = "bench-admin"


def python_of(root: Path) -> str:
    """The interpreter for a checkout: its own `.venv` when it has one, else this one
    (with the checkout first on PYTHONPATH, its modules win over this one's install)."""
    venv = root / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hivenet-bench-"))
        self.env = {
            **os.environ,
            "HIVENET_ROUTER_JWT_SECRET": SECRET,
            "HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY,
            "HIVENET_LOG_LEVEL": "warn",
        }
        self.started: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, argv: list[str], cwd: Path | None = None) -> subprocess.Popen[bytes]:
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(argv, env=self.env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        self.started.append(proc)
        return proc

    def sim(self, model: str, port: int, *extra: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "sim", "--model", model, "--port", str(port)]
        proc = self.spawn(f"sim-{port}", [*argv, "--capacity", "1024", *extra])
        wait_http(f"http://127.0.0.1:{port}/health")
        return proc

    def router(
        self, http: int, metrics: int, p2p: int, *extra: str, root: Path | None = None
    ) -> tuple[subprocess.Popen[bytes], str]:
        """A router, from checkout `root` (run as a module there) or this install."""
        command = (
            [str(BIN / "hivenet-router")] if root is None else [python_of(root), "-m", "router.cli"]
        )
        key = self.dir / f"router-{p2p}.key"
        out = subprocess.run(
            [*command, "identity", "--identity-path", str(key), "--p2p-port", str(p2p)],
            cwd=root,
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        addr = out.stdout.strip().splitlines()[-1]
        proc = self.spawn(
            f"router-{p2p}",
            [
                *command,
                "serve",
                "--http-port",
                f"127.0.0.1:{http}",
                "--metrics-port",
                f"127.0.0.1:{metrics}",
                "--p2p-port",
                str(p2p),
                "--identity-path",
                str(key),
                *extra,
            ],
            cwd=root,
        )
        wait_http(f"http://127.0.0.1:{http}/health")
        return proc, addr

    def agent(
        self, router_addr: str, model: str, backend: str, *extra: str
    ) -> subprocess.Popen[bytes]:
        name = f"agent-{len(self.started)}"
        return self.spawn(
            name,
            [
                str(BIN / "hivenet-agent"),
                "--router",
                router_addr,
                "--model",
                model,
                "--engine",
                "vllm",
                "--backend-url",
                backend,
                "--capacity",
                "1024",
                "--identity-path",
                str(self.dir / f"{name}.key"),
                *extra,
            ],
        )

    def close(self) -> None:
        for proc in reversed(self.started):
            proc.terminate()
        for proc in self.started:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def wait_models(url: str, model: str, agents: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            card = httpx.get(f"{url}/v1/models/{model}", timeout=2).json()
            if card.get("agents", {}).get("healthy") == agents:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{agents} agents for {model} did not join")
