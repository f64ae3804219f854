"""protocol/p2p.py's patches of py-libp2p 0.8.1: guarded by the version, and each doing
what it says. (Frames through the patched stack: tests/test_link.py.)"""

from __future__ import annotations

import os
import select
import socket
import struct

import multiaddr
import pytest
import trio
import trio.testing
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.io.trio import TrioTCPStream
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.stream_muxer.yamux.yamux import TYPE_PING, YAMUX_HEADER_FORMAT, Yamux

from protocol import p2p
from tests.link_peers import libp2p_stream
from tests.scheduler_passes import passes_of_this_task


def test_patches_refuse_another_libp2p_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p2p, "libp2p_version", lambda: "0.8.2")
    with pytest.raises(RuntimeError, match=r"0\.8\.1"):
        p2p.tune_libp2p()


async def test_one_socket_read_serves_several_small_reads() -> None:
    p2p.tune_libp2p()
    ours, theirs = trio.testing.memory_stream_pair()
    calls = 0
    receive = ours.receive_stream.receive_some

    async def counted(max_bytes: int | None = None) -> bytes:
        nonlocal calls
        calls += 1
        return await receive(max_bytes)

    ours.receive_stream.receive_some = counted  # type: ignore[method-assign]
    conn = TrioTCPStream(ours)  # type: ignore[arg-type]
    await theirs.send_all(b"\x00\x05hello\x00\x03abc")
    await trio.testing.wait_all_tasks_blocked()
    assert await conn.read(2) == b"\x00\x05"
    assert await conn.read(5) == b"hello"
    assert await conn.read(0) == b""
    assert await conn.read() == b"\x00\x03abc"
    assert calls == 1
    await theirs.send_eof()
    assert await conn.read(2) == b""


async def test_buffered_read_keeps_libp2p_errors() -> None:
    p2p.tune_libp2p()

    class Broken(trio.abc.Stream):
        async def receive_some(self, max_bytes: int | None = None) -> bytes:
            raise trio.BrokenResourceError("reset")

        async def send_all(self, data: bytes | bytearray | memoryview) -> None:
            raise trio.BrokenResourceError("reset")

        async def wait_send_all_might_not_block(self) -> None:
            return

        async def aclose(self) -> None:
            return

    with pytest.raises(ConnectionClosedError):
        await TrioTCPStream(Broken()).read(12)  # type: ignore[arg-type]
    ours, _ = trio.testing.memory_stream_pair()
    conn = TrioTCPStream(ours)  # type: ignore[arg-type]
    await ours.aclose()
    assert await conn.read(12) == b""


async def _tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    ours = await trio.open_tcp_stream("127.0.0.1", port)
    theirs = await listener.accept()
    await listener.aclose()
    return ours, theirs


async def test_buffered_read_over_a_socket_waits_reads_and_ends_as_libp2p_does() -> None:
    """Over a real socket, a read waits for data, takes what arrived, and ends as
    py-libp2p's own read ends."""
    p2p.tune_libp2p()
    ours, theirs = await _tcp_pair()
    conn = TrioTCPStream(ours)
    got: list[bytes] = []

    async def read_one() -> None:
        got.append(await conn.read(2))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_one)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # nothing arrived yet: the read waits
        await theirs.send_all(b"\x00\x05hello")
    assert got == [b"\x00\x05"]
    assert await conn.read(5) == b"hello"
    await theirs.aclose()
    assert await conn.read(2) == b""  # the peer's close is the end of file

    # A reset by the peer is py-libp2p's ConnectionClosedError.
    ours, theirs = await _tcp_pair()
    conn = TrioTCPStream(ours)
    theirs.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await theirs.aclose()
    with pytest.raises(ConnectionClosedError):
        with trio.fail_after(10):
            while await conn.read(12):
                pass

    # Our own close, under a read that waits, reads as the end of file.
    ours, theirs = await _tcp_pair()
    conn = TrioTCPStream(ours)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_one)
        await trio.testing.wait_all_tasks_blocked()
        await ours.aclose()
    assert got[-1] == b""
    assert await conn.read(2) == b""  # and so does a read after it
    await theirs.aclose()


