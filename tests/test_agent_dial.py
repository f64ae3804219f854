"""The agent's dialing (`agent/link.py` `RouterConnection.run`,
`agent/router_identity.py`) and its identity file, against routers, networks and disks
that fail in unlucky ways."""

from __future__ import annotations

import errno
import io
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from agent.link import BACKOFF_CAP, BACKOFF_START, STABLE_SESSION, RouterConnection
from protocol.p2p import peer_id_of
from tests.fleet import Fleet

ROUTER_ID = str(peer_id_of(create_new_key_pair(os.urandom(32))))
ADDRESS = f"/ip4/127.0.0.1/tcp/9/p2p/{ROUTER_ID}"


@dataclass
class JoinedSession:
    """A session the router welcomes and ends after `lasts` seconds."""

    lasts: float
    welcomed: trio.Event = field(default_factory=trio.Event)

    async def run(self) -> str:
        self.welcomed.set()
        await trio.sleep(self.lasts)
        return "read ended: StreamEOF"


@dataclass
class ScriptedHost:
    """The libp2p host calls the loop makes, each dial recorded at its (mock) time; the
    loop stops after `dials` dials."""

    dials: int
    connection: RouterConnection | None = None
    # The first dial never completes (a router that accepts TCP and says nothing).
    first_hangs: bool = False
    dialled_at: list[float] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)

    def get_network(self) -> ScriptedHost:
        return self

    def unblock_peer(self, peer_id: Any) -> None:
        pass

    async def close_peer(self, peer_id: Any) -> None:
        self.closed.append(str(peer_id))

    async def connect(self, info: Any) -> None:
        self.dialled_at.append(trio.current_time())
        if len(self.dialled_at) == self.dials and self.connection is not None:
            self.connection.stopping = True
        if self.first_hangs and len(self.dialled_at) == 1:
            await trio.sleep_forever()

    async def new_stream(self, peer_id: Any, protocols: list[str]) -> ScriptedStream:
        return ScriptedStream()


class ScriptedStream:
    """What the loop does with a stream itself: close one it will not use."""

    async def close(self) -> None:
        pass


async def run_sessions(lengths: list[float], first_hangs: bool = False) -> ScriptedHost:
    """Sessions of these lengths, one per dial; the host that saw the dials."""
    host = ScriptedHost(len(lengths), first_hangs=first_hangs)
    sessions = iter(lengths)
    connection = RouterConnection(host, ADDRESS, lambda stream: JoinedSession(next(sessions)))
    host.connection = connection
    await connection.run()
    return host


def pauses(host: ScriptedHost, lengths: list[float]) -> list[float]:
    """The sleep before each redial: the time between dials less the session's length."""
    at = host.dialled_at
    return [at[i + 1] - at[i] - lengths[i] for i in range(len(at) - 1)]


async def test_sessions_that_end_at_once_back_off_to_the_cap(autojump_clock: Any) -> None:
    # Two agents on one identity file: the router replaces one's session with the
    # other's as each joins, so each session ends a moment after its welcome.
    lengths = [0.3] * 9
    host = await run_sessions(lengths)
    waits = pauses(host, lengths)
    # Jitter takes the wait down to half the backoff, never lower.
    assert waits[-1] >= BACKOFF_CAP / 2
    assert all(w <= BACKOFF_CAP for w in waits)


async def test_a_session_that_lasted_redials_at_once(autojump_clock: Any) -> None:
    lengths = [0.3] * 6 + [STABLE_SESSION + 1, 0.3]
    host = await run_sessions(lengths)
    waits = pauses(host, lengths)
    assert waits[5] >= BACKOFF_CAP / 2  # backed off by the short ones
    assert waits[6] <= BACKOFF_START  # a router restart: back as soon as it listens


async def test_each_session_s_connection_is_closed_before_the_redial(
    autojump_clock: Any,
) -> None:
    host = await run_sessions([0.3, 0.3, 0.3])
    # The last dial's session ran as the loop stopped: the agent leaving closes it.
    assert host.closed == [ROUTER_ID, ROUTER_ID]


