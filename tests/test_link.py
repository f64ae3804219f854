"""The agent link against a real router process, from in-process libp2p peers."""

from __future__ import annotations

import itertools
import os
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import jwt
import msgpack
import multiaddr
import psutil
import pytest
import trio
import trio.testing
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.config import ConnectionConfig
from libp2p.peer.peerinfo import info_from_p2p_addr

from protocol import messages as m
from protocol.frames import MAX_FRAME_BYTES, FrameDecoder, encode_frame
from protocol.p2p import FramedStream, peer_id_of, tune_libp2p
from protocol.tokens import issue_token
from tests.fleet import SECRET, Fleet, Router, wait_until

METADATA = {"model": "m1", "capability": "llm", "engine": "sim", "capacity": 4}


@asynccontextmanager
async def raw_session(router: Router, seed: bytes | None = None) -> AsyncIterator[tuple[Any, str]]:
    """A libp2p peer with one open agent stream to `router`."""
    key_pair = create_new_key_pair(seed or os.urandom(32))
    host = new_host(
        key_pair=key_pair,
        listen_addrs=[],
        connection_config=ConnectionConfig(max_connections_per_peer=1),
    )
    info = info_from_p2p_addr(multiaddr.Multiaddr(router.multiaddr))
    async with host.run(listen_addrs=[]):
        await host.connect(info)
        stream = await host.new_stream(info.peer_id, [m.PROTOCOL_ID])
        try:
            yield stream, str(peer_id_of(key_pair))
        finally:
            await stream.reset()
            await host.close()


@asynccontextmanager
async def host_and_stream(handler: Any) -> AsyncIterator[tuple[Any, Any]]:
    """A libp2p host serving `handler` on /test/1.0.0, and a client's stream to it."""
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    server = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=listen)
    async with server.run(listen_addrs=listen):
        server.set_stream_handler("/test/1.0.0", handler)
        client = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=[])
        async with client.run(listen_addrs=[]):
            info = info_from_p2p_addr(server.get_addrs()[0])
            await client.connect(info)
            yield server, await client.new_stream(info.peer_id, ["/test/1.0.0"])
            await client.close()
        await server.close()


async def first_reply(stream: Any) -> dict:
    decoder = FrameDecoder()
    with trio.fail_after(10):
        while True:
            for msg in decoder.feed(await stream.read(65536)):
                if msg["type"] != m.HEARTBEAT:
                    return msg


async def hello_reply(router: Router, token_for: Any, metadata: dict = METADATA) -> dict:
    async with raw_session(router) as (stream, peer_id):
        await stream.write(encode_frame(m.hello(token_for(peer_id), metadata)))
        return await first_reply(stream)


def token_with(secret: bytes, **offsets: int) -> Any:
    """Claims given as seconds from the moment the token is made (the test's run, not
    its collection: a long suite must not turn a future `nbf` into the past)."""

    def make(peer_id: str) -> str:
        now = int(time.time())
        times = {"exp": 600, **offsets}
        body = {"sub": peer_id, "iat": now, **{k: now + v for k, v in times.items()}}
        return jwt.encode(body, secret, algorithm="HS256")

    return make


@pytest.mark.parametrize(
    ("name", "token_for", "metadata", "reason"),
    [
        ("wrong secret", token_with(b"w" * 40), METADATA, "bad token signature"),
        ("expired", token_with(SECRET.encode(), exp=-100), METADATA, "expired"),
        (
            "not yet valid",
            token_with(SECRET.encode(), nbf=600),
            METADATA,
            "not yet valid",
        ),
        (
            "alg none",
            lambda pid: jwt.encode({"sub": pid, "exp": time.time() + 60}, None, algorithm="none"),
            METADATA,
            "algorithm 'none' refused",
        ),
        (
            "other peer",
            lambda pid: issue_token(SECRET.encode(), "12D3KooWother", 60),
            METADATA,
            "is not the connecting peer",
        ),
        (
            "capacity 0",
            lambda pid: issue_token(SECRET.encode(), pid, 60),
            {**METADATA, "capacity": 0},
            "capacity must be positive",
        ),
    ],
)
async def test_bad_hellos_are_refused_with_a_reason(
    fleet: Fleet, name: str, token_for: Any, metadata: dict, reason: str
) -> None:
    router = fleet.router()
    reply = await hello_reply(router, token_for, metadata)
    assert reply["type"] == m.REFUSAL, name
    assert reason in reply["reason"]
    assert router.agents() == []
    assert "agent_refused" in router.log()


