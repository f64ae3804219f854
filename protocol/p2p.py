"""libp2p pieces both daemons use: identity keys, quiet logging, the framed stream.

py-libp2p 0.8.1 interleaves concurrent large writes and kills a stream whose reader
stalls (see shared/notes/py-libp2p.md), so each side of a session has exactly one
writer task, which drains a queue and joins frames into large writes, and exactly one
reader task, which only decodes and dispatches. (On the agent's side, frames queued
while the writer waits are written in its stead when the scheduler's batch ends,
`_BatchEnd`; what cannot go so is still the writer's.)
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import socket
import stat
from collections import deque
from collections.abc import Callable
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import msgpack
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.io.trio import TrioTCPStream
from libp2p.peer.id import ID
from libp2p.stream_muxer.yamux import yamux as yamux_module
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream

from protocol import yamux_fast
from protocol.files import read_regular
from protocol.frames import MAX_FRAME_BYTES, FrameDecoder, encode_frame
from protocol.sockets import receive_when_ready, send_at_once, stdlib_socket

WRITE_BATCH_BYTES = 256 * 1024
READ_BYTES = 256 * 1024
# One socket read takes what the kernel holds, up to this; the Noise and yamux layers
# above then take their small pieces from it instead of a syscall each.
SOCKET_READ_BYTES = 64 * 1024
SEED_BYTES = 32
PATCHED_LIBP2P = "0.8.1"
FLUSH_TIMEOUT = 1.0
# A session's msgpack packer starts with this much buffer and is replaced after a
# frame larger than it (heartbeats, heads, stream events and ends fit). msgpack's own
# 256 KiB cost a router some 4 MiB per 1,000 idle agent sessions.
PACK_BUFFER_BYTES = 4 * 1024


def libp2p_version() -> str:
    return version("libp2p")


def load_or_create_identity(path: str | os.PathLike[str]) -> KeyPair:
    """Ed25519 key from a 32-byte seed file, created 0600 on first use."""
    p = Path(path)
    if p.exists():
        # A FIFO or a device at the path must not hang or fill a starting daemon.
        seed = read_regular(p, 64 * SEED_BYTES)
        if len(seed) != SEED_BYTES:
            raise ValueError(f"identity file {p} holds {len(seed)} bytes, expected {SEED_BYTES}")
        mode = stat.S_IMODE(p.stat().st_mode)
        if mode & 0o077:
            # Whoever reads it can be this peer; still its key, so the daemon starts.
            logging.getLogger("identity").warning(
                "identity_file_readable path=%r mode=%04o want=0600", str(p), mode
            )
    else:
        p.parent.mkdir(parents=True, exist_ok=True)
        seed = os.urandom(SEED_BYTES)
        # Written whole under another name, then linked into place: a key file created
        # and then cut short (a full disk, a crash, a power cut before the data reached
        # the disk) held fewer than 32 bytes, and every later start stopped on it.
        draft = p.with_name(f".{p.name}.{os.getpid()}.partial")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(seed)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(draft, p)
            except FileExistsError:  # another process made it first: theirs is the key
                return load_or_create_identity(p)
        finally:
            draft.unlink()
        _fsync_directory(p.parent)
    return create_new_key_pair(seed)


def _fsync_directory(path: Path) -> None:
    """Make a new name in `path` survive a power cut (the file's data already has)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def peer_id_of(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)


def tune_libp2p() -> None:
    """Cut py-libp2p 0.8.1's cost per frame: fewer frames, fewer socket reads.

    - yamux answers every read with a WINDOW_UPDATE frame (and reads its tuning from
      the environment on each call), so every heartbeat cost the receiver a write.
      Releasing once half the window is consumed keeps flow control intact (a sender
      always has at least half a window) at a fraction of the frames, as go-yamux does.
    - yamux pings each connection every 30 s both ways, only to feed that window
      tuning an RTT: with the tuning replaced, the pings (a quarter of an idle
      session's frames at the default heartbeat) measure nothing. Pings from a peer
      are still answered.
    - Each connection sweeps its closed streams every 30 s from when it opened: the
      connections of a fleet that joined together (a router restarted) swept in the
      same turn of the router's loop, hundreds at a time (3 ms and more). The first
      sweep now comes at a random point of the first interval.
    - Each Noise message is read from the socket in two reads (its 2-byte length,
      then its body): one read now takes what the kernel holds, and the layers above
      take their pieces from that buffer. trio's read then passed through the
      scheduler once more; ours does not.
    - Each socket write took its lock through trio's `Lock.acquire`, and went through
      trio's `send_all`, each a pass through the scheduler even when the lock is free
      and the kernel has room: two more task steps for every frame batch, on the
      critical path of each request and answer.
    """
    if libp2p_version() != PATCHED_LIBP2P:
        raise RuntimeError(f"protocol/p2p.py patches py-libp2p {PATCHED_LIBP2P} yamux internals")
    YamuxStream._auto_tune_and_send_window_update = _release_in_batches  # type: ignore[method-assign]
    Yamux._measure_rtt_loop = _no_rtt_pings  # type: ignore[method-assign]
    Yamux._stale_stream_sweeper = _stale_stream_sweeper  # type: ignore[method-assign]
    TrioTCPStream.read = _buffered_read  # type: ignore[method-assign]
    TrioTCPStream.write = _write  # type: ignore[method-assign]
    yamux_fast.install()


async def _release_in_batches(self: YamuxStream, *, bytes_read: int = 0) -> None:
    # No await before the update is sent: the window lock would guard nothing here.
    self._pending_recv_release += bytes_read
    pending = self._pending_recv_release
    if pending < self.target_recv_window // 2:
        return
    self._pending_recv_release = 0
    self.recv_window += pending
    await self.send_window_update(pending, skip_lock=True)


async def _no_rtt_pings(self: Yamux) -> None:
    return


async def _stale_stream_sweeper(self: Yamux) -> None:
    """py-libp2p's sweep of a connection's closed streams, every 30 s as before, its
    phase drawn at random instead of the connection's start."""
    interval = yamux_module._STALE_STREAM_SWEEP_INTERVAL
    delay = random.uniform(0, interval)
    while not self.event_shutting_down.is_set():
        await trio.sleep(delay)
        delay = interval
        if self.event_shutting_down.is_set():
            break
        async with self.streams_lock:
            self._sweep_stale_streams()


async def _buffered_read(self: TrioTCPStream, n: int | None = None) -> bytes:
    """TrioTCPStream.read, served from one large socket read while it lasts.

    Errors as py-libp2p's own: a reset is ConnectionClosedError, a stream closed
    here reads as end of file.
    """
    lock = self.read_lock
    await yamux_fast.acquire(lock)
    try:
        if n == 0:
            return b""
        pending: bytes = getattr(self, "_hivenet_pending", b"")
        if not pending:
            for hook in getattr(self, "_hivenet_before_reads", ()):
                hook()
            try:
                pending = await _receive(self, max(n or 0, SOCKET_READ_BYTES))
            except (trio.BrokenResourceError, OSError) as exc:  # OSError: ours, as trio's
                raise ConnectionClosedError(
                    f"TCP connection reset by remote peer: {exc}", transport="tcp"
                ) from exc
            except trio.ClosedResourceError:
                return b""
        if n is None or len(pending) <= n:
            self._hivenet_pending = b""
            return pending
        self._hivenet_pending = pending[n:]
        return pending[:n]
    finally:
        lock.release()


async def _receive(self: TrioTCPStream, size: int) -> bytes:
    """One socket read: trio's `receive_some`, less its pass through the scheduler
    after a read that found data, which is one task step more before each frame batch
    reaches the muxer.

    A short read means the kernel held nothing more, so the next waits for data first
    instead of trying a read that would fail. After a full read the next reads at once,
    behind a checkpoint, so a peer that floods the connection still lets others run.
    """
    raw = stdlib_socket(self.stream)
    if raw is None:
        return await self.stream.receive_some(size)
    if raw.fileno() < 0:  # closed here
        return b""
    try:
        if getattr(self, "_hivenet_drained", True):
            data = await receive_when_ready(raw, size)
        else:
            await trio.lowlevel.checkpoint()
            try:
                data = raw.recv(size)
            except BlockingIOError:
                data = await receive_when_ready(raw, size)
    except OSError:
        if raw.fileno() < 0:
            return b""
        raise
    self._hivenet_drained = len(data) < size  # type: ignore[attr-defined]
    return data


async def _write(self: TrioTCPStream, data: bytes) -> None:
    """TrioTCPStream.write, straight to the socket while the kernel has room, its lock
    taken without a scheduler pass when it is free.

    trio's `send_all` passes through the scheduler after every write that went out
    whole: one task step more per frame batch, on the critical path of each request
    (router) and of each piece of a streamed answer (agent). The writer's next wait on
    its queue is its schedule point. Only what the kernel has no room for goes through
    trio, which waits for room.

    Errors as py-libp2p's own: a reset is ConnectionClosedError, a write to a stream
    closed here is dropped.
    """
    lock = self.write_lock
    await yamux_fast.acquire(lock)
    try:
        if owed := yamux_fast.owed(self):
            # A session's write at the end of a batch the kernel could not take whole
            # (FramedStream.flush_held): its rest goes first.
            yamux_fast.owe(self, b"")
            data = owed + data
        if not data:
            return
        raw = stdlib_socket(self.stream)
        if raw is not None:
            try:
                sent = send_at_once(raw, data)
            except OSError as exc:
                if raw.fileno() < 0:  # closed here
                    return
                raise ConnectionClosedError(
                    f"TCP connection reset by remote peer: {exc}", transport="tcp"
                ) from exc
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
        await self.stream.send_all(data)
    except trio.BrokenResourceError as exc:
        raise ConnectionClosedError(
            f"TCP connection reset by remote peer: {exc}", transport="tcp"
        ) from exc
    except trio.ClosedResourceError:
        return
    finally:
        lock.release()


def quiet_libp2p_logging() -> None:
    """libp2p logs routine failures at ERROR and multiaddr floods at DEBUG."""
    for name in ("libp2p", "multiaddr", "async_service", "libp2p.transport"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


class SessionClosed(Exception):
    """The framed stream is gone; pending sends are dropped."""


def _packer() -> Callable[[dict], bytes]:
    return msgpack.Packer(use_bin_type=True, buf_size=PACK_BUFFER_BYTES).pack


class _Outbox:
    """The frames waiting for a session's writer, and the writer's place to wait.

    A trio memory channel did this at 1.6 to 1.9 µs a frame (its KI-protected calls,
    a dict of waiting tasks, a WouldBlock raised to end every batch) against 1.0 µs
    here, timed in one trio loop with three frames put per writer pass; a streamed
    answer is a dozen frames on the agent's side."""

    __slots__ = ("closed", "frames", "waiter")

    def __init__(self) -> None:
        self.frames: deque[bytes] = deque()
        self.waiter: trio.lowlevel.Task | None = None
        self.closed = False

    def put(self, frame: bytes) -> None:
        self.frames.append(frame)
        self.wake()

    def close(self) -> None:
        """No more frames; the writer takes those queued, then ends."""
        self.closed = True
        self.wake()

    async def wait(self) -> None:
        """Until a frame is put or the outbox closes (at once if either happened)."""
        if self.frames or self.closed:
            await trio.lowlevel.checkpoint()
            return
        self.waiter = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self.waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            trio.lowlevel.reschedule(waiter)


class _BatchEnd(trio.abc.Instrument):
    """Writes the frames that sessions queued during one batch of trio's scheduler when
    the batch ends (before trio's next wait for I/O), where each session's writer task
    would have been woken to write them in the next batch: a task step, its resume
    through the writer's coroutines and its park again per write saved, and the write
    leaves one epoll wait sooner. Frames queued by every task of the batch still leave
    together, one write per session. Only sessions whose writer is idle and whose
    stream takes DirectWriter's path are held here; what cannot go so is the writer's.
    """

    def __init__(self) -> None:
        self.held: list[FramedStream] = []

    def before_io_wait(self, timeout: float) -> None:
        del timeout
        held, self.held = self.held, []
        for stream in held:
            stream.flush_held()


# One per trio run (each daemon's), added to the run's instruments on first use.
_BATCH_END: trio.lowlevel.RunVar[_BatchEnd] = trio.lowlevel.RunVar("hivenet_batch_end")


def _batch_end() -> _BatchEnd:
    try:
        return _BATCH_END.get()
    except LookupError:
        end = _BatchEnd()
        trio.lowlevel.add_instrument(end)
        _BATCH_END.set(end)
        return end


class FramedStream:
    """One libp2p stream carrying length-prefixed msgpack frames in both directions."""

    def __init__(
        self,
        stream: Any,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        write_timeout: float = math.inf,
        write_at_batch_end: bool = False,
    ) -> None:
        self.stream = stream
        self._write_at_batch_end = write_at_batch_end
        self._write_timeout = write_timeout
        # When the write under way began; inf between writes (`_watch_writes`).
        self.write_began = math.inf
        self.decoder = FrameDecoder(max_frame_bytes)
        self._outbox = _Outbox()
        self.closed = trio.Event()
        self.close_reason = ""
        # When frames last went to the stream (the router's liveness frames go on a
        # session it has said nothing on for a while).
        self.last_tx = 0.0
        # msgpack.packb builds a packer, and its buffer, for every frame: 0.53 against
        # 0.22 µs for one kept (a streamed answer is a dozen frames).
        self._pack = _packer()
        # The muxer's task hands this stream's frames over as it reads them (`_reader`).
        self.direct = False
        self._scope: trio.CancelScope | None = None
        self._abort_early = False
        self._drained = trio.Event()
        # Set by the writer where the stream takes DirectWriter's path: frames queued
        # while the writer is idle are written at the batch's end (`_BatchEnd`).
        self._direct: yamux_fast.DirectWriter | None = None
        self._batch_end: _BatchEnd | None = None
        self._held = False

    def allow_frames(self, max_frame_bytes: int) -> None:
        """Take frames up to this size from now on (a peer that is trusted now)."""
        self.decoder.max_frame_bytes = max_frame_bytes

    async def send(self, message: dict) -> None:
        """Queue one message; never blocks the caller behind the network."""
        self.send_nowait(message)

    def send_nowait(self, message: dict) -> None:
        # close() shuts the outbox at once; `closed` is set only when run() returns.
        if self._outbox.closed:
            raise SessionClosed(self.close_reason or "session closed")
        frame = encode_frame(message, self._pack)
        if len(frame) > PACK_BUFFER_BYTES:
            # A packer keeps the largest buffer it ever grew to, for good: a router
            # with a thousand sessions kept a request body's worth for each.
            self._pack = _packer()
        outbox, end = self._outbox, self._batch_end
        if end is None or outbox.waiter is None:
            outbox.put(frame)
            return
        outbox.frames.append(frame)
        if not self._held:
            self._held = True
            end.held.append(self)

    def flush_held(self) -> None:
        """Write the frames queued since the writer went idle (`_BatchEnd`), or leave
        them to it: a write DirectWriter cannot make, or a message the kernel could not
        take whole, wakes the writer, which goes on from there."""
        self._held = False
        outbox, direct = self._outbox, self._direct
        if outbox.waiter is None or direct is None:
            return  # the writer is awake (a close woke it): the frames are its own
        try:
            while outbox.frames:
                data = self._next_batch()
                if not direct.write_now(data):
                    outbox.frames.appendleft(data)
                    break
                self.last_tx = trio.current_time()
                if yamux_fast.owed(direct.tcp):
                    break
        except Exception as exc:  # sealing failed: the session cannot go on
            self.close_reason = self.close_reason or f"write failed: {type(exc).__name__}"
            if self._scope is not None:
                self._scope.cancel()
            return
        if outbox.frames or yamux_fast.owed(direct.tcp):
            outbox.wake()

    async def run(self, on_message: Callable[[dict], None]) -> str:
        """Read and write until either side ends; returns why the session ended."""
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                if self._abort_early:
                    nursery.cancel_scope.cancel()
                nursery.start_soon(self._writer, nursery.cancel_scope)
                if self._write_timeout < math.inf:
                    nursery.start_soon(self._watch_writes, nursery.cancel_scope)
                await self._reader(on_message)
                nursery.cancel_scope.cancel()
        except Exception as exc:
            self.close_reason = self.close_reason or f"{type(exc).__name__}: {exc}"
        finally:
            self.close_reason = self.close_reason or "stream closed"
            self.closed.set()
            self._outbox.close()
            # The stream may already be gone: resetting it again is harmless.
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(1),
                contextlib.suppress(Exception),
            ):
                await self.stream.reset()
        return self.close_reason

    def close(self, reason: str) -> None:
        """End the session now, even while the peer is frozen mid-read."""
        if not self.close_reason:
            self.close_reason = reason
        self._outbox.close()
        if self._scope is None:
            self._abort_early = True
        else:
            self._scope.cancel()

    async def flush_and_close(self, reason: str) -> None:
        """Let queued frames (a refusal, say) reach the peer, then end the session."""
        if not self.close_reason:
            self.close_reason = reason
        self._outbox.close()
        with trio.move_on_after(FLUSH_TIMEOUT):
            await self._drained.wait()
            # A reset can overtake data still in flight: close our side and let the
            # peer hang up first.
            with contextlib.suppress(Exception):
                await self.stream.close_write()
            await self.closed.wait()
        self.close(reason)

    async def _reader(self, on_message: Callable[[dict], None]) -> None:
        """Decode and dispatch what arrives until the stream ends.

        Over yamux, once nothing read is left undecoded, the muxer's own task hands
        each DATA frame's bytes to `_deliver` as it takes them off the connection
        (`yamux_fast.deliver_to`): this task then only waits for the stream's end, and
        a frame no longer waits for a pass through trio's scheduler to reach it, on
        the critical path of every answer (router) and request (agent)."""
        deliver = partial(self._deliver, on_message)
        while True:
            if not self.direct:
                self.direct = yamux_fast.deliver_to(self.stream, deliver)
            try:
                data = await self.stream.read(READ_BYTES)
            except Exception as exc:
                self.close_reason = self.close_reason or f"read ended: {type(exc).__name__}"
                return
            if not data:
                self.close_reason = self.close_reason or "peer closed the stream"
                return
            if not deliver(data):
                return

    def _deliver(self, on_message: Callable[[dict], None], data: bytes) -> bool:
        """Decode `data` and hand on each message; False (and the session ending) when a
        bad frame or message ends this session, which is then deaf to what follows.
        A session being closed hears nothing more, as its cancelled reader would not."""
        scope = self._scope
        if scope is not None and scope.cancel_called:
            yamux_fast.deliver_to(self.stream, None)
            return False
        try:
            for message in self.decoder.feed(data):
                on_message(message)
        except Exception as exc:
            self.close_reason = self.close_reason or f"{type(exc).__name__}: {exc}"
            yamux_fast.deliver_to(self.stream, None)
            if scope is not None:
                scope.cancel()
            return False
        return True

    def _next_batch(self) -> bytes:
        """The queued frames, up to WRITE_BATCH_BYTES (at least one), as one write."""
        frames = self._outbox.frames
        frame = frames.popleft()
        if not frames:
            return frame
        batch = [frame]
        size = len(frame)
        while frames and size < WRITE_BATCH_BYTES:
            more = frames.popleft()
            batch.append(more)
            size += len(more)
        return b"".join(batch)

    async def _writer(self, cancel_scope: trio.CancelScope) -> None:
        outbox = self._outbox
        frames = outbox.frames
        direct = self._direct = yamux_fast.DirectWriter.of(self.stream)
        if direct is not None and self._write_at_batch_end:
            self._batch_end = _batch_end()
        try:
            while True:
                if direct is not None and yamux_fast.owed(direct.tcp):
                    # The rest of a message written at a batch's end.
                    self.write_began = trio.current_time()
                    await direct.tcp.write(b"")
                    self.write_began = math.inf
                if not frames:
                    if outbox.closed:
                        break
                    await outbox.wait()
                    continue
                data = self._next_batch()
                self.write_began = self.last_tx = trio.current_time()
                if direct is None or not await direct.write(data):
                    await self.stream.write(data)
                self.write_began = math.inf
        except Exception as exc:
            self.close_reason = self.close_reason or f"write failed: {type(exc).__name__}"
            cancel_scope.cancel()
        self._drained.set()

    async def _watch_writes(self, cancel_scope: trio.CancelScope) -> None:
        """End the session when one write has waited past the write timeout, for a peer
        that stopped reading: it is found within a quarter of the timeout more. A
        deadline armed and disarmed around each write (`trio.fail_after`) cost the
        agent some 7 µs per write, where nearly every write waits for nothing."""
        timeout = self._write_timeout
        while True:
            await trio.sleep(timeout / 4)
            if trio.current_time() - self.write_began > timeout:
                self.close_reason = self.close_reason or f"write timed out after {timeout:g} s"
                cancel_scope.cancel()
                return


# py-libp2p 0.8.1's layers from a stream down to its socket, by attribute name.
_TOWARD_SOCKET = (
    "muxed_conn",
    "secured_conn",
    "conn",
    "read_writer",
    "read_write_closer",
    "stream",
)


def _layer_under(stream: Any, kind: type) -> Any | None:
    """The first layer of `kind` from a libp2p stream down toward its socket, or None
    when there is none (WebSocket transport)."""
    node, seen = stream, 0
    while node is not None and seen < 12:
        if isinstance(node, kind):
            return node
        node = next((getattr(node, a) for a in _TOWARD_SOCKET if hasattr(node, a)), None)
        seen += 1
    return None


def tcp_socket_of(stream: Any) -> Any | None:
    """The TCP socket under a libp2p stream (yamux, Noise, raw connection), or None
    when there is none to be found (WebSocket transport)."""
    tcp = _layer_under(stream, trio.SocketStream)
    return None if tcp is None else tcp.socket


def before_reads(stream: Any, hook: Callable[[], None]) -> Callable[[], None] | None:
    """Have `hook` called whenever the TCP connection under a libp2p `stream` is about
    to be read from its socket, that is once all that the last read brought has been
    handled (`_buffered_read`). `hook` must not raise. Returns what undoes it; None
    where there is no such connection (WebSocket)."""
    tcp = _layer_under(stream, TrioTCPStream)
    if tcp is None:
        return None
    hooks: list[Callable[[], None]] = tcp.__dict__.setdefault("_hivenet_before_reads", [])
    hooks.append(hook)
    return partial(hooks.remove, hook)


def limit_unacknowledged(stream: Any, seconds: float) -> bool:
    """Have the kernel end the connection when data it sent stays unacknowledged this
    long (TCP_USER_TIMEOUT): a dead peer host or a black-holed path, noticed with no
    frame spent on it. False where the socket or the option is not available."""
    sock = tcp_socket_of(stream)
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if sock is None or option is None:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, max(1, int(seconds * 1000)))
    except OSError:
        return False
    return True
