"""Lean per-frame paths for py-libp2p 0.8.1's yamux over Noise (installed by
`protocol.p2p.tune_libp2p`, which checks the version first).

Measured with `python -m bench.frames` and `bench.fleet`: each frame crossed about a
dozen `trio.Lock` acquisitions (each a pass through trio's scheduler, even when nobody
else wants the lock), formatted about fifteen debug f-strings whether or not debug
logging is on, and armed a timeout for a body already in memory. Every section those
locks guard is synchronous, so in trio (one thread, switches only at `await`) the
replacements below keep the same guarantees without them:

- the common frames (DATA and WINDOW_UPDATE without flags, on an open stream) are taken
  off the connection before py-libp2p's frame loop sees them; everything else (stream
  opening and closing, resets, pings, GO_AWAY, errors) still goes through its code;
- a stream write that fits its send window and one yamux frame is one frame write;
- a stream read returns buffered bytes without the connection lock and logging;
- a Noise message that one socket read brought whole is decrypted straight from that
  read, and a DATA frame's body taken from its header's message, without py-libp2p's
  layers of reads between them (bench.frames: 138-217 to 132-183 µs per frame, both
  sides, four interleaved pairs on a loaded host), and one that starts at a frame
  boundary is taken apart by the muxer's task without the session's buffer
  (`_next_message`);
- the connection's write lock and the socket's read lock are taken without a
  scheduler pass when they are free, and so is each libp2p stream's state lock, which
  its every write took first (one task step more before each frame batch left);
- a session's write that fits one yamux frame and one Noise message goes to the socket
  without py-libp2p's layers of writes (`DirectWriter`).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import Any

import trio
from libp2p.io import utils as io_utils
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.io.trio import TrioTCPStream
from libp2p.network.stream.net_stream import NetStream, StreamState
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, NoiseTransportReadWriter
from libp2p.stream_muxer.exceptions import MuxedStreamEOF, MuxedStreamReset
from libp2p.stream_muxer.yamux import yamux as yamux_module
from libp2p.stream_muxer.yamux.yamux import (
    HEADER_SIZE,
    MAX_MESSAGE_SIZE,
    MAX_WINDOW_SIZE,
    TYPE_DATA,
    TYPE_WINDOW_UPDATE,
    YAMUX_HEADER_FORMAT,
    Yamux,
    YamuxStream,
)

from protocol.sockets import send_at_once, stdlib_socket

_HEADER = struct.Struct(YAMUX_HEADER_FORMAT)
_MAX_DATA = MAX_MESSAGE_SIZE - HEADER_SIZE
# The attribute on a connection's secured session naming its muxer, for the header hook.
_MUXER = "_hivenet_muxer"
# The attribute on a yamux stream naming where its DATA goes instead of its buffer.
_SINK = "_hivenet_sink"
# The attribute on a TCP connection holding what its next write must send first.
_OWED = "_hivenet_owed"

_WRITABLE = (StreamState.INIT, StreamState.OPEN, StreamState.CLOSE_READ)
_NOISE_PREFIX = 2

_original_write = YamuxStream.write
_original_handle_incoming = Yamux.handle_incoming
_original_noise_read = NoiseTransportReadWriter.read_msg
_NOISE_LENGTH = 2


async def acquire(lock: trio.Lock) -> None:
    """`lock.acquire()`, minus the scheduler pass when the lock is free."""
    if lock.locked():
        await lock.acquire()
    else:
        lock.acquire_nowait()


def deliver_to(stream: Any, sink: Callable[[bytes], object] | None) -> bool:
    """Have the muxer hand a yamux stream's DATA bytes straight to `sink`, in order,
    from its own task, instead of buffering them for a read; None undoes it. False (and
    nothing changed) when the stream is not yamux, is closing, or holds bytes not yet
    read: those must reach the reader first, so the caller reads and asks again.
    `sink` must not block; the stream's reads then see only its end or reset."""
    muxed = getattr(stream, "muxed_stream", stream)
    if not isinstance(muxed, YamuxStream):
        return False
    if sink is None:
        setattr(muxed, _SINK, None)
        return True
    buffer = muxed.conn.stream_buffers.get(muxed.stream_id)
    if buffer is None or buffer or muxed.recv_closed or muxed.closed:
        return False
    setattr(muxed, _SINK, sink)
    return True