async def test_a_dial_that_never_completes_is_logged_as_such(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    host = await run_sessions([0.0, 0.3], first_hangs=True)
    assert len(host.dialled_at) == 2
    failed = [r.getMessage() for r in caplog.records if "router_dial_failed" in r.getMessage()]
    assert failed == [
        f'router_dial_failed router={ADDRESS} error="no stream to the router within 10 s"'
    ]


@dataclass
class FreezingRelay:
    """A TCP relay in front of a router. `freeze()` stops every connection it carries
    where it stands, both ways, with no FIN and no reset: a NAT that forgot them, a
    router host gone. The kernel still acknowledges what the agent sends, so only
    silence tells. Connections made afterwards are carried."""

    target_port: int
    port: int = 0
    frozen: list[trio.CancelScope] = field(default_factory=list)
    # Frozen streams, kept open: closing one would tell the agent.
    held: list[trio.SocketStream] = field(default_factory=list)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._carry, listeners)

    async def _carry(self, inbound: trio.SocketStream) -> None:
        outbound = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        self.held += [inbound, outbound]
        with trio.CancelScope() as scope:
            self.frozen.append(scope)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, inbound, outbound)
                nursery.start_soon(self._pump, outbound, inbound)
        await trio.sleep_forever()

    @staticmethod
    async def _pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
        while data := await source.receive_some(65536):
            await sink.send_all(data)

    def freeze(self) -> None:
        for scope in self.frozen:
            scope.cancel()
        self.frozen.clear()


async def test_a_half_open_connection_is_left_for_a_new_one() -> None:
    from libp2p import new_host
    from libp2p.network.config import ConnectionConfig

    from agent.engine_http import EnginePool, EngineTimeouts
    from agent.link import RouterSession, Status
    from protocol import messages as m
    from protocol.p2p import FramedStream
    from tests.link_peers import fake_router

    joins = [trio.Event(), trio.Event()]

    def on_join(fs: FramedStream) -> None:
        # The router's liveness frames, as a router whose liveness interval is 0.3 s.
        async def beat() -> None:
            while not fs.closed.is_set():
                fs.send_nowait(m.heartbeat(0.0, True, {}, {}))
                await trio.sleep(0.1)

        nursery.start_soon(beat)
        next(e for e in joins if not e.is_set()).set()

    async with trio.open_nursery() as nursery, fake_router(on_join, liveness=0.3) as router:
        relay = FreezingRelay(int(router.address.split("/tcp/")[1].split("/")[0]))
        await nursery.start(relay.serve)
        address = f"/ip4/127.0.0.1/tcp/{relay.port}/p2p/{peer_id_of(router.key_pair)}"
        agent_host = new_host(
            key_pair=create_new_key_pair(os.urandom(32)),
            listen_addrs=[],
            connection_config=ConnectionConfig(max_connections_per_peer=1),
        )
        engine = EnginePool("http://127.0.0.1:9", EngineTimeouts(5.0, 5.0), 1)

        def session(stream: Any) -> RouterSession:
            return RouterSession(stream, m.hello("t", {}), Status(), engine, 0.2, 0.0)

        async with agent_host.run(listen_addrs=[]):
            connection = RouterConnection(agent_host, address, session)
            nursery.start_soon(connection.run)
            # Guards against a hang only: the rejoin takes about a second.
            with trio.fail_after(15):
                # The agent's first heartbeat follows the welcome it read.
                await router.wait_for(lambda: any(f["type"] == m.HEARTBEAT for f in router.frames))
                relay.freeze()
                await joins[1].wait()
            connection.stopping = True
            assert connection.session is not None
            connection.session.fs.close("test over")
            await agent_host.close()
        nursery.cancel_scope.cancel()


async def test_a_tcp_router_s_name_is_resolved_by_the_system_at_each_dial() -> None:
    from agent.router_identity import dial_addrs, parse_router

    # localhost is in /etc/hosts, which py-libp2p's own DNS client never reads.
    addr = parse_router(f"/dns4/localhost/tcp/9000/p2p/{ROUTER_ID}").addr
    assert [str(a) for a in await dial_addrs(addr)] == ["/ip4/127.0.0.1/tcp/9000"]
    # WebSocket keeps the name, for its Host header, the proxy's CONNECT and TLS.
    ws = parse_router(f"/dns4/localhost/tcp/9000/ws/p2p/{ROUTER_ID}").addr
    assert await dial_addrs(ws) == [ws]


