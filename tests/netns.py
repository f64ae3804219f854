"""Real network paths for end-to-end tests: network namespaces, veth links, NAT,
firewalls, a proxy, and a lossy, slow link, all made by the test and removed after it.

Every address lives inside namespaces a `Lab` created (10.77.0.0/16, private); the
host's own namespace gets no address, route or rule. The test process stays in the
host namespace and reaches a daemon's HTTP port through a relay: a small process inside
the daemon's namespace (or a client's) that listens on a Unix socket, which unlike a
TCP port is visible from every namespace.

`python -m tests.netns relay SOCKET HOST PORT` runs that relay; `python -m tests.netns
delay QUEUE SECONDS JITTER` holds each packet of an NFQUEUE for SECONDS ± JITTER:
this machine's kernel has no `sch_netem`, so `tc netem delay` is not available, and the
delay is made with an iptables NFQUEUE rule instead (loss and black holes are iptables
`statistic` and `DROP` rules, as exact as netem's).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol.p2p import load_or_create_identity, peer_id_of
from tests.fleet import ADMIN_KEY, SECRET, VENV_BIN, Proc, wait_until

PREFIX = "hvnt"
TOOLS = ("ip", "iptables", "conntrack")
HTTP_PORT = 8080
METRICS_PORT = 2112
P2P_PORT = 9000


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
    return result


def _missing_capability() -> str | None:
    """Why this machine cannot build the paths, or None when it can."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (scripts/setup installs iptables and conntrack)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = _sh("ip", "netns", "add", probe, check=False)
    _sh("ip", "netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    return None


def require_netns(*tools: str) -> None:
    """Fail under CI (a missing capability is a broken CI image), skip elsewhere."""
    reason = _missing_capability()
    absent = [t for t in tools if shutil.which(t) is None]
    if reason is None and absent:
        reason = f"missing {', '.join(absent)} (scripts/setup installs it)"
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"network path tests cannot run in CI: {reason}")
    pytest.skip(f"network path tests need root and netns tools: {reason}")