class DirectWriter:
    """Writes a libp2p stream's small writes as one yamux frame in one Noise message
    straight to the socket, where py-libp2p's write passes through seven layers of
    coroutines and three locks (a session's writer task: protocol/p2p.py `_writer`).

    It does what those layers do, in the same order: the stream's state and window
    checked, the yamux header, the window taken, the Noise message sealed and handed to
    the kernel. A write it cannot make so (a stream not open for writing, a lock held,
    too little window, more than one Noise message) is left to py-libp2p's path.
    bench.stream_relay: 6 to 8% of either daemon's CPU for a lone request, where each
    write is one frame; 0 to 3% at 64 clients, where one write carries several."""

    __slots__ = ("muxed", "muxer", "net", "noise", "socket", "tcp")

    def __init__(
        self,
        net: NetStream,
        muxed: YamuxStream,
        noise: NoiseTransportReadWriter,
        tcp: TrioTCPStream,
        sock: socket.socket,
    ) -> None:
        self.net = net
        self.muxed = muxed
        self.muxer = muxed.conn
        self.noise = noise
        self.tcp = tcp
        self.socket = sock

    @classmethod
    def of(cls, stream: Any) -> DirectWriter | None:
        """The direct path for a stream over yamux, Noise and TCP; None for any other
        (WebSocket, a test's stream)."""
        if not isinstance(stream, NetStream):
            return None
        muxed = stream.muxed_stream
        if not isinstance(muxed, YamuxStream):
            return None
        noise = getattr(muxed.conn.secured_conn, "conn", None)
        if not isinstance(noise, NoiseTransportReadWriter):
            return None
        tcp = getattr(noise.read_writer.read_write_closer, "stream", None)
        if not isinstance(tcp, TrioTCPStream):
            return None
        sock = stdlib_socket(tcp.stream)
        return None if sock is None else cls(stream, muxed, noise, tcp, sock)

    async def write(self, data: bytes) -> bool:
        """Write `data`; False when it must take py-libp2p's way (nothing was done).

        What the kernel has no room for is then written through the connection's own
        write, under its lock, before anything else can go on the connection: there is
        no await between sealing the message and taking that lock."""
        if not self.write_now(data):
            return False
        if owed(self.tcp):
            await self.tcp.write(b"")
        return True

    def write_now(self, data: bytes) -> bool:
        """Seal `data` and hand it to the kernel without waiting; False when it must take
        py-libp2p's way (nothing was done). What the kernel had no room for, or all of
        it after a socket error, is owed on the connection (`owe`): its next write, which
        meets the error as its own, sends it first. Never raises but as sealing does."""
        muxed, tcp = self.muxed, self.tcp
        size = len(data)
        if (
            not 0 < size <= MAX_PLAINTEXT_LENGTH - HEADER_SIZE
            or size > muxed.send_window
            or muxed.send_closed
            or muxed.closed
            or self.net._state not in _WRITABLE
            or self.net._state_lock.locked()
            or self.muxer._write_lock.locked()
            or tcp.write_lock.locked()
            or owed(tcp)
        ):
            return False
        muxed.send_window -= size
        sealed = self.noise.encrypt(_HEADER.pack(0, TYPE_DATA, 0, muxed.stream_id, size) + data)
        message = len(sealed).to_bytes(_NOISE_PREFIX, "big") + sealed
        try:
            sent = send_at_once(self.socket, message)
        except OSError:
            sent = 0
        if sent < len(message):
            owe(tcp, message[sent:])
        return True


def owed(tcp: TrioTCPStream) -> bytes:
    """What a connection's next write must send before its own bytes (`owe`)."""
    return getattr(tcp, _OWED, b"")


def owe(tcp: TrioTCPStream, data: bytes) -> None:
    """Bytes of a sealed message that must go on the connection before any other:
    protocol/p2p.py's `_write` sends them first, under the connection's write lock."""
    setattr(tcp, _OWED, data)


class PasslessLock:
    """A trio.Lock for `async with` that takes a free lock without a scheduler pass.
    (trio.Lock cannot be subclassed.)"""

    __slots__ = ("lock",)

    def __init__(self) -> None:
        self.lock = trio.Lock()

    def locked(self) -> bool:
        return self.lock.locked()

    async def __aenter__(self) -> None:
        await acquire(self.lock)

    async def __aexit__(self, *exc_info: object) -> None:
        self.lock.release()


