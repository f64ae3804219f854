"""protocol/yamux_fast.py: the lean frame paths do what py-libp2p 0.8.1's own code does
(frames through the whole patched stack: tests/test_link.py, tests/test_fleet_e2e.py)."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import random
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import pytest
import trio
import trio.testing
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.io.trio import TrioTCPStream
from libp2p.network.stream.net_stream import NetStream
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.stream_muxer.yamux import yamux as yamux_module
from libp2p.stream_muxer.yamux.yamux import (
    FLAG_FIN,
    TYPE_DATA,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    YAMUX_HEADER_FORMAT,
)

from agent.engine_http import EnginePool, EngineTimeouts
from agent.link import SILENT_PERIODS, RouterSession, Status
from protocol import messages as m
from protocol import p2p, yamux_fast
from protocol.conversation import Role, next_session_state
from protocol.frames import encode_frame
from tests.link_peers import libp2p_stream
from tests.scheduler_passes import passes_of_this_task


def _pristine_yamux() -> Any:
    """py-libp2p's yamux module as shipped, loaded apart from the patched one."""
    spec = importlib.util.spec_from_file_location("pristine_yamux", yamux_module.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class FakeStream:
    closed: bool = False
    recv_closed: bool = False
    reset_received: bool = False
    send_window: int = 0
    recv_window: int = 1000


@dataclass
class FakeMuxer:
    streams: dict[int, FakeStream] = field(default_factory=dict)
    stream_buffers: dict[int, bytearray] = field(default_factory=dict)
    stream_events: dict[int, trio.Event] = field(default_factory=dict)
    event_shutting_down: trio.Event = field(default_factory=trio.Event)
    streams_lock: trio.Lock = field(default_factory=trio.Lock)
    finalized: list[FakeStream] = field(default_factory=list)
    peer_id: str = "peer"
    secured_conn: Any = None

    def _finalize_stream_locked(self, stream: FakeStream, fully_closed: bool) -> None:
        self.finalized.append(stream)

    async def _read_data_body(self, length: int) -> bytes:
        return await yamux_fast._read_data_body(self, length)  # type: ignore[arg-type]


async def _outcome(read_stream: Any, muxer: FakeMuxer, n: int) -> tuple:
    with trio.move_on_after(0.02):
        try:
            data = await read_stream(muxer, 1, n)
        except Exception as exc:
            return ("raised", type(exc).__name__, len(muxer.finalized))
        return ("data", data, bytes(muxer.stream_buffers.get(1, b"")), len(muxer.finalized))
    return ("waits",)


async def test_read_stream_matches_py_libp2p_in_every_state() -> None:
    original = _pristine_yamux().Yamux.read_stream
    states = itertools.product(
        (True, False),  # stream known
        (False, True),  # connection shutting down
        (None, b"", b"abcdef"),  # buffer
        (False, True),  # recv_closed
        (False, True),  # reset_received
        (False, True),  # closed
        (-1, 3),  # n
    )
    for known, shutting, buffer, recv_closed, reset, closed, n in states:
        outcomes = []
        for read_stream in (original, yamux_fast._read_stream):
            muxer = FakeMuxer()
            if known:
                muxer.streams[1] = FakeStream(closed, recv_closed, reset)
            if buffer is not None:
                muxer.stream_buffers[1] = bytearray(buffer)
            muxer.stream_events[1] = trio.Event()
            if shutting:
                muxer.event_shutting_down.set()
            outcomes.append(await _outcome(read_stream, muxer, n))
        assert outcomes[0] == outcomes[1], (known, shutting, buffer, recv_closed, reset, closed)


class BytesReader:
    """A secured connection holding `data`, read the way py-libp2p reads one."""

    def __init__(self, data: bytes, muxer: FakeMuxer) -> None:
        self.data = data
        self._hivenet_muxer = muxer

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        taken, self.data = self.data[: n or len(self.data)], self.data[n or len(self.data) :]
        return taken


def frame(kind: int, flags: int, stream_id: int, length: int, body: bytes = b"") -> bytes:
    return struct.pack(YAMUX_HEADER_FORMAT, 0, kind, flags, stream_id, length) + body


async def test_common_frames_are_applied_and_the_rest_reach_py_libp2p() -> None:
    muxer = FakeMuxer()
    muxer.streams[1] = FakeStream(send_window=10)
    muxer.stream_buffers[1] = bytearray()
    muxer.stream_events[1] = trio.Event()
    fin = frame(TYPE_DATA, FLAG_FIN, 1, 2, b"zz")
    reader = BytesReader(
        frame(TYPE_WINDOW_UPDATE, 0, 1, 500)
        + frame(TYPE_DATA, 0, 1, 5, b"hello")
        + frame(TYPE_DATA, 0, 7, 3, b"abc")  # a stream this side does not know
        + fin,
        muxer,
    )
    muxer.secured_conn = reader
    header = await yamux_fast._next_header(reader, 12)
    assert header == frame(TYPE_DATA, 0, 7, 3)
    assert muxer.streams[1].send_window == 510
    assert bytes(muxer.stream_buffers[1]) == b"hello"
    assert muxer.streams[1].recv_window == 995
    assert muxer.stream_events[1].is_set()
    assert reader.data == b"abc" + fin  # the loop reads the body of what it handles
    reader.data = fin
    assert await yamux_fast._next_header(reader, 12) == fin[:12]
    # A ping is py-libp2p's too, and a body read is never taken for a header.
    reader.data = frame(TYPE_PING, 1, 0, 9)
    assert await yamux_fast._next_header(reader, 12) == frame(TYPE_PING, 1, 0, 9)
    reader.data = b"x" * 12
    assert await yamux_fast._read_data_body(muxer, 12) == b"x" * 12  # type: ignore[arg-type]


async def test_a_body_for_a_stream_gone_meanwhile_is_dropped() -> None:
    muxer = FakeMuxer()
    muxer.streams[1] = FakeStream()
    muxer.stream_buffers[1] = bytearray()
    muxer.stream_events[1] = trio.Event()

    class Slow(BytesReader):
        async def read(self, n: int | None = None) -> bytes:
            if n == 4:  # the body: the stream ends while it is on its way
                muxer.streams.pop(1)
            return await super().read(n)

    reader = Slow(frame(TYPE_DATA, 0, 1, 4, b"late") + frame(TYPE_PING, 1, 0, 1), muxer)
    muxer.secured_conn = reader
    assert await yamux_fast._next_header(reader, 12) == frame(TYPE_PING, 1, 0, 1)
    assert muxer.stream_buffers[1] == bytearray()
    assert not muxer.stream_events[1].is_set()


async def test_noise_messages_that_arrive_together_are_read_whole_and_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Noise messages that arrive in one socket read are each taken from that read's
    buffer (not through py-libp2p's own path), and the bytes arrive as they were
    written, those of messages split across reads (writes larger than one read) too."""
    p2p.tune_libp2p()
    slow: list[int] = []
    original = yamux_fast._original_noise_read

    async def counted(self: Any, prefix_encoded: bool = False) -> bytes:
        slow.append(1)
        return await original(self, prefix_encoded)

    monkeypatch.setattr(yamux_fast, "_original_noise_read", counted)
    burst = [bytes([i]) * (1 + i * 37 % 3000) for i in range(60)]
    large = [bytes([200 + i]) * size for i, size in enumerate((70_000, 3, 140_000, 9))]
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    server = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=listen)
    client = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=[])
    received = bytearray()
    go, done = trio.Event(), trio.Event()
    expected = b"".join(burst + large)

    async def handler(stream: Any) -> None:
        await go.wait()
        while len(received) < len(expected):
            received.extend(await stream.read(1 << 20))
        done.set()

    server.set_stream_handler("/test/1.0.0", handler)
    async with server.run(listen_addrs=listen), client.run(listen_addrs=[]):
        info = info_from_p2p_addr(server.get_addrs()[0])
        await client.connect(info)
        stream = await client.new_stream(info.peer_id, ["/test/1.0.0"])
        before = len(slow)
        # The burst's frames go in one socket write, a Noise message each, as frames
        # the agent wrote one by one wait in the kernel while the router is busy.
        noise = stream.muxed_conn.secured_conn.conn
        joined = bytearray()
        for data in burst:  # about 90 KB: within the stream's window
            header = struct.pack(
                YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, stream.muxed_stream.stream_id, len(data)
            )
            message = noise.encrypt(header + data)
            joined += len(message).to_bytes(2, "big") + message
        await noise.read_writer.read_write_closer.write(bytes(joined))
        go.set()
        for data in large:
            await stream.write(data)
        with trio.fail_after(30):
            await done.wait()
        assert bytes(received) == expected
        assert len(slow) - before < len(burst) // 4
        await stream.reset()
        await client.close()
        await server.close()


async def test_the_agent_has_the_kernel_watch_its_unacknowledged_heartbeats() -> None:
    p2p.tune_libp2p()
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    server = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=listen)
    client = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=[])

    async def handler(stream: Any) -> None:
        await trio.sleep_forever()

    server.set_stream_handler("/test/1.0.0", handler)
    async with (
        server.run(listen_addrs=listen),
        client.run(listen_addrs=[]),
        EnginePool("http://127.0.0.1:9", EngineTimeouts(5.0, 5.0), 1) as engine,
    ):
        info = info_from_p2p_addr(server.get_addrs()[0])
        await client.connect(info)
        stream = await client.new_stream(info.peer_id, ["/test/1.0.0"])
        RouterSession(stream, {}, Status(), engine, 2.0, 10.0)
        sock = p2p.tcp_socket_of(stream)
        assert sock is not None
        option = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        assert option == SILENT_PERIODS * 2000
        await stream.reset()
        await client.close()
        await server.close()


async def test_the_agent_times_router_silence_by_the_welcomes_liveness_interval() -> None:
    def said_hello() -> RouterSession:
        ours, _ = trio.testing.memory_stream_pair()
        session = RouterSession(ours, {}, Status(), None, 0.1, 1.0)  # type: ignore[arg-type]
        session.state = next_session_state(Role.AGENT, session.state, m.HELLO)
        return session

    session = said_hello()
    session._on_message(m.welcome(0.1, "router", 2.0))
    assert session.router_interval == 2.0
    # A router that predates the field: its heartbeat period, as before.
    session = said_hello()
    session._on_message({"type": m.WELCOME, "heartbeat_interval": 0.5})
    assert session.router_interval == 0.5


def test_no_socket_under_a_stream_is_no_error() -> None:
    ours, _ = trio.testing.memory_stream_pair()
    assert p2p.tcp_socket_of(ours) is None
    assert p2p.limit_unacknowledged(ours, 15) is False


@pytest.mark.parametrize("size", [1, 200, yamux_fast._MAX_DATA, yamux_fast._MAX_DATA + 1, 200_000])
async def test_stream_writes_are_the_frames_py_libp2p_writes(size: int) -> None:
    pristine = _pristine_yamux()
    frames: dict[str, list[bytes]] = {"ours": [], "theirs": []}

    class Conn:
        def __init__(self, name: str) -> None:
            self.name = name

        async def _write_frame(self, data: bytes) -> None:
            frames[self.name].append(data)

    ours = yamux_module.YamuxStream(5, Conn("ours"), True)  # type: ignore[arg-type]
    theirs = pristine.YamuxStream(5, Conn("theirs"), True)
    await yamux_fast._stream_write(ours, b"x" * size)
    await theirs.write(b"x" * size)
    assert frames["ours"] == frames["theirs"]
    assert ours.send_window == theirs.send_window
    if size <= yamux_fast._MAX_DATA:
        assert frames["ours"] == [frame(TYPE_DATA, 0, 5, size, b"x" * size)]


async def test_a_stream_write_takes_its_free_state_lock_without_a_scheduler_pass() -> None:
    """py-libp2p's NetStream.write checks the stream's state under a lock first: a free
    one is now taken without a pass through the scheduler; a held one is waited for."""
    p2p.tune_libp2p()
    written: list[bytes] = []

    class Muxed:
        muxed_conn = None

        async def write(self, data: bytes) -> None:
            written.append(data)

    stream = NetStream(Muxed(), None, None)  # type: ignore[arg-type]
    with passes_of_this_task() as passes:
        await stream.write(b"one")
    assert written == [b"one"]
    assert passes.count == 0

    async with trio.open_nursery() as nursery, stream._state_lock:
        nursery.start_soon(stream.write, b"two")
        await trio.testing.wait_all_tasks_blocked()
        assert written == [b"one"]  # waiting for the lock
    assert written == [b"one", b"two"]


async def _frames_arrive(stream: Any, messages: list[dict]) -> None:
    """The peer reads exactly these messages' frames, in order."""
    expected = b"".join(encode_frame(message) for message in messages)
    received = bytearray()
    with trio.fail_after(20):
        while len(received) < len(expected):
            data = await stream.read(1 << 20)
            assert data, "the stream ended early"
            received += data
    assert bytes(received) == expected


def _pause_reads(stream: Any) -> trio.Event:
    """Have the TCP connection under `stream` read nothing from its socket, once the
    read under way returns, until the event returned is set."""
    tcp = p2p._layer_under(stream, TrioTCPStream)
    resume = trio.Event()

    async def paused(n: int | None = None) -> bytes:
        await resume.wait()
        return await p2p._buffered_read(tcp, n)

    tcp.read = paused
    return resume


async def test_a_small_batch_goes_to_the_socket_without_py_libp2ps_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer's batch that fits one Noise message is one socket write of its own
    making; a larger one takes py-libp2p's path; the peer reads both as written."""
    layered: list[int] = []
    original = NetStream.write

    async def counted(self: NetStream, data: bytes) -> None:
        layered.append(len(data))
        await original(self, data)

    monkeypatch.setattr(NetStream, "write", counted)
    async with libp2p_stream() as (ours, theirs), trio.open_nursery() as nursery:
        layered.clear()  # the stream's opening
        fs = p2p.FramedStream(ours)
        nursery.start_soon(fs.run, lambda message: None)
        small = {"type": "data", "pad": b"s" * 100}
        large = {"type": "data", "pad": b"l" * 100_000}
        fs.send_nowait(small)
        await _frames_arrive(theirs, [small])
        assert layered == []
        fs.send_nowait(large)
        await _frames_arrive(theirs, [large])
        assert len(layered) == 1 and layered[0] > 100_000
        nursery.cancel_scope.cancel()


def _socket_buffers(ours: Any, theirs: Any, size: int) -> None:
    """Our send buffer and the peer's receive buffer: small ones fill at once."""
    for end, option in ((ours, socket.SO_SNDBUF), (theirs, socket.SO_RCVBUF)):
        sock = p2p.tcp_socket_of(end)
        assert sock is not None
        sock.setsockopt(socket.SOL_SOCKET, option, size)


def _count_sends(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(bytes sent, bytes offered) of each of DirectWriter's socket writes."""
    sends: list[tuple[int, int]] = []
    send = yamux_fast.send_at_once

    def counted(sock: socket.socket, data: bytes) -> int:
        sends.append((send(sock, data), len(data)))
        return sends[-1][0]

    monkeypatch.setattr(yamux_fast, "send_at_once", counted)
    return sends


@pytest.mark.parametrize("at_batch_end", [False, True])
async def test_direct_and_layered_writes_arrive_whole_and_in_order_when_the_kernel_is_full(
    monkeypatch: pytest.MonkeyPatch, at_batch_end: bool
) -> None:
    """Small socket buffers and a peer that stops reading for a while: direct writes
    that the kernel takes whole or only in part (by the writer, or at a batch's end,
    the rest then owed on the connection), and batches too large for them, which take
    py-libp2p's path, interleave; the peer decrypts and decodes every frame, in order,
    once it reads again."""
    sends = _count_sends(monkeypatch)
    owed: list[int] = []
    owe = yamux_fast.owe

    def counted(tcp: TrioTCPStream, data: bytes) -> None:
        owed.append(len(data))
        owe(tcp, data)

    monkeypatch.setattr(yamux_fast, "owe", counted)
    async with libp2p_stream() as (ours, theirs), trio.open_nursery() as nursery:
        _socket_buffers(ours, theirs, 4096)
        resume = _pause_reads(theirs)
        fs = p2p.FramedStream(ours, write_at_batch_end=at_batch_end)
        nursery.start_soon(fs.run, lambda message: None)
        sent: list[dict] = []
        for burst in range(60):
            if burst == 30:
                resume.set()
                _socket_buffers(ours, theirs, 1 << 20)  # a 4 KB window makes the rest slow
            size = 70_000 if burst in (5, 45) else burst * 997 % 9000 + 1
            message = {"type": "data", "n": burst, "pad": b"p" * size}
            fs.send_nowait(message)
            sent.append(message)
            await trio.sleep(0.001)
        await _frames_arrive(theirs, sent)
        assert any(done == offered for done, offered in sends)
        assert any(done < offered for done, offered in sends)
        assert len(sends) < 60  # the 70 KB ones, and batches joined behind a full kernel
        assert any(owed)  # a rest owed on the connection, and paid before what followed
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("at_batch_end", [False, True])
async def test_a_peer_that_stops_reading_still_times_out_a_direct_write(
    monkeypatch: pytest.MonkeyPatch, at_batch_end: bool
) -> None:
    """What a direct write could not send at once is the connection's write to finish:
    a peer that reads no more ends the session at the write timeout, as before."""
    sends = _count_sends(monkeypatch)

    async def deaf(n: int | None = None) -> bytes:
        await trio.sleep_forever()
        return b""

    async with libp2p_stream() as (ours, theirs):
        _socket_buffers(ours, theirs, 4096)
        # The peer's connection reads nothing more once its read under way returns.
        peer_tcp = p2p._layer_under(theirs, TrioTCPStream)
        peer_tcp.read = deaf
        fs = p2p.FramedStream(ours, write_timeout=0.5, write_at_batch_end=at_batch_end)
        reasons: list[str] = []

        async def run() -> None:
            reasons.append(await fs.run(lambda message: None))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            with trio.fail_after(10):
                while not fs.closed.is_set():
                    with contextlib.suppress(p2p.SessionClosed):
                        fs.send_nowait({"type": "data", "pad": b"p" * 3000})
                    await trio.sleep(0.01)
        assert reasons == ["write timed out after 0.5 s"]
        assert any(done < offered for done, offered in sends)


def _count_wakes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per wake of a session's writer."""
    wakes: list[int] = []
    wake = p2p._Outbox.wake

    def counted(self: p2p._Outbox) -> None:
        if self.waiter is not None:
            wakes.append(1)
        wake(self)

    monkeypatch.setattr(p2p._Outbox, "wake", counted)
    return wakes


@pytest.mark.parametrize("at_batch_end", [False, True])
async def test_frames_queued_while_the_writer_waits_leave_together_at_the_batch_end(
    monkeypatch: pytest.MonkeyPatch, at_batch_end: bool
) -> None:
    """Frames that tasks of one scheduler batch queue on an idle session leave in one
    write when the batch ends, without a wake of the session's writer; without it, the
    writer is woken and writes them in the next batch."""
    sends = _count_sends(monkeypatch)
    wakes = _count_wakes(monkeypatch)
    async with libp2p_stream() as (ours, theirs), trio.open_nursery() as nursery:
        fs = p2p.FramedStream(ours, write_at_batch_end=at_batch_end)
        nursery.start_soon(fs.run, lambda message: None)
        go = trio.Event()
        order: list[dict] = []

        async def queue(message: dict) -> None:
            await go.wait()
            fs.send_nowait(message)
            order.append(message)

        # Two tasks woken together run in the same batch, in either order.
        for n in range(2):
            nursery.start_soon(queue, {"type": "data", "n": n})
        await trio.testing.wait_all_tasks_blocked()
        sends.clear()
        wakes.clear()
        go.set()
        await trio.sleep(0.05)
        await _frames_arrive(theirs, order)
        assert len(sends) == 1 and sends[0][0] == sends[0][1]
        assert wakes == ([] if at_batch_end else [1])
        nursery.cancel_scope.cancel()


async def test_one_batch_end_serves_every_session_of_a_run() -> None:
    assert p2p._batch_end() is p2p._batch_end()


@contextlib.asynccontextmanager
async def idle_batch_end_session() -> Any:
    """A session that writes at the batch's end, running, its writer waiting; yields it,
    the other end's stream and the nursery it runs in."""
    async with libp2p_stream() as (ours, theirs), trio.open_nursery() as nursery:
        fs = p2p.FramedStream(ours, write_at_batch_end=True)
        nursery.start_soon(fs.run, lambda message: None)
        await trio.testing.wait_all_tasks_blocked()
        yield fs, theirs, nursery


async def test_frames_held_for_a_batch_end_go_with_a_closing_session() -> None:
    """A session that closes, flushing, with frames held for the batch's end has its
    writer send them; one that is closed outright drops them; neither fails."""
    async with idle_batch_end_session() as (fs, theirs, nursery):
        last = {"type": "data", "n": 1}
        fs.send_nowait(last)
        nursery.start_soon(fs.flush_and_close, "done")
        await _frames_arrive(theirs, [last])
    async with idle_batch_end_session() as (fs, _theirs, _nursery):
        fs.send_nowait({"type": "data", "n": 2})
        fs.close("gone")
        with trio.fail_after(5):
            await fs.closed.wait()
        assert fs.close_reason == "gone"


async def test_a_batch_end_write_that_fails_to_seal_ends_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(self: yamux_fast.DirectWriter, data: bytes) -> bool:
        raise RuntimeError("nonce depleted")

    monkeypatch.setattr(yamux_fast.DirectWriter, "write_now", broken)
    async with idle_batch_end_session() as (fs, _theirs, _nursery):
        fs.send_nowait({"type": "data"})
        with trio.fail_after(5):
            await fs.closed.wait()
        assert fs.close_reason == "write failed: RuntimeError"


async def test_frames_packed_into_noise_messages_any_way_arrive_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer's yamux may put several frames in one Noise message (go-yamux buffers its
    writes) and run a frame on into the next message: a message is taken apart without
    the session's buffer while it holds headers and bodies whole, and what is left of
    it goes through that buffer, so every byte arrives once and in order."""
    taken: list[int] = []
    next_message = yamux_fast._next_message

    async def counted(reader: Any) -> bytes | None:
        got = await next_message(reader)
        taken.append(0 if got is None else len(got) - yamux_fast.HEADER_SIZE)
        return got

    monkeypatch.setattr(yamux_fast, "_next_message", counted)
    async with libp2p_stream() as (ours, theirs):
        noise = ours.muxed_conn.secured_conn.conn
        stream_id = ours.muxed_stream.stream_id
        rng = random.Random(5)
        bodies = [bytes([65 + i % 26]) * rng.randrange(1, 700) for i in range(60)]
        frames: list[bytes] = []
        for i, body in enumerate(bodies):
            frames.append(frame(TYPE_DATA, 0, stream_id, len(body), body))
            if i % 7 == 3:
                frames.append(frame(TYPE_WINDOW_UPDATE, 0, stream_id, 1))
        # One to four frames a message; every fifth message ends inside a frame, which
        # the next one finishes.
        pieces: list[bytes] = []
        carry = b""
        while frames:
            count = rng.randrange(1, 5)
            group, frames = carry + b"".join(frames[:count]), frames[count:]
            carry = b""
            if len(pieces) % 5 == 4 and frames:
                cut = rng.randrange(1, len(frames[0]))
                group, carry, frames = group + frames[0][:cut], frames[0][cut:], frames[1:]
            pieces.append(group)
        if carry:
            pieces.append(carry)
        joined = bytearray()
        for piece in pieces:
            message = noise.encrypt(piece)
            joined += len(message).to_bytes(2, "big") + message
        # One frame a message, as DirectWriter sends them; then a header in two.
        last = frame(TYPE_DATA, 0, stream_id, 5, b"split")
        for data in (frame(TYPE_DATA, 0, stream_id, 5, b"whole"), last[:5], last[5:]):
            message = noise.encrypt(data)
            joined += len(message).to_bytes(2, "big") + message
        await noise.read_writer.read_write_closer.write(bytes(joined))
        expected = b"".join(bodies) + b"wholesplit"
        received = bytearray()
        with trio.fail_after(10):
            while len(received) < len(expected):
                received += await theirs.read(1 << 20)
        assert bytes(received) == expected
        assert any(size > 0 for size in taken)  # more than a header, taken apart here