class _CountedReads:
    """A stdlib socket's stand-in that counts the reads tried on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reads = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv(self, size: int) -> bytes:
        self.reads += 1
        return self.sock.recv(size)


async def test_a_socket_read_waits_first_after_a_short_read_and_reads_first_after_a_full_one() -> (
    None
):
    """After a short read (the kernel held no more), the next read waits for data and
    then reads once: no read that fails first, and one pass through the scheduler, its
    wake-up. After a full read, the sign of a flood, the next reads at once but still
    passes through the scheduler once, and is a checkpoint: a flooding peer starves
    neither the other tasks nor a cancellation."""
    p2p.tune_libp2p()
    ours, theirs = await _tcp_pair()
    counted = _CountedReads(ours.socket._sock)  # type: ignore[attr-defined]
    ours.socket._sock = counted  # type: ignore[attr-defined]
    conn = TrioTCPStream(ours)
    got: list[tuple[int, int, int]] = []

    async def read(n: int | None = None) -> None:
        before = counted.reads
        with passes_of_this_task() as passes:
            data = await conn.read(n)
        got.append((len(data), counted.reads - before, passes.count))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        await theirs.send_all(b"hello")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        await theirs.send_all(b"again")
    assert got == [(5, 1, 1), (5, 1, 1)]

    full = p2p.SOCKET_READ_BYTES
    async with trio.open_nursery() as nursery:
        nursery.start_soon(theirs.send_all, b"x" * (full * 4))
        with trio.fail_after(10):
            while True:  # until a read takes a full buffer
                await read(full)
                if got[-1][0] == full:
                    break
        with trio.CancelScope() as scope:
            scope.cancel()
            await conn.read(full)
        assert scope.cancelled_caught
        await trio.lowlevel.wait_readable(counted.sock)  # data there for the next read
        await read(full)
        assert got[-1][0] > 0
        assert got[-1][1:] == (1, 1)  # read at once, with no wait for data, after one pass
        nursery.cancel_scope.cancel()
    ours.socket._sock = counted.sock  # type: ignore[attr-defined]
    await ours.aclose()
    await theirs.aclose()


async def test_write_takes_a_free_lock_without_a_scheduler_pass_and_keeps_errors() -> None:
    """The patched TrioTCPStream.write: with its lock free and room in the kernel, the
    bytes are on the socket and the writer has not yielded; with the lock held, the
    write waits for it; a reset is ConnectionClosedError and a write after our own
    close is dropped, as py-libp2p's."""
    p2p.tune_libp2p()
    ours, theirs = await _tcp_pair()
    conn = TrioTCPStream(ours)
    order: list[str] = []

    async def other() -> None:
        arrived = select.poll()
        arrived.register(theirs.socket.fileno(), select.POLLIN)
        order.append("bytes there" if arrived.poll(0) else "nothing yet")

    async def write(data: bytes) -> None:
        await conn.write(data)
        order.append(f"wrote {data.decode()}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        with passes_of_this_task() as passes:
            await conn.write(b"one")
        assert passes.count == 0  # the writer never went back to the scheduler
    assert order == ["bytes there"]
    assert await theirs.receive_some(10) == b"one"

    await conn.write_lock.acquire()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(write, b"two")
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["bytes there"]  # waiting for the lock
        conn.write_lock.release()
    assert order[-1] == "wrote two"
    assert await theirs.receive_some(10) == b"two"

    theirs.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await theirs.aclose()
    with pytest.raises(ConnectionClosedError), trio.fail_after(10):
        while True:
            await conn.write(b"x" * 65536)
            await trio.sleep(0.01)
    await ours.aclose()
    await conn.write(b"after close")  # dropped, as py-libp2p drops it
    assert not conn.write_lock.locked()


async def test_write_larger_than_the_kernels_room_waits_and_keeps_order() -> None:
    """What the socket takes at once goes straight; the rest waits for room through
    trio, and the peer gets every byte in order."""
    p2p.tune_libp2p()
    ours, theirs = await _tcp_pair()
    ours.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    conn = TrioTCPStream(ours)
    data = bytes(range(256)) * (16 * 1024)  # 4 MiB, far past the buffers
    got = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.write, data)
        await trio.testing.wait_all_tasks_blocked()
        assert conn.write_lock.locked()  # parked in trio's wait for room
        with trio.fail_after(10):
            while len(got) < len(data):
                got += await theirs.receive_some(65536)
    assert bytes(got) == data
    assert not conn.write_lock.locked()
    await conn.write(b"next")
    assert await theirs.receive_some(10) == b"next"
    await ours.aclose()
    await theirs.aclose()