_original_net_stream_init = NetStream.__init__


def _net_stream_init(self: NetStream, *args: Any, **kwargs: Any) -> None:
    _original_net_stream_init(self, *args, **kwargs)
    # It serializes checks and updates of the stream's state as before; only the pass
    # through the scheduler on a free lock goes.
    self._state_lock = PasslessLock()  # type: ignore[assignment]


def install() -> None:
    NetStream.__init__ = _net_stream_init  # type: ignore[method-assign]
    YamuxStream.write = _stream_write  # type: ignore[method-assign]
    Yamux._write_frame = _write_frame  # type: ignore[method-assign]
    Yamux.read_stream = _read_stream  # type: ignore[method-assign]
    Yamux.handle_incoming = _handle_incoming  # type: ignore[method-assign]
    Yamux._read_data_body = _read_data_body  # type: ignore[method-assign]
    # py-libp2p's frame loop reads each header through this module-level name (and,
    # with `_read_data_body` replaced, only headers).
    yamux_module.read_exactly = _next_header
    NoiseTransportReadWriter.read_msg = _noise_read_msg  # type: ignore[method-assign]


async def _noise_read_msg(self: NoiseTransportReadWriter, prefix_encoded: bool = False) -> bytes:
    """A Noise message that one socket read brought whole is taken from that read's
    buffer (protocol/p2p.py `_buffered_read`) and decrypted, without the eight layers
    of calls, two lock acquisitions and three debug f-strings of py-libp2p's path; any
    other (split across reads, or at the end of the stream) goes that way."""
    raw = self.read_writer.read_write_closer
    tcp = getattr(raw, "stream", None)
    if not prefix_encoded and isinstance(tcp, TrioTCPStream) and not tcp.read_lock.locked():
        pending: bytes = getattr(tcp, "_hivenet_pending", b"")
        if not pending:
            # Errors as py-libp2p's own read raises them; the bytes go back unread.
            pending = await raw.read(None)
            tcp._hivenet_pending = pending  # type: ignore[attr-defined]
        if len(pending) >= _NOISE_LENGTH:
            end = _NOISE_LENGTH + int.from_bytes(pending[:_NOISE_LENGTH], "big")
            if len(pending) >= end:
                tcp._hivenet_pending = pending[end:]  # type: ignore[attr-defined]
                return self.decrypt(pending[_NOISE_LENGTH:end])
    return await _original_noise_read(self, prefix_encoded)


async def _write_frame(self: Yamux, data: bytes) -> None:
    lock = self._write_lock
    await acquire(lock)
    try:
        await self.secured_conn.write(data)
    finally:
        lock.release()


async def _stream_write(self: YamuxStream, data: bytes) -> None:
    size = len(data)
    if 0 < size <= _MAX_DATA and size <= self.send_window and not (self.send_closed or self.closed):
        self.send_window -= size
        await self.conn._write_frame(_HEADER.pack(0, TYPE_DATA, 0, self.stream_id, size) + data)
        return
    # Larger than one frame, a window to wait for, or a closed stream: py-libp2p's way.
    await _original_write(self, data)


def _take(buffer: bytearray, n: int) -> bytes:
    if n == -1 or n >= len(buffer):
        data = bytes(buffer)
        buffer.clear()
    else:
        data = bytes(buffer[:n])
        del buffer[:n]
    return data


async def _read_stream(self: Yamux, stream_id: int, n: int | None = -1) -> bytes:
    """py-libp2p's `read_stream`, with the same outcomes in the same order."""
    if n is None:
        n = -1
    while True:
        stream = self.streams.get(stream_id)
        if stream is None:
            raise MuxedStreamEOF("Stream closed")
        if self.event_shutting_down.is_set():
            raise MuxedStreamEOF("Connection shut down")
        buffer = self.stream_buffers.get(stream_id)
        if buffer is None:
            if stream.reset_received:
                raise MuxedStreamReset("Stream was reset")
            raise MuxedStreamEOF("Stream buffer closed")
        if buffer and (stream.recv_closed or not stream.reset_received):
            data = _take(buffer, n)
            if stream.closed:
                self._finalize_stream_locked(stream, fully_closed=True)
            return data
        if stream.reset_received:
            raise MuxedStreamReset("Stream was reset")
        if stream.recv_closed:
            raise MuxedStreamEOF("Stream is closed for receiving")
        if stream.closed:
            raise MuxedStreamReset("Stream is reset or closed")
        try:
            await self.stream_events[stream_id].wait()
            self.stream_events[stream_id] = trio.Event()
        except KeyError:
            raise MuxedStreamEOF("Stream was removed") from None


