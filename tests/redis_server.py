"""A real `redis-server` on a free loopback port, for the shared-quota tests."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import redis

from tests.fleet import Proc, free_port, wait_until


class RedisServer(Proc):
    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise AssertionError(
                "redis-server is not installed: run scripts/setup (it installs Debian's"
                " redis-server package)"
            )
        self.binary = binary
        self.root = directory
        super().__init__("redis", [], env, directory / "redis.log")
        self._pick_port()

    def _pick_port(self) -> None:
        self.port = free_port()
        self.dir = self.root / f"redis-{self.port}"
        self.dir.mkdir()
        self.log_path = self.root / f"redis-{self.port}.log"
        self.argv = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        # Not a PING first: one to a port another process holds waits on that process.
        self.start_on_free_ports(
            lambda: self.wait_log("Ready to accept connections", 10), self._pick_port
        )
        client = redis.Redis(port=self.port, socket_timeout=1)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        try:
            wait_until(answers, 10, "redis-server answering PING")
        finally:
            client.close()
        return self

    def kill(self) -> None:
        self.stop(signal.SIGKILL)
