"""A real `redis-server` on a free loopback port, for the shared-quota tests; a replica
of another one, and `redis-sentinel` watching them, for the failover tests."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import redis

from tests.fleet import Proc, free_port, wait_until


class RedisServer(Proc):
    def __init__(
        self, directory: Path, env: dict[str, str], replica_of: RedisServer | None = None
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise AssertionError(
                "redis-server is not installed: run scripts/setup (it installs Debian's"
                " redis-server package)"
            )
        self.binary = binary
        self.root = directory
        self.replica_of = replica_of
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
        if self.replica_of is not None:
            self.argv += ["--replicaof", "127.0.0.1", str(self.replica_of.port)]

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

    def info(self, section: str) -> dict[str, str]:
        client = redis.Redis(port=self.port, socket_timeout=1, decode_responses=True)
        try:
            return {k: str(v) for k, v in client.info(section).items()}
        finally:
            client.close()


class SentinelServer(Proc):
    """A real `redis-sentinel` watching `primary` as MASTER (a quorum of `quorum`), which
    it declares down after 1 s without an answer (Debian's default is 30 s)."""

    MASTER = "hivenet"

    def __init__(
        self, directory: Path, env: dict[str, str], primary: RedisServer, quorum: int = 1
    ) -> None:
        binary = shutil.which("redis-sentinel")
        if binary is None:
            raise AssertionError(
                "redis-sentinel is not installed: run scripts/setup (it installs Debian's"
                " redis-sentinel package)"
            )
        self.binary = binary
        self.root = directory
        self.primary = primary
        self.quorum = quorum
        super().__init__("sentinel", [], env, directory / "sentinel.log")
        self._pick_port()

    def _pick_port(self) -> None:
        self.port = free_port()
        self.log_path = self.root / f"sentinel-{self.port}.log"
        # Sentinel rewrites its file (what it learns of replicas and other sentinels).
        conf = self.root / f"sentinel-{self.port}.conf"
        conf.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {self.root}\n"
            f"sentinel monitor {self.MASTER} 127.0.0.1 {self.primary.port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {self.MASTER} 1000\n"
            f"sentinel failover-timeout {self.MASTER} 5000\n"
        )
        self.argv = [self.binary, str(conf)]

    def start(self) -> SentinelServer:
        self.start_on_free_ports(lambda: self.wait_log(r"\+monitor master", 10), self._pick_port)
        return self

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def ask(self, *command: str) -> object:
        client = redis.Redis(port=self.port, socket_timeout=1, decode_responses=True)
        try:
            return client.execute_command("SENTINEL", *command)
        finally:
            client.close()

    def primary_port(self) -> int:
        _host, port = self.ask("get-master-addr-by-name", self.MASTER)  # type: ignore[misc]
        return int(port)


def sentinel_url(sentinels: list[SentinelServer]) -> str:
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinels)
    return f"redis+sentinel://{hosts}/{SentinelServer.MASTER}"