@pytest.mark.parametrize(
    "answer",
    [socket.gaierror(socket.EAI_NONAME, "Name or service not known"), [], ["fe80::1%eth0"]],
    ids=["unknown-name", "no-address", "link-local-only"],
)
async def test_a_name_with_nothing_to_dial_fails_that_dial_only(
    monkeypatch: pytest.MonkeyPatch, answer: object
) -> None:
    """What the resolver answers for a hostile or broken name ends the dial with an
    error the loop logs (`router_dial_failed`) and backs off from, never a crash."""
    from agent.router_identity import dial_addrs, parse_router

    async def resolve(host: str, port: int, family: int, kind: int) -> list[tuple]:
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, list)
        return [(socket.AF_INET6, kind, 6, "", (ip, port, 0, 2)) for ip in answer]

    monkeypatch.setattr(trio.socket, "getaddrinfo", resolve)
    addr = parse_router(f"/dns/router.invalid/tcp/9000/p2p/{ROUTER_ID}").addr
    with pytest.raises(OSError):
        await dial_addrs(addr)


def test_an_agent_joins_a_router_named_by_dns(fleet: Fleet) -> None:
    router = fleet.router()
    named = f"/dns4/localhost/tcp/{router.p2p_port}/p2p/{router.peer_id}"
    agent = fleet.agent([], "m1", "--router", named, wait=False)
    router.wait_agent(agent.peer_id)


def test_an_identity_file_cut_short_while_written_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protocol import p2p

    key = tmp_path / "agent_identity.key"

    class FullDisk(io.BytesIO):
        def write(self, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(p2p.os, "fdopen", lambda fd, mode: FullDisk())
        with pytest.raises(OSError, match="No space left"):
            p2p.load_or_create_identity(key)
    # Nothing half-written is left where the next start looks.
    assert not key.exists()
    made = peer_id_of(p2p.load_or_create_identity(key))
    assert key.stat().st_size == 32 and key.stat().st_mode & 0o777 == 0o600
    assert peer_id_of(p2p.load_or_create_identity(key)) == made
    assert [f.name for f in tmp_path.iterdir()] == [key.name]


def test_an_identity_file_others_may_read_is_used_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from protocol import p2p

    key = tmp_path / "agent_identity.key"
    made = peer_id_of(p2p.load_or_create_identity(key))
    assert "identity_file_readable" not in caplog.text
    key.chmod(0o644)
    with caplog.at_level(logging.WARNING, "identity"):
        assert peer_id_of(p2p.load_or_create_identity(key)) == made
    assert "identity_file_readable" in caplog.text and "mode=0644 want=0600" in caplog.text


def test_an_identity_path_that_is_no_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO would block the starting daemon until a writer came."""
    from protocol import p2p

    fifo = tmp_path / "agent_identity.key"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        p2p.load_or_create_identity(fifo)


def test_proxy_variables_name_the_proxy_as_curl_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agent.http_proxy import HttpProxy, parse_proxy_url, proxy_from_environment

    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert proxy_from_environment("ws", "10.0.0.1", 9001) is None
    # No scheme: an HTTP proxy's address, as curl, wget and pip take it.
    monkeypatch.setenv("HTTP_PROXY", "proxy.corp:3128")
    assert proxy_from_environment("ws", "10.0.0.1", 9001) == HttpProxy("proxy.corp", 3128)
    assert proxy_from_environment("wss", "10.0.0.1", 443) is None
    monkeypatch.setenv("HTTPS_PROXY", "http://u:p@proxy.corp:8080")
    assert proxy_from_environment("wss", "router.example", 443) == parse_proxy_url(
        "http://u:p@proxy.corp:8080"
    )
    monkeypatch.setenv("NO_PROXY", "localhost,.example")
    assert proxy_from_environment("wss", "router.example", 443) is None
    monkeypatch.setenv("HTTP_PROXY", "socks5://proxy.corp:1080")
    with pytest.raises(ValueError, match="is not an HTTP proxy URL"):
        proxy_from_environment("ws", "10.0.0.1", 9001)