async def test_yamux_sends_no_rtt_pings_but_answers_them(monkeypatch: pytest.MonkeyPatch) -> None:
    p2p.tune_libp2p()
    pings: list[int] = []
    write_frame = Yamux._write_frame

    async def recording(self: Yamux, data: bytes) -> None:
        _, kind, flags, _, _ = struct.unpack(YAMUX_HEADER_FORMAT, data[:12])
        if kind == TYPE_PING:
            pings.append(flags)
        await write_frame(self, data)

    monkeypatch.setattr(Yamux, "_write_frame", recording)
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    server = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=listen)
    client = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=[])
    async with server.run(listen_addrs=listen), client.run(listen_addrs=[]):
        info = info_from_p2p_addr(server.get_addrs()[0])
        await client.connect(info)
        # py-libp2p's first RTT ping would leave 0.5 s after the connection opens.
        await trio.sleep(1.5)
        assert pings == []
        muxer = client.get_network().get_connections(info.peer_id)[0].muxed_conn
        # A peer's ping (here the client's own, sent by hand) is still answered: the
        # answer sets the event py-libp2p's own pinger would wait on.
        await write_frame(muxer, struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_PING, 1, 0, 7))
        with trio.fail_after(10):
            await muxer._ping_event.wait()
        assert pings == [2]  # the server's answer (ACK)
        await client.close()
        await server.close()


async def test_hooks_run_before_each_socket_read_once_all_it_brought_is_read() -> None:
    p2p.tune_libp2p()
    ours, theirs = trio.testing.memory_stream_pair()
    conn = TrioTCPStream(ours)  # type: ignore[arg-type]
    calls: list[int] = []

    class Layer:  # what a libp2p stream's layers look like from above
        def __init__(self, below: object) -> None:
            self.secured_conn = below

    unhook = p2p.before_reads(Layer(conn), lambda: calls.append(1))
    assert unhook is not None
    await theirs.send_all(b"\x00\x05hello\x00\x03abc")
    await trio.testing.wait_all_tasks_blocked()
    assert await conn.read(2) == b"\x00\x05"
    assert calls == [1]  # before the socket read
    assert await conn.read(5) == b"hello"
    assert await conn.read() == b"\x00\x03abc"
    assert calls == [1]  # the same read's bytes: no socket read, no call
    await theirs.send_all(b"more")
    assert await conn.read() == b"more"
    assert calls == [1, 1]
    unhook()
    await theirs.send_all(b"again")
    assert await conn.read() == b"again"
    assert calls == [1, 1]
    assert p2p.before_reads(Layer(None), lambda: None) is None  # no TCP below (WebSocket)


async def test_a_link_stream_finds_its_connection_for_read_hooks() -> None:
    async with libp2p_stream() as (stream, theirs):
        calls: list[int] = []
        unhook = p2p.before_reads(stream, lambda: calls.append(1))
        assert unhook is not None
        await theirs.write(b"pong")
        assert await stream.read(4) == b"pong"
        assert calls  # this connection's reader came back to its socket
        unhook()