@functools.cache
def sweep_stale() -> int:
    """Delete namespaces an earlier test run left (its process is gone). Once per
    process; namespaces of live test processes (other xdist workers) are kept."""
    removed = 0
    for line in _sh("ip", "netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or Path(f"/proc/{pid}").exists():
            continue
        _kill_inside(name)
        _sh("ip", "netns", "del", name, check=False)
        removed += 1
    return removed


def _kill_inside(name: str) -> None:
    pids = _sh("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)


@dataclass
class Netns:
    name: str
    lab: Lab

    def sh(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _sh("ip", "netns", "exec", self.name, *argv, check=check)

    def iptables(self, *rule: str) -> None:
        self.sh("iptables", "-w", *rule)

    def sysctl(self, setting: str) -> None:
        self.sh("sysctl", "-q", "-w", setting)

    def reaches(self, host: str) -> bool:
        """Whether this namespace has a route to `host` at all."""
        return self.sh("ip", "route", "get", host, check=False).returncode == 0

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.lab.dir / f"{self.name}-{name}.log"
        proc = Proc(name, ["ip", "netns", "exec", self.name, *argv], env or self.lab.env, log)
        self.lab.procs.append(proc)
        return proc.start()

    def slow_and_lossy(self, ifname: str, delay: float, jitter: float, loss: float) -> None:
        """What `tc qdisc add dev IF root netem delay D J loss L` does to the packets
        this namespace sends out of `ifname`: each is lost with probability `loss`, the
        others held for `delay` ± `jitter` (uniform) by a queue process."""
        argv = [sys.executable, "-m", "tests.netns", "delay", "0", str(delay), str(jitter)]
        delayer = self.spawn("delay", argv)
        delayer.wait_log("delay_ready")
        assert delayer.alive(), delayer.log()
        self.iptables(
            "-A", "OUTPUT", "-o", ifname, "-m", "statistic", "--mode", "random",
            "--probability", str(loss), "-j", "DROP",
        )  # fmt: skip
        self.iptables("-A", "OUTPUT", "-o", ifname, "-j", "NFQUEUE", "--queue-num", "0")

    def black_hole(self, ifname: str, on: bool) -> None:
        """Drop every packet in and out of `ifname`, silently, or stop doing so."""
        action = "-I" if on else "-D"
        self.iptables(action, "OUTPUT", "-o", ifname, "-j", "DROP")
        self.iptables(action, "INPUT", "-i", ifname, "-j", "DROP")

    def relay(self, host: str, port: int) -> Path:
        """A Unix socket in the lab directory whose connections go to host:port as
        opened from inside this namespace."""
        path = self.lab.dir / f"{self.name}-{port}-{len(self.lab.procs)}.sock"
        argv = [sys.executable, "-m", "tests.netns", "relay", str(path), host, str(port)]
        proc = self.spawn(f"relay-{port}", argv)
        wait_until(lambda: path.exists() or not proc.alive(), 15, f"relay {path}")
        assert proc.alive(), proc.log()
        return path


@dataclass
class Lab:
    """Namespaces, links and processes of one test; `close` removes them all."""

    dir: Path
    env: dict[str, str]
    namespaces: list[Netns] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    links: int = 0

    def netns(self, role: str) -> Netns:
        ns = Netns(f"{PREFIX}-{os.getpid()}-{len(self.namespaces)}{role}", self)
        _sh("ip", "netns", "add", ns.name)
        self.namespaces.append(ns)
        ns.sh("ip", "link", "set", "lo", "up")
        return ns

    def link(self, a: Netns, a_addr: str, b: Netns, b_addr: str) -> tuple[str, str]:
        """A veth pair between two namespaces, `a_addr`/`b_addr` in CIDR form; the
        names are made in the namespaces themselves, never in the host's."""
        self.links += 1
        a_if, b_if = f"veth{self.links}a", f"veth{self.links}b"
        _sh(
            "ip", "link", "add", a_if, "netns", a.name, "type", "veth",
            "peer", b_if, "netns", b.name,
        )  # fmt: skip
        for ns, ifname, addr in ((a, a_if, a_addr), (b, b_if, b_addr)):
            ns.sh("ip", "addr", "add", addr, "dev", ifname)
            ns.sh("ip", "link", "set", ifname, "up")
        return a_if, b_if

    def close(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop(timeout=5)
        for ns in reversed(self.namespaces):
            _kill_inside(ns.name)
            _sh("ip", "netns", "del", ns.name, check=False)


@contextlib.contextmanager
def lab(directory: Path) -> Iterator[Lab]:
    sweep_stale()
    env = {
        **os.environ,
        "HIVENET_ROUTER_JWT_SECRET": SECRET,
        "HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY,
        "HIVENET_LOG_LEVEL": "info",
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env.pop(proxy, None)
    the_lab = Lab(directory, env)
    try:
        yield the_lab
    finally:
        the_lab.close()


class RouterIn:
    """A router daemon inside a namespace, reached by the test through relays."""

    def __init__(self, ns: Netns, listen: str, *flags: str, env: dict[str, str] | None = None):
        self.ns = ns
        self.listen = listen
        self.identity = ns.lab.dir / f"{ns.name}-router.key"
        self.peer_id = str(peer_id_of(load_or_create_identity(self.identity)))
        self.flags = list(flags)
        argv = [
            str(VENV_BIN / "hivenet-router"), "serve",
            "--http-port", f":{HTTP_PORT}",
            "--metrics-port", f"127.0.0.1:{METRICS_PORT}",
            "--p2p-port", str(P2P_PORT),
            "--p2p-listen-addr", listen,
            "--identity-path", str(self.identity),
            *flags,
        ]  # fmt: skip
        self.proc = ns.spawn("router", argv, {**ns.lab.env, **(env or {})})
        self.proc.wait_log("router_ready")
        self.http_socket = ns.relay("127.0.0.1", HTTP_PORT)
        self.http = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.http_socket)),
            base_url="http://router",
            timeout=60,
        )
        self.metrics_http = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(ns.relay("127.0.0.1", METRICS_PORT))),
            base_url="http://metrics",
            timeout=10,
        )

    def address(self, transport: str = "tcp", port: int = P2P_PORT) -> str:
        tail = {"tcp": "", "ws": "/ws", "wss": "/wss"}[transport]
        return f"/ip4/{self.listen}/tcp/{port}{tail}/p2p/{self.peer_id}"

    def agents(self) -> list[dict]:
        r = self.http.get("/admin/routing-table", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        r.raise_for_status()
        return r.json()["agents"]

    def agent(self, peer_id: str) -> dict | None:
        return next((a for a in self.agents() if a["peer_id"] == peer_id), None)

    def wait_agent(self, peer_id: str, timeout: float = 30.0, **status: Any) -> dict:
        want = {"healthy": True, **status}

        def check() -> dict | None:
            a = self.agent(peer_id)
            if a is None or any(a["status"].get(k) != v for k, v in want.items()):
                return None
            return a

        return wait_until(check, timeout, f"agent {peer_id} with {want}")

    def metric(self, name: str) -> float:
        total = 0.0
        for line in self.metrics_http.get("/metrics").text.splitlines():
            sample, _, value = line.rpartition(" ")
            if sample.split("{")[0] == name:
                total += float(value)
        return total

    def close(self) -> None:
        self.http.close()
        self.metrics_http.close()


class AgentIn:
    """An agent daemon with the simulated engine inside a namespace."""

    def __init__(
        self,
        ns: Netns,
        routers: list[str],
        model: str,
        *flags: str,
        env: dict[str, str] | None = None,
    ):
        self.ns = ns
        self.identity = ns.lab.dir / f"{ns.name}-agent-{model}.key"
        self.peer_id = str(peer_id_of(load_or_create_identity(self.identity)))
        argv = [str(VENV_BIN / "hivenet-agent"), "--engine", "sim", "--model", model]
        for r in routers:
            argv += ["--router", r]
        argv += ["--identity-path", str(self.identity), *flags]
        self.proc = ns.spawn(f"agent-{model}", argv, {**ns.lab.env, **(env or {})})

    def joins(self) -> int:
        return self.proc.log().count("router_joined")


# --- the relay and the delay, run inside a namespace by `python -m tests.netns` ----


async def _relay(path: str, host: str, port: int) -> None:
    import trio

    async def pump(src: trio.abc.Stream, dst: trio.abc.Stream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await src.receive_some(65536):
                await dst.send_all(data)
            await dst.send_eof()  # type: ignore[attr-defined]

    async def serve(client: trio.SocketStream) -> None:
        async with client:
            try:
                upstream = await trio.open_tcp_stream(host, port)
            except OSError:
                return
            async with upstream, trio.open_nursery() as nursery:
                nursery.start_soon(pump, client, upstream)
                nursery.start_soon(pump, upstream, client)

    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.tmp"
    await sock.bind(tmp)
    sock.listen(64)
    os.rename(tmp, path)  # appears only once it accepts
    await trio.serve_listeners(serve, [trio.SocketListener(sock)])


# linux/netfilter/nfnetlink_queue.h
NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLMSG_ERROR = 2


def _nfq_message(kind: int, queue: int, attrs: list[tuple[int, bytes]], seq: int = 0) -> bytes:
    body = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue)
    for attr_type, payload in attrs:
        attr = struct.pack("=HH", 4 + len(payload), attr_type) + payload
        body += attr + b"\0" * (-len(attr) % 4)
    header = struct.pack(
        "=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, NLM_F_REQUEST, seq, 0
    )
    return header + body


def _packet_ids(data: bytes) -> Iterator[int]:
    offset = 0
    while offset + 16 <= len(data):
        length, kind, _, _, _ = struct.unpack_from("=IHHII", data, offset)
        if kind == NLMSG_ERROR:
            (errno,) = struct.unpack_from("=i", data, offset + 16)
            if errno:
                raise OSError(-errno, "nfnetlink queue refused a message")
        elif kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            at = offset + 20
            while at + 4 <= offset + length:
                attr_len, attr_type = struct.unpack_from("=HH", data, at)
                if attr_len < 4:
                    break
                if attr_type & 0x3FFF == NFQA_PACKET_HDR:
                    yield struct.unpack_from("!I", data, at + 4)[0]
                at += (attr_len + 3) & ~3
        offset += max((length + 3) & ~3, 16)


async def _delay(queue: int, seconds: float, jitter: float) -> None:
    import trio

    sock = trio.socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    await sock.bind((0, 0))
    await sock.send(
        _nfq_message(
            NFQNL_MSG_CONFIG, queue, [(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0))]
        )
    )
    await sock.send(
        _nfq_message(
            NFQNL_MSG_CONFIG, queue, [(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))]
        )
    )

    async def release(packet_id: int) -> None:
        await trio.sleep(random.uniform(seconds - jitter, seconds + jitter))
        verdict = struct.pack("!II", NF_ACCEPT, packet_id)
        await sock.send(_nfq_message(NFQNL_MSG_VERDICT, queue, [(NFQA_VERDICT_HDR, verdict)]))

    async with trio.open_nursery() as nursery:
        print("delay_ready", flush=True)
        while True:
            for packet_id in _packet_ids(await sock.recv(65536)):
                nursery.start_soon(release, packet_id)


def main(argv: list[str]) -> None:
    import trio

    if argv[0] == "relay":
        trio.run(_relay, argv[1], argv[2], int(argv[3]))
    elif argv[0] == "delay":
        trio.run(_delay, int(argv[1]), float(argv[2]), float(argv[3]))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}: relay or delay")


if __name__ == "__main__":
    main(sys.argv[1:])
