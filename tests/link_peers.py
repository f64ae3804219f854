"""Hand-driven link peers for tests: an agent of the test's own against a real router,
a router of the test's own that a real agent process dials, and a bare libp2p stream
between two hosts in the test's own process."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.network.config import ConnectionConfig
from libp2p.peer.peerinfo import info_from_p2p_addr

from protocol import messages as m
from protocol.p2p import FramedStream, peer_id_of, tune_libp2p
from protocol.tokens import issue_token
from tests.fleet import SECRET, Router
from tests.test_link import METADATA, raw_session


def key_below(peer_id: str) -> bytes:
    """A key seed whose peer ID sorts before `peer_id`: least-loaded breaks ties by the
    lowest peer ID, so between two idle agents this one is tried first."""
    while True:
        seed = os.urandom(32)
        if str(peer_id_of(create_new_key_pair(seed))) < peer_id:
            return seed


@dataclass
class ScriptedAgent:
    """A joined agent session whose answers the test writes."""

    fs: FramedStream
    peer_id: str
    requests: list[dict] = field(default_factory=list)
    received: list[dict] = field(default_factory=list)
    cancelled: trio.Event = field(default_factory=trio.Event)


Answer = Callable[[dict, FramedStream], None]


@asynccontextmanager
async def scripted_agent(
    router: Router,
    answer: Answer,
    metadata: dict = METADATA,
    seed: bytes | None = None,
    heartbeat: dict | None = None,
) -> AsyncIterator[ScriptedAgent]:
    """Joins `router` with a valid token, heartbeats (`heartbeat`, or a healthy empty
    one) every 0.5 s and answers each request with `answer`."""
    async with raw_session(router, seed) as (stream, peer_id):
        fs = FramedStream(stream)
        agent = ScriptedAgent(fs, peer_id)

        def on_message(msg: dict) -> None:
            agent.received.append(msg)
            if msg["type"] == m.REQUEST:
                agent.requests.append(msg)
                answer(msg, fs)
            elif msg["type"] == m.CANCEL:
                agent.cancelled.set()

        async def beat() -> None:
            while True:
                fs.send_nowait(heartbeat or m.heartbeat(time.time(), True, {}, {}))
                await trio.sleep(0.5)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fs.run, on_message)
            fs.send_nowait(m.hello(issue_token(SECRET.encode(), peer_id, 600), metadata))
            nursery.start_soon(beat)
            await trio.to_thread.run_sync(router.wait_agent, peer_id)
            yield agent
            nursery.cancel_scope.cancel()


@dataclass
class FakeRouter:
    """A libp2p host speaking the router's side of the link, for a real agent to dial."""

    key_pair: KeyPair
    address: str = ""
    sessions: list[FramedStream] = field(default_factory=list)
    frames: list[dict] = field(default_factory=list)
    joined: trio.Event = field(default_factory=trio.Event)
    _arrived: trio.Event = field(default_factory=trio.Event)

    def record(self, frame: dict) -> None:
        self.frames.append(frame)
        self._arrived.set()
        self._arrived = trio.Event()

    async def wait_for(self, check: Callable[[], bool]) -> None:
        while not check():
            await self._arrived.wait()

    @property
    def multiaddr(self) -> str:
        return self.address

    def frames_for(self, req_id: int) -> list[dict]:
        return [f for f in self.frames if f.get("id") == req_id]


@asynccontextmanager
async def fake_router(
    on_join: Callable[[FramedStream], None] | None = None,
    accepts: tuple[str, ...] = (),
    liveness: float = 30.0,
) -> AsyncIterator[FakeRouter]:
    """Answers every hello with a welcome (that `accepts` these message types beyond
    the base set, and announces a `liveness` interval), records every frame an agent
    sends, and calls `on_join` with the session."""
    key_pair = create_new_key_pair(os.urandom(32))
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    host = new_host(key_pair=key_pair, listen_addrs=listen)
    router = FakeRouter(key_pair)

    async def handler(stream: Any) -> None:
        fs = FramedStream(stream)
        router.sessions.append(fs)

        def on_message(msg: dict) -> None:
            router.record(msg)
            if msg["type"] == m.HELLO:
                peer_id = str(peer_id_of(key_pair))
                fs.send_nowait(m.welcome(5.0, peer_id, liveness, accepts=accepts))
                router.joined.set()
                if on_join is not None:
                    on_join(fs)

        # A handler that raises wedges py-libp2p's connection.
        with contextlib.suppress(Exception):
            await fs.run(on_message)

    host.set_stream_handler(m.PROTOCOL_ID, handler)
    async with host.run(listen_addrs=listen):
        addr = host.get_addrs()[0]
        router.address = str(addr)
        try:
            yield router
        finally:
            for fs in router.sessions:
                fs.close("test over")
            await host.close()


@asynccontextmanager
async def stranger(router: Router, ip: str = "127.0.0.1") -> AsyncIterator[Callable[[], Any]]:
    """A libp2p connection to `router` from a new peer ID, dialled at `ip` (a loopback
    address other than 127.0.0.1 is also the connection's source); yields a function
    that opens one more agent stream on that connection."""
    host = new_host(
        key_pair=create_new_key_pair(os.urandom(32)),
        listen_addrs=[],
        connection_config=ConnectionConfig(max_connections_per_peer=1),
    )
    address = router.multiaddr.replace("/ip4/127.0.0.1/", f"/ip4/{ip}/")
    info = info_from_p2p_addr(multiaddr.Multiaddr(address))
    async with host.run(listen_addrs=[]):
        await host.connect(info)

        async def open_stream() -> Any:
            return await host.new_stream(info.peer_id, [m.PROTOCOL_ID])

        try:
            yield open_stream
        finally:
            await host.close()


@asynccontextmanager
async def libp2p_stream() -> AsyncIterator[tuple[Any, Any]]:
    """A libp2p stream over yamux, Noise and loopback TCP between two hosts in this
    process: (ours, the peer's end)."""
    tune_libp2p()
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    server = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=listen)
    client = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=[])
    theirs: list[Any] = []
    opened = trio.Event()

    async def handler(stream: Any) -> None:
        theirs.append(stream)
        opened.set()
        await trio.sleep_forever()

    server.set_stream_handler("/test/1.0.0", handler)
    async with server.run(listen_addrs=listen), client.run(listen_addrs=[]):
        info = info_from_p2p_addr(server.get_addrs()[0])
        await client.connect(info)
        stream = await client.new_stream(info.peer_id, ["/test/1.0.0"])
        await stream.write(b"")  # py-libp2p opens the stream on its first frame
        with trio.fail_after(10):
            await opened.wait()
        yield stream, theirs[0]
        # A test may leave the connection unable to write: the hosts' ends cancel it.
        with trio.move_on_after(1):
            await stream.reset()