async def _handle_incoming(self: Yamux) -> None:
    setattr(self.secured_conn, _MUXER, self)
    await _original_handle_incoming(self)


def _decrypted(reader: Any, n: int) -> bytes | None:
    """`n` bytes from what a Noise session already holds decrypted, or None when it
    holds fewer (or is not one). A DATA frame's body comes in the Noise message of its
    header, and taking it here skips `read_exactly`'s and `SecureSession.read`'s layers."""
    low = getattr(reader, "low_watermark", None)
    if low is None or reader.high_watermark - low < n:
        return None
    return reader._drain(n)


async def _read_data_body(self: Yamux, length: int) -> bytes:
    reader = self.secured_conn
    data = _decrypted(reader, length)
    if data is not None:
        return data
    with trio.fail_after(yamux_module._yamux_data_read_timeout()):
        return await io_utils.read_exactly(reader, length)


async def _next_message(reader: Any) -> bytes | None:
    """The connection's next Noise message, read and decrypted without `read_exactly`'s
    and `SecureSession.read`'s layers or the session's buffer; None (nothing read) where
    that path does not apply: a reader that is not a Noise session, or one that still
    holds decrypted bytes."""
    noise = getattr(reader, "conn", None)
    if not isinstance(noise, NoiseTransportReadWriter) or getattr(
        reader, "high_watermark", None
    ) != getattr(reader, "low_watermark", 0):
        return None
    message = await _noise_read_msg(noise)
    if not message:
        raise ConnectionClosedError("Connection closed")  # as SecureSession.read
    return message


async def _next_header(
    reader: Any, n: int, retry_count: int = io_utils.DEFAULT_RETRY_READ_COUNT
) -> bytes:
    """The next header py-libp2p's frame loop has to handle itself.

    Common frames are applied here, as that loop would apply them, and never reach it.
    A Noise message that holds a header and its DATA body whole (what the other side's
    `DirectWriter` sends) is taken apart here, each piece sliced from it once, without
    the session's buffer; what is left of a message goes back to that buffer before
    anything else reads it.
    """
    muxer: Yamux | None = getattr(reader, _MUXER, None)
    while True:
        # A message taken whole, and how much of it has been taken.
        message, taken = b"", 0
        header = _decrypted(reader, n)
        if header is None:
            whole = await _next_message(reader)
            if whole is None:
                header = await io_utils.read_exactly(reader, n, retry_count)
            elif len(whole) < n:
                reader._fill(whole)
                header = await io_utils.read_exactly(reader, n, retry_count)
            else:
                message, taken = whole, n
                header = whole[:n]
        if muxer is None or n != HEADER_SIZE:
            _put_back(reader, message, taken)
            return header
        version, kind, flags, stream_id, length = _HEADER.unpack(header)
        stream = muxer.streams.get(stream_id)
        if version or flags or stream is None or stream.closed or stream.recv_closed:
            _put_back(reader, message, taken)
            return header
        if kind == TYPE_WINDOW_UPDATE:
            stream.send_window += length
            _put_back(reader, message, taken)
        elif kind == TYPE_DATA and 0 < length <= MAX_WINDOW_SIZE:
            if len(message) - taken >= length:
                data = message[taken : taken + length]
                _put_back(reader, message, taken + length)
            else:
                _put_back(reader, message, taken)
                data = await muxer._read_data_body(length)
            # The stream may have gone while the body was read: its bytes go with it.
            if muxer.streams.get(stream_id) is stream:
                stream.recv_window = max(0, stream.recv_window - length)
                sink = getattr(stream, _SINK, None)
                if sink is None:
                    muxer.stream_buffers[stream_id].extend(data)
                    muxer.stream_events[stream_id].set()
                else:
                    # Taken as a read would take them, window credit included.
                    sink(data)
                    await stream._auto_tune_and_send_window_update(bytes_read=length)
        else:
            _put_back(reader, message, taken)
            return header


def _put_back(reader: Any, message: bytes, taken: int) -> None:
    """What is left of a message taken whole (`_next_message`) into the session's
    buffer, then empty, for the next read."""
    if taken < len(message):
        reader._fill(message[taken:])