def test_agents_with_a_wrong_secret_or_no_capacity_never_join(fleet: Fleet) -> None:
    """The router refuses a wrong secret; `--capacity 0`, which it would refuse too
    (the hello test above), stops the agent at start instead (INTERFACE.md)."""
    router = fleet.router()
    wrong = fleet.agent(router, "m1", env={"HIVENET_ROUTER_JWT_SECRET": "x" * 40}, wait=False)
    empty = fleet.agent(router, "m1", "--capacity", "0", wait=False)
    wrong.wait_log("router_refused .*bad token signature")
    assert empty.popen is not None and empty.popen.wait(30) == 2
    assert "hivenet-agent: --capacity must be positive, not 0" in empty.log()
    assert router.agents() == []


async def test_malformed_and_oversized_frames_end_only_that_session(fleet: Fleet) -> None:
    router = fleet.router()
    good = fleet.agent(router, "m1")
    async with raw_session(router) as (stream, _):
        await stream.write(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
        with trio.fail_after(10):
            with pytest.raises(Exception):  # noqa: B017 - the router resets the stream
                while True:
                    await stream.read(65536)
    async with raw_session(router) as (stream, peer_id):
        await stream.write(
            encode_frame(m.hello(issue_token(SECRET.encode(), peer_id, 60), METADATA))
        )
        assert (await first_reply(stream))["type"] == m.WELCOME
        await stream.write(struct.pack(">I", MAX_FRAME_BYTES + 1) + b"x" * 100)
        with trio.fail_after(10), pytest.raises(Exception):  # noqa: B017
            while True:
                await stream.read(65536)
    async with raw_session(router) as (stream, _):
        await stream.write(encode_frame({"type": "nonsense"}))
        with trio.fail_after(10), pytest.raises(Exception):  # noqa: B017
            while True:
                await stream.read(65536)
    log = router.log()
    assert "malformed frame" in log
    assert "oversized frame" in log
    assert "unknown message type" in log
    assert router.agent(good.peer_id)["status"]["healthy"]
    answer = await trio.to_thread.run_sync(
        lambda: __import__("httpx").post(
            router.url + "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "ok"}]},
            timeout=10,
        )
    )
    assert answer.json()["choices"][0]["message"]["content"] == "Echo: ok"


async def test_an_idle_session_hears_from_the_router_once_per_liveness_interval(
    fleet: Fleet,
) -> None:
    # Each router frame costs it a socket write: on an idle session it speaks once every
    # six heartbeat periods, and says so in its welcome.
    router = fleet.router("--heartbeat-interval", "0.1s", "--unhealthy-after", "5s")
    async with raw_session(router) as (stream, peer_id):
        token = issue_token(SECRET.encode(), peer_id, 60)
        await stream.write(encode_frame(m.hello(token, METADATA)))
        welcome = await first_reply(stream)
        assert welcome["heartbeat_interval"] == 0.1
        assert welcome["liveness_interval"] == pytest.approx(0.6)
        decoder = FrameDecoder()
        beats: list[float] = []
        with trio.move_on_after(3.2):
            while True:
                await stream.write(encode_frame(m.heartbeat(time.time(), True, {}, {})))
                with trio.move_on_after(0.2):
                    for msg in decoder.feed(await stream.read(65536)):
                        assert msg["type"] == m.HEARTBEAT
                        beats.append(trio.current_time())
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    # Over 3.2 s a router speaking every heartbeat period would send about 32.
    assert 3 <= len(beats) <= 7, beats
    assert min(gaps) > 0.4, gaps


async def test_300_successive_agent_connections_all_join(fleet: Fleet) -> None:
    # py-libp2p's listener refused every connection after its 250th in a process's
    # lifetime, closed or not: 300 join, five at a time, each gone before the next five.
    router = fleet.router()
    proc = psutil.Process(router.popen.pid)

    async def join_once() -> None:
        async with raw_session(router) as (stream, peer_id):
            token = issue_token(SECRET.encode(), peer_id, 60)
            await stream.write(encode_frame(m.hello(token, METADATA)))
            assert (await first_reply(stream))["type"] == m.WELCOME

    rss: list[int] = []
    tasks: list[float] = []
    for i in range(60):
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(join_once)
        if i in (9, 59):
            await trio.sleep(1)
            rss.append(proc.memory_info().rss)
            tasks.append(router.metric("hivenet_router_trio_tasks"))
    # Later joins work like the first; no task per past connection is left behind.
    assert tasks[1] - tasks[0] < 20, tasks
    assert rss[1] - rss[0] < 40 * 1024 * 1024, rss
    wait_until(lambda: router.metric("hivenet_router_agents_connected") == 0, 10, "sessions gone")


async def test_large_messages_both_ways_arrive_intact_and_in_order() -> None:
    # With the daemons' yamux tuning: flow control must still carry 1 MiB messages.
    tune_libp2p()
    sizes = [100, 1000, 16 * 1024, 64 * 1024, 300 * 1024, 1024 * 1024]
    payloads = [os.urandom(sizes[i % len(sizes)]) for i in range(60)]
    got_server: list[bytes] = []
    got_client: list[bytes] = []
    done = trio.Event()
    server_done = trio.Event()

    async def exchange(stream: Any, got: list[bytes], all_in: trio.Event) -> None:
        """Send every payload and take the other side's, until both sides have all."""
        fs = FramedStream(stream)

        def on(msg: dict) -> None:
            got.append(msg["data"])
            if len(got) == len(payloads):
                all_in.set()

        async with trio.open_nursery() as n:
            n.start_soon(fs.run, on)
            for i, p in enumerate(payloads):
                await fs.send(m.response_chunk(i, p))
            await done.wait()
            await server_done.wait()
            fs.close("done")

    async def handler(stream: Any) -> None:
        await exchange(stream, got_server, server_done)

    async with host_and_stream(handler) as (_, stream):
        with trio.fail_after(60):
            await exchange(stream, got_client, done)
    assert got_client == payloads
    assert got_server == payloads


async def test_frames_buffered_then_handed_over_by_the_muxer_keep_their_order() -> None:
    """The first frames wait in yamux's buffer for the reader; once it has read them
    the muxer hands frames to the session itself (`yamux_fast.deliver_to`): every
    message arrives once and in order across that switch, and a bad frame on the
    direct path ends the session with its reason and nothing after it is heard."""
    tune_libp2p()
    got: list[int] = []
    first_batch, second_batch = 50, 200
    early, all_in, closed = trio.Event(), trio.Event(), trio.Event()
    ended: list[str] = []
    sink_seen: list[bool] = []

    async def handler(stream: Any) -> None:
        await trio.sleep(0.3)  # the client's first frames wait in the buffer meanwhile
        fs = FramedStream(stream)

        def on(msg: dict) -> None:
            got.append(msg["id"])
            if len(got) == first_batch:
                early.set()
            if len(got) == first_batch + second_batch:
                all_in.set()

        ended.append(await fs.run(on))
        closed.set()

    async with host_and_stream(handler) as (server, stream):
        with trio.fail_after(30):
            for i in range(first_batch):
                await stream.write(encode_frame(m.response_chunk(i, b"x" * 100)))
            await early.wait()
            await trio.sleep(0.1)
            conn = next(iter(server.get_network().connections.values()))
            conn = conn[0] if isinstance(conn, list) else conn
            muxed = list(conn.muxed_conn.streams.values())
            sink_seen.append(any(getattr(s, "_hivenet_sink", None) for s in muxed))
            for i in range(first_batch, first_batch + second_batch):
                await stream.write(encode_frame(m.response_chunk(i, b"y" * (i * 37))))
            await all_in.wait()
            await stream.write(struct.pack(">I", 5) + b"\xc1" * 5)
            await stream.write(encode_frame(m.response_chunk(10_000, b"late")))
            await closed.wait()
    assert sink_seen == [True]
    assert got == list(range(first_batch + second_batch))
    assert "malformed frame" in ended[0]


def test_a_session_s_kept_packer_writes_what_packb_writes_after_a_refused_message() -> None:
    """Each session packs its frames with one kept msgpack packer: the bytes are
    packb's, and a message that cannot be packed (refused half-way through) leaves
    nothing of itself in the frames after it."""
    fs = FramedStream(stream=None)
    sent: list[dict] = [m.response_chunk(i, os.urandom(i * 37)) for i in range(10)]
    for msg in sent:
        fs.send_nowait(msg)
    with pytest.raises(TypeError):
        fs.send_nowait({"type": m.RESPONSE_CHUNK, "id": 1, "data": [1, "two", object()]})
    more = [m.cancel(7), m.response_end(3, {"prompt_tokens": 5}), m.response_chunk(4, b"")]
    for msg in more:
        fs.send_nowait(msg)
    assert list(fs._outbox.frames) == [encode_frame(msg) for msg in sent + more]


async def test_a_session_s_writer_waits_for_a_frame_or_the_close_and_can_be_cancelled() -> None:
    """The writer's outbox: a put or a close wakes it; what was put before it waits is
    taken at once; a cancelled wait leaves no waiter behind to wake."""
    from protocol.p2p import _Outbox

    outbox = _Outbox()
    with trio.move_on_after(0.05) as scope:
        await outbox.wait()
    assert scope.cancelled_caught and outbox.waiter is None
    outbox.put(b"early")
    with trio.fail_after(1):
        await outbox.wait()  # at once: a frame is there
    woken: list[str] = []

    async def writer(task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        await outbox.wait()
        woken.append("put" if len(outbox.frames) == 2 else "?")
        outbox.frames.clear()
        await outbox.wait()
        woken.append("closed" if outbox.closed else "?")

    outbox.frames.clear()
    async with trio.open_nursery() as nursery:
        await nursery.start(writer)
        await trio.testing.wait_all_tasks_blocked()
        assert outbox.waiter is not None
        outbox.put(b"a")
        outbox.put(b"b")
        await trio.testing.wait_all_tasks_blocked()
        outbox.close()
    assert woken == ["put", "closed"]


def test_a_session_does_not_keep_the_buffer_a_large_frame_grew() -> None:
    """A msgpack packer keeps the largest buffer it grew to: a session's is replaced
    after a large frame, so a router does not hold a request body's worth per agent."""
    import tracemalloc

    fs = FramedStream(stream=None)
    fs.send_nowait(m.response_chunk(1, b"small"))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fs.send_nowait(m.response_chunk(2, b"x" * (4 << 20)))
        fs._outbox.frames.clear()
        fs.send_nowait(m.response_chunk(3, b"small"))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1 << 20, held


def test_frame_decoder_handles_split_and_joined_frames() -> None:
    frames = b"".join(encode_frame(m.cancel(i)) for i in range(50))
    decoder = FrameDecoder()
    out = []
    for i in range(0, len(frames), 7):
        out += decoder.feed(frames[i : i + 7])
    assert [msg["id"] for msg in out] == list(range(50))
    assert decoder.buffered == 0
    assert msgpack.unpackb(frames[4 : 4 + struct.unpack(">I", frames[:4])[0]])["id"] == 0
