"""A small HTTP/1.1 server for ASGI apps on trio; llhttp parses the requests.

It replaced Hypercorn in the router because Hypercorn's per-request machinery (a task
and several cancel scopes per request, a shielded socket write per ASGI message, a
separate write for the response head) cost more router CPU than all of the routing:
see docs/benchmarks/index.md. Only what the router's apps use is here: HTTP/1.1 and
1.0 with keep-alive, request bodies streamed to `receive()`, `http.disconnect` when the
client leaves, and a graceful stop. There is no lifespan protocol (the router's apps
keep no state that needs it), no HTTP/2 and no WebSocket.

Per connection: one task and one cancel scope, whose deadline is the keep-alive
timeout while the connection waits for a request. A response head whose length is
known is held until the first body part, so a whole answer leaves in one write.
Requests are parsed by llhttp (`request_reader.py`); answers are framed here (by
Content-Length, by chunks, or to the close for HTTP/1.0) as h11 framed them: h11's
pure-Python parsing and writing were about 15% of the router's CPU at 64 clients.

Hostile input ends in an answer in the caller's error format and a close, never in a
connection left usable for bytes the server did not frame itself: a head over 16 KiB
(431), Content-Length with Transfer-Encoding (RFC 9112 §6.1: request smuggling behind
a proxy that frames by Content-Length), a transfer coding other than `chunked`, or a
malformed chunked body (400). A response head that cannot go on the wire (a status
outside 200-599, CR/LF/NUL in a header) becomes a 502 and `send` raises. A client that
stops reading is closed after `write_timeout` without progress: one server task checks
every connection once a second, because a cancel scope around each write took a
200-byte socket write from 12 to 20 µs here.

An app that wants to hear of the client leaving while it answers, without a task blocked
in `receive()` per request, registers a callback with the scope's extension
`hivenet.on_disconnect` (only offered on a TCP connection, on Linux). One server task waits on an
epoll set of every connection's socket that reports only the peer's close or reset, so
neither a request body nor a pipelined request wakes it.
"""

from __future__ import annotations

import contextlib
import email.utils
import errno
import http
import json
import logging
import math
import re
import select
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from enum import Enum
from typing import Any, NoReturn
from urllib.parse import unquote

import trio

from protocol.errors import ErrorCode, RouterError, anthropic_error_body, openai_error_body
from protocol.logs import quote
from protocol.sockets import readable_now, receive_when_ready, send_at_once, stdlib_socket
from router.http.asgi import ANSWER_SCOPE, BODY_READY, HOLD_HEAD, ON_DISCONNECT, kept_request_id
from router.http.request_reader import (
    END,
    MAX_HEAD_BYTES,
    NEED_DATA,
    Head,
    Refusal,
    RequestReader,
)

log = logging.getLogger("http")

App = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Any]

__all__ = ["MAX_HEAD_BYTES", "HttpServer", "UnsendableHead"]

READ_BYTES = 64 * 1024
# A request answered before its body was read: how long and how much of the rest is
# read and dropped so the connection can serve the next request.
DISCARD_TIMEOUT = 5.0
DISCARD_BYTES = 64 * 1024 * 1024
# Closing a socket with unread input makes the kernel send a reset, which can destroy
# the answer still on its way; the server stops writing first and reads what is left.
LINGER_TIMEOUT = 1.0
# What a client may send ahead (pipelining) while its request is being answered.
MAX_AHEAD_BYTES = 64 * 1024
# A write larger than this leaves in pieces, so that a slow reader that still makes
# progress is not taken for one that stopped: the write timeout counts per piece, so
# with the default 30 s only a reader slower than about 9 KB/s is cut.
WRITE_PIECE_BYTES = 256 * 1024
# How often the watchdog looks at every connection (at most): a write or keep-alive
# timeout fires between the timeout and the timeout plus this.
WATCH_PERIOD = 1.0

# What `accept` can fail with while the server itself is sound: out of descriptors or
# kernel memory (trio's ACCEPT_CAPACITY_ERRNOS). Serving the connections already open
# frees some; any other error is a bug or a broken listener and ends the server.
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_DELAY = 0.1
# Out of descriptors, the server closes this share of its idle connections (the oldest
# first), so that connections left open by the thousand cannot lock every client out.
SHED_IDLE_SHARE = 16

# Every scope's `asgi` entry, one dict for all: no app here changes it.
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_KNOWN_STATUSES = frozenset(s.value for s in http.HTTPStatus)
_DISCONNECT = {"type": "http.disconnect"}
# What the app hears after the server refused the body (malformed chunking) and answered
# for it: not a client that left, so its log and audit line can say 400, not 499.
_BODY_REFUSED = {"type": "http.disconnect", "status": 400}
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)

# Each final status's line, built once: b"HTTP/1.1 200 OK\r\n".
_STATUS_LINES = {
    code: b"HTTP/1.1 %d %s\r\n"
    % (code, http.HTTPStatus(code).phrase.encode() if code in _KNOWN_STATUSES else b"")
    for code in range(200, 600)
}
# The header lines an answer may carry (RFC 9110 §5.1, §5.5: a token, then a value with
# no control character but HTAB), checked by one match over all of them: a CR, LF or
# NUL in an engine's header value would split the answer.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+")
# Header names already found to be tokens (lowercased), so that a name is checked once
# per server rather than once per answer; bounded against an engine that invents names.
MAX_KNOWN_NAMES = 1024
# With every name a token, a value with none of these (HTAB is allowed) cannot split the
# answer: one search over the values joined, where a match of the whole block cost
# three times as much.
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class _Framing(Enum):
    LENGTH = "content-length"
    CHUNKED = "chunked"
    UNTIL_CLOSE = "until-close"  # an HTTP/1.0 client: the body ends at the close
    NO_BODY = "no-body"  # HEAD, 204, 304


_LENGTH, _CHUNKED = _Framing.LENGTH, _Framing.CHUNKED
_UNTIL_CLOSE, _NO_BODY = _Framing.UNTIL_CLOSE, _Framing.NO_BODY


class ConnectionState(Enum):
    """Where a client connection stands (httpcore's HTTPConnectionState)."""

    IDLE = "IDLE"  # waiting for a request: the keep-alive deadline applies
    ACTIVE = "ACTIVE"  # a request is being served
    CLOSED = "CLOSED"  # the client left or the socket failed: nothing more is read or written


class RequestState(Enum):
    """Where the answer to the current request stands."""

    READING = "READING"  # no answer yet: the app may read the body
    RESPONDING = "RESPONDING"  # the head is accepted (held or sent): body parts follow
    DONE = "DONE"  # the whole answer was handed to the socket
    BROKEN = "BROKEN"  # the answer cannot end cleanly: the connection closes after it
    # The server answered for the app (an error of its own) and closes the connection:
    # the app is told the client left, and what it sends goes nowhere.
    REFUSED = "REFUSED"


# The hot path compares states about ten times a request: on Python 3.11
# `RequestState.DONE` costs 150 ns (the enum metaclass's attribute lookup), a module
# global 18 ns.
IDLE, ACTIVE, CLOSED = ConnectionState.IDLE, ConnectionState.ACTIVE, ConnectionState.CLOSED
READING, RESPONDING = RequestState.READING, RequestState.RESPONDING
DONE, BROKEN, REFUSED = RequestState.DONE, RequestState.BROKEN, RequestState.REFUSED


class UnsendableHead(ValueError):
    """The app's response head cannot go on the wire (a status outside 200-599, a bad
    header name or value): the client got a 502 instead."""


class HttpServer:
    def __init__(
        self,
        app: App,
        keep_alive_timeout: float = 75.0,
        graceful_timeout: float = 1.0,
        write_timeout: float = 30.0,
        protocol_of: Callable[[str], str] = lambda path: "openai",
        answer_timeout: float = math.inf,
    ) -> None:
        self.app = app
        self.keep_alive_timeout = keep_alive_timeout
        # The longest an app's answer may take (ANSWER_SCOPE's `limit`): the watchdog
        # looks often enough to end one within a quarter of it more.
        self.answer_timeout = answer_timeout
        self.graceful_timeout = graceful_timeout
        self.write_timeout = write_timeout
        # The error format a caller of a path understands ("openai" or "anthropic"),
        # for the answers the server gives itself.
        self.protocol_of = protocol_of
        self.stopping = False
        self.connections: set[_Connection] = set()
        self._all_closed = trio.Event()
        self.header_names: set[bytes] = set()
        # Set while `serve` runs: a connection served by `run_connection` alone has none.
        self.hangups: _Hangups | None = None
        # While `serve` runs, its watchdog also ends connections idle past the keep-alive
        # timeout; alone, a connection arms a deadline for each wait instead.
        self.watching = False
        self._date_second = -1
        self._date = b""

    def date(self) -> bytes:
        """The Date header, formatted once a second."""
        second = int(time.time())
        if second != self._date_second:
            self._date_second = second
            self._date = email.utils.formatdate(second, usegmt=True).encode()
        return self._date

    async def serve(
        self,
        addr: tuple[str, int],
        shutdown_trigger: Callable[[], Awaitable[Any]],
        *,
        accept_until: Callable[[], Awaitable[Any]] | None = None,
        listen_fd: int | None = None,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until `shutdown_trigger` returns; then stop accepting, let requests in
        progress finish for up to graceful_timeout, and cancel what is left. Started
        with the port it listens on (for port 0). `listen_fd`: accept on this listening
        socket (a `--workers` worker's share of the port, which its supervisor bound)
        instead of binding `addr`; the server owns it from now on.

        `accept_until`: stop accepting earlier, when it returns. The listener closes (a
        new connection is refused, not answered), idle connections end, and each busy
        one ends after its answer (`Connection: close`); the answers in progress go on
        until `shutdown_trigger`. This is the router's drain: in-flight streams finish
        while nothing new can reach it."""
        if listen_fd is not None:
            listeners = [
                trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=listen_fd)))
            ]
        else:
            listeners = await trio.open_tcp_listeners(addr[1], host=addr[0])
        try:
            await self._serve(listeners, accept_until, shutdown_trigger, task_status)
        finally:
            if self.hangups is not None:
                self.hangups.close()
                self.hangups = None

    async def _serve(
        self,
        listeners: list[trio.SocketListener],
        accept_until: Callable[[], Awaitable[Any]] | None,
        shutdown_trigger: Callable[[], Awaitable[Any]],
        task_status: trio.TaskStatus[int],
    ) -> None:
        async with trio.open_nursery() as nursery:
            accepting = trio.CancelScope()

            async def accept_all() -> None:
                with accepting:
                    async with trio.open_nursery() as accepters:
                        for listener in listeners:
                            accepters.start_soon(self._accept, listener, nursery)

            if hasattr(select, "epoll"):  # elsewhere than Linux, apps wait in receive()
                self.hangups = _Hangups()
                nursery.start_soon(self.hangups.run)
            nursery.start_soon(accept_all)
            nursery.start_soon(self.watch)
            task_status.started(listeners[0].socket.getsockname()[1])
            await (accept_until or shutdown_trigger)()
            self.stopping = True
            accepting.cancel()
            for listener in listeners:
                await self._close_listener(listener, nursery)
            for conn in list(self.connections):
                conn.stop_if_idle()
            if accept_until is not None:
                await shutdown_trigger()
            with trio.move_on_after(self.graceful_timeout):
                if self.connections:
                    await self._all_closed.wait()
            nursery.cancel_scope.cancel()

    def arriving(self, within: float) -> bool:
        """A connection accepted, or a request begun, in the last `within` seconds that
        is not done: what an app may not have counted yet (a drain waits for it)."""
        since = trio.current_time() - within
        return any(
            c.began > since and (c.state is not IDLE or not c.requests) and c.state is not CLOSED
            for c in self.connections
        )

    async def _close_listener(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Close `listener` losing as few connections as the kernel allows: those it
        completed but nobody accepted yet would be reset by the close, so what is
        queued is accepted (and served) first. One the kernel completes between the
        last accept and the close is still reset before any answer (a balancer's retry
        covers it), unless another process holds the socket too: a `--workers`
        worker's supervisor does, and that connection waits for its successor."""
        try:
            while readable_now(listener.socket):
                nursery.start_soon(self.run_connection, await listener.accept())
        except OSError:
            pass  # closing anyway
        await listener.aclose()

    async def watch(self) -> None:
        """Close every connection whose write made no progress for write_timeout, end
        every one idle past keep_alive_timeout, and every answer past its deadline.

        The first covers a connection blocked writing to a client that reads nothing,
        which would otherwise hold its request, and the agent's slot, until the
        request's deadline. Closing the socket ends the blocked write, and the app
        hears of it as of a client that left (its ON_DISCONNECT callback, or
        `http.disconnect` from receive()). The second is the keep-alive deadline of a
        connection waiting for a request (or its head), here rather than a deadline
        armed and disarmed around each wait: two deadline changes per request were 2%
        of the router's CPU per whole answer (`python -m bench.profile router`). The
        third, for the same reason, is the deadline an app set for its answer
        (ANSWER_SCOPE's `limit`).
        """
        self.watching = True
        try:
            period = min(
                WATCH_PERIOD,
                self.write_timeout / 4,
                self.keep_alive_timeout / 4,
                self.answer_timeout / 4,
            )
            while True:
                await trio.sleep(period)
                now = trio.current_time()
                since = now - self.write_timeout
                idle_since = now - self.keep_alive_timeout
                for conn in list(self.connections):
                    if conn.write_began < since:
                        await conn.abandon()
                    elif (
                        conn.state is IDLE and conn.waiting_since < idle_since
                    ) or conn.answer_deadline <= now:
                        conn.end()  # idle past keep-alive, or an answer past its deadline
        finally:
            self.watching = False

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                if not readable_now(listener.socket):  # no connection waits
                    # Linux refuses accept() at the descriptor limit whether or not a
                    # connection waits: nothing to make room for until one does.
                    await trio.lowlevel.wait_readable(listener.socket)
                    continue
                log.warning(
                    "http_accept_failed error=%s idle_closed=%d retry_s=%g",
                    errno.errorcode[exc.errno],
                    self._shed_idle(),
                    ACCEPT_RETRY_DELAY,
                )
                await trio.sleep(ACCEPT_RETRY_DELAY)
                continue
            nursery.start_soon(self.run_connection, stream)

    def _shed_idle(self) -> int:
        """Close the longest-idle 1/SHED_IDLE_SHARE of the connections waiting for a
        request (at least one): their clients reconnect when they have one to send."""
        idle = sorted(
            (c for c in self.connections if c.state is IDLE), key=lambda c: c.waiting_since
        )
        shed = idle[: max(1, len(idle) // SHED_IDLE_SHARE)]
        for conn in shed:
            conn.shed = True
            conn.end()
        return len(shed)

    async def run_connection(self, stream: trio.abc.Stream) -> None:
        """Serve one client connection until it ends."""
        conn = _Connection(self, stream)
        self.connections.add(conn)
        try:
            await conn.run()
        except Exception:  # a bug must cost one connection, never the server
            log.exception("http_connection_error")
        finally:
            self.connections.discard(conn)
            if self.stopping and not self.connections:
                self._all_closed.set()


class _Hangups:
    """The clients that closed or reset their connection, learnt with no task per request.

    One epoll set, itself waited on through trio, holds every TCP connection's socket for
    the peer's close (EPOLLRDHUP; a reset's EPOLLHUP and EPOLLERR are always reported) and
    nothing else, so a request body or a pipelined request never wakes it. EPOLLONESHOT:
    a close is final, so each socket is reported once.
    """

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.connections: dict[int, _Connection] = {}

    def add(self, conn: _Connection, fd: int) -> None:
        self.epoll.register(fd, select.EPOLLRDHUP | select.EPOLLONESHOT)
        self.connections[fd] = conn

    def discard(self, fd: int) -> None:
        """Before the socket closes: its number may soon be another connection's."""
        if self.connections.pop(fd, None) is not None:
            with contextlib.suppress(OSError):
                self.epoll.unregister(fd)

    async def run(self) -> None:
        fd = self.epoll.fileno()
        while True:
            await trio.lowlevel.wait_readable(fd)
            for ready, _ in self.epoll.poll(0):
                conn = self.connections.get(ready)
                if conn is not None:
                    conn.hung_up()

    def close(self) -> None:
        self.connections.clear()
        self.epoll.close()


def _chunk(body: bytes) -> bytes:
    """One chunk of a chunked body (RFC 9112 7.1)."""
    return b"%x\r\n%s\r\n" % (len(body), body)


class _Connection:
    def __init__(self, server: HttpServer, stream: trio.abc.Stream) -> None:
        self.server = server
        self.stream = stream
        self.reader = RequestReader()
        self.scope = trio.CancelScope()
        self.state = ACTIVE
        self.requests = 0
        # When the connection was accepted, then when its latest request began.
        self.began = trio.current_time()
        # When the write in progress began (inf: none), for the write watchdog.
        self.write_began = math.inf
        # When the wait for the next request began, for the keep-alive watchdog.
        self.waiting_since = math.inf
        # Per request:
        self.request: Head | None = None
        self.body_done = True  # the request's body has been read to its END
        self.answer = READING
        self.head: bytes | None = None  # a response head held for the first body part
        # What the kernel did not take of a part written by `write_part`: it goes out
        # first with the app's next write, which the caller has promised.
        self.unsent = b""
        self.framing = _CHUNKED
        self.length_left = 0  # what a Content-Length answer still owes
        self.close_after = False  # the answer said `connection: close`
        # Shed for descriptors (`HttpServer._shed_idle`): its close waits for nothing.
        self.shed = False
        self.expects_continue = False  # a 100 Continue is owed before the body is read
        # ANSWER_SCOPE: the app's deadline for its answer, which the watchdog keeps.
        self.answer_deadline = math.inf
        # `scope` was cancelled by `end()`: read where `scope.cancel_called` would read
        # the clock (for a deadline the scope mostly has not), twice a request.
        self.ended = False
        self.client = self.server_addr = None
        sock = getattr(stream, "socket", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                self.client = _addr(sock.getpeername())
                self.server_addr = _addr(sock.getsockname())
        # The stdlib socket under a plain TCP stream, for writes the kernel takes at once.
        self.raw = stdlib_socket(stream)
        # The app's callback for the client leaving during the request (ON_DISCONNECT);
        # `gone`: the server's epoll set saw the peer close or reset, maybe between
        # requests, before the app asked.
        self.on_hangup: Callable[[], None] | None = None
        self.gone = False
        self.fd = -1
        if self.raw is not None and server.hangups is not None:
            self.fd = self.raw.fileno()
            server.hangups.add(self, self.fd)

    @property
    def peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "-"

    def __repr__(self) -> str:
        return (
            f"<_Connection HTTP/1.1, {self.state.value}, request {self.answer.value},"
            f" Request Count: {self.requests}, peer {self.peer}>"
        )

    def stop_if_idle(self) -> None:
        """On stop: end the connection if it waits between requests. A connection that
        has not sent its first request yet is kept for it (served with `Connection:
        close`): its client opened it to send one, and accepted it was."""
        if self.state is IDLE and self.requests:
            self.end()

    async def abandon(self) -> None:
        """The client stopped reading: close the socket under the blocked write."""
        log.info("http_write_timeout client=%s timeout_s=%g", self.peer, self.server.write_timeout)
        self.write_began = math.inf
        self._forget()
        self._lost()
        await self.stream.aclose()

    # --- ANSWER_SCOPE (router/http/asgi.py) ---------------------------------------

    def limit(self, deadline: float) -> None:
        """Cancel the connection's scope, the app's answer with it, at `deadline`."""
        if self.server.watching:
            self.answer_deadline = deadline
        else:
            self.scope.deadline = deadline

    def lift(self) -> None:
        """The answer is over in time: no deadline any more."""
        self.answer_deadline = math.inf
        if self.scope.deadline != math.inf:
            self.scope.deadline = math.inf

    def end(self) -> None:
        """Cancel the app's answer now; the connection closes after it."""
        self.answer_deadline = math.inf
        self.ended = True
        self.scope.cancel()

    def part_writer(self) -> Callable[[bytes], bool] | None:
        """`write_part` while the answer is a chunked stream whose head is sent (or
        held for its first part); None otherwise (the app writes through send())."""
        if self.answer is not RESPONDING or self.framing is not _CHUNKED or self.raw is None:
            return None
        return self.write_part

    def write_part(self, body: bytes) -> bool:
        """One more part of a streamed answer, written now from whatever task has it
        (the link's reader): True when it went out whole, or was dropped because the
        client is gone or the answer is over (the app learns that as it would from
        send()). False when the kernel took less: the rest waits in `unsent`, and the
        caller must have the app write next (an empty part will do), through trio,
        which waits for room and keeps the write timeout."""
        if self.state is CLOSED or self.answer is not RESPONDING or not body:
            return True
        data = _chunk(body)
        if self.unsent:
            self.unsent += data
            return False
        if self.head is not None:
            data = self.head + data
            self.head = None
        try:
            sent = send_at_once(self.raw, data)  # type: ignore[arg-type]  # as part_writer found it
        except OSError:
            self._lost()
            return True
        if sent == len(data):
            return True
        self.unsent = data[sent:]
        return False

    def _cancelled(self) -> bool:
        """`scope.cancel_called`: by `end()`, or by a deadline when the scope has one."""
        scope = self.scope
        return self.ended or (scope.deadline != math.inf and scope.cancel_called)

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """ON_DISCONNECT: `callback` (which must not raise) is called once if the client
        leaves before the app returns, at once if it has already left."""
        self.on_hangup = callback
        if self.gone or self.state is CLOSED:
            self._lost()

    def hung_up(self) -> None:
        """The epoll set saw the client close or reset its connection."""
        self.gone = True
        self._forget()
        if self.on_hangup is not None:
            self._lost()
        # Otherwise nobody is waiting: between requests the next read ends the
        # connection, and an app that reads receive() finds the close itself.

    def _lost(self) -> None:
        """The client is gone: nothing more is read or written, and the app is told."""
        self.state = CLOSED
        tell, self.on_hangup = self.on_hangup, None
        if tell is not None:
            tell()

    def _forget(self) -> None:
        hangups = self.server.hangups
        if self.fd >= 0 and hangups is not None:
            hangups.discard(self.fd)
        self.fd = -1

    async def run(self) -> None:
        try:
            with self.scope:
                while not self.server.stopping or not self.requests:
                    request = await self._next_request()
                    if request is None:
                        break
                    await self._serve(request)
                    if not await self._ready_for_next():
                        break
        finally:
            await self._close()

    async def _next_request(self) -> Head | None:
        self.state = IDLE
        watched = self.server.watching
        if watched:
            self.waiting_since = trio.current_time()
        else:
            self.scope.deadline = trio.current_time() + self.server.keep_alive_timeout
        try:
            while True:
                event = self.reader.next_event()
                if event is NEED_DATA:
                    if not await self._read():
                        return None
                    continue
                if type(event) is Head:
                    return event
                if type(event) is Refusal:
                    path = _path_of(event.target)
                    await self._refuse(event.status, ErrorCode.REQUEST_INVALID, event.message, path)
                return None  # body events between requests: nothing left to serve
        finally:
            if self.state is IDLE:
                self.state = ACTIVE
            if not watched:
                self.scope.deadline = math.inf

    async def _read(self) -> bytes:
        """Feed the reader one read from the socket; b"" when the client is gone.

        A plain TCP connection waits for readiness before it reads: trio's
        receive_some reads first, which between requests finds nothing (a wasted
        system call), and passes through the scheduler again after a read, a pass a
        lone client waits for on every request."""
        raw = self.raw
        try:
            if raw is None or raw.fileno() < 0:  # closed: trio says so
                data = await self.stream.receive_some(READ_BYTES)
            else:
                data = await receive_when_ready(raw, READ_BYTES)
        except _GONE:
            data = b""
        if data:
            self.reader.feed(data)
        else:
            self.state = CLOSED
        return data

    async def _serve(self, request: Head) -> None:
        self.request = request
        self.requests += 1
        self.began = trio.current_time()
        self.head = None
        self.answer = READING
        self.body_done = False
        self.close_after = False
        self.expects_continue = request.expects_continue
        raw_path, _, query = request.target.partition(b"?")
        path = raw_path.decode("ascii", "replace")
        if "%" in path:
            path = unquote(path)
        scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": request.http_version,
            "method": request.method,
            "scheme": "http",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": request.headers,
            "client": self.client,
            "server": self.server_addr,
        }
        extensions: dict[str, Any] = {BODY_READY: self.body_ready, ANSWER_SCOPE: self}
        if self.fd >= 0 or self.gone:
            extensions[ON_DISCONNECT] = self.on_disconnect
        scope["extensions"] = extensions
        try:
            await self.server.app(scope, self.receive, self.send)
        except Exception:
            log.exception("http_app_error path=%s", path)
        self.on_hangup = None
        if self.answer is READING and self.state is not CLOSED:
            # The app ended without an answer: the client still gets one.
            self.head = None
            await self.send({"type": "http.response.start", "status": 500, "headers": []})
            await self.send({"type": "http.response.body", "body": b""})
        if self.answer is RESPONDING:  # the app left mid-answer
            self.answer = BROKEN

    def body_ready(self) -> bool:
        """BODY_READY: receive() will return the whole body without waiting. Events are
        queued in order and the request's head is taken, so the first END queued is
        this request's."""
        return not self.body_done and not self.expects_continue and END in self.reader.events

    async def receive(self) -> dict:
        if self.state is CLOSED or self.body_done:
            if self.answer is REFUSED:
                return _BODY_REFUSED
            return await self._wait_for_disconnect()
        if self.expects_continue and self.answer is READING and not self.reader.events:
            # RFC 9110 §10.1.1: the client waits for this before it sends the body.
            self.expects_continue = False
            await self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        parts: list[bytes] = []
        reader = self.reader
        while True:
            event = reader.next_event()
            if type(event) is bytes:
                parts.append(event)
                continue
            if event is END:
                self.body_done = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            if event is NEED_DATA:
                if parts:
                    return {"type": "http.request", "body": b"".join(parts), "more_body": True}
                if not await self._read():
                    return _DISCONNECT
                continue
            # A Refusal: bad chunked framing (a body cut short ends at the empty read).
            self.body_done = True
            if self.answer is READING and self.state is not CLOSED:
                assert type(event) is Refusal
                await self._refuse(
                    event.status,
                    ErrorCode.REQUEST_INVALID,
                    event.message,
                    self._path(),
                    request=self.request,
                )
                return _BODY_REFUSED
            if self.answer is not REFUSED:
                self.answer = BROKEN
            return _DISCONNECT

    async def _wait_for_disconnect(self) -> dict:
        """After the body: the only message left is the client leaving."""
        ahead = 0
        while self.state is not CLOSED:
            if ahead > MAX_AHEAD_BYTES:
                await trio.sleep_forever()
            try:
                data = await self.stream.receive_some(READ_BYTES)
            except _GONE:
                data = b""
            if not data:
                self.state = CLOSED
                break
            ahead += len(data)
            self.reader.feed(data)  # a pipelined request, kept for later
        return _DISCONNECT

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if self.answer is not RESPONDING:
                if self.answer is REFUSED:
                    return
                if self.answer is not BROKEN:
                    raise RuntimeError("http.response.body outside a response")
            body = message.get("body", b"")
            more = message.get("more_body", False)
            framing = self.framing
            if framing is _LENGTH and body:
                self.length_left -= len(body)
                if self.length_left < 0:
                    await self._bad_length("more body than its Content-Length")
            if not more:
                if framing is _LENGTH and self.length_left > 0:
                    await self._bad_length("less body than its Content-Length")
                if self.answer is RESPONDING:
                    self.answer = DONE
            if framing is _CHUNKED:
                if body:
                    data = _chunk(body)
                    if not more:
                        data += b"0\r\n\r\n"
                else:
                    data = b"" if more else b"0\r\n\r\n"
            elif framing is _NO_BODY:
                data = b""
            else:  # _LENGTH, or HTTP/1.0's body up to the close
                data = body
            if self.head is not None:
                data = self.head + data
                self.head = None
            await self._write(data)
        elif kind == "http.response.start":
            if self.answer is not READING:
                if self.answer is REFUSED:
                    return
                raise RuntimeError("http.response.start sent twice")
            try:
                head, length = self._response_head(message["status"], message.get("headers", ()))
            except ValueError as exc:
                await self._unsendable(exc)
            self.answer = RESPONDING
            if length is None and not message.get(HOLD_HEAD):
                await self._write(head)
            else:
                self.head = head  # held until the body, so both leave in one write

    def _response_head(
        self, status: Any, headers: Iterable[tuple[bytes, bytes]]
    ) -> tuple[bytes, int | None]:
        """The head's bytes, and the Content-Length when there is one (the head then
        waits for the body); sets the answer's framing. ValueError: unsendable."""
        line = _STATUS_LINES.get(status) if type(status) is int else None
        if line is None:
            raise ValueError(f"status {status!r} is outside 200-599")
        request = self.request
        assert request is not None
        length: int | None = None
        chunked = False
        lines = []
        values = []
        tokens = self.server.header_names
        for name, value in headers:
            lname = name.lower()
            if lname == b"content-length":
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise ValueError(f"bad Content-Length {value[:40]!r}")
                length = int(value)
                continue  # written once, below
            elif lname == b"transfer-encoding":
                chunked = True  # the server frames it: its own header goes out instead
                continue
            elif lname == b"connection":
                continue  # the server decides (below), one header
            if lname not in tokens:
                if _TOKEN.fullmatch(lname) is None:
                    raise ValueError(f"header name {name[:80]!r} is not a token")
                if len(tokens) < MAX_KNOWN_NAMES:
                    tokens.add(lname)
            lines.append(b"%s: %s\r\n" % (name, value))
            values.append(value)
        # A CR or LF inside a value would add a line of its own.
        if _CONTROL.search(b"".join(values)) is not None:
            bad = next(x for x, v in zip(lines, values, strict=True) if _CONTROL.search(v))
            raise ValueError(f"header line {bad[:80]!r} has a control character")
        block = b"".join(lines)
        # A cancelled scope (ANSWER_SCOPE) serves nothing more: an answer given after
        # it is the connection's last.
        close = not request.keep_alive or self.server.stopping or self._cancelled()
        if chunked:
            length = None
        if request.method == "HEAD" or status in (204, 304):
            self.framing = _NO_BODY
            self.length_left = 0
            if length is None and status not in (204, 304):
                block += b"transfer-encoding: chunked\r\n"  # what a GET would have got
        elif length is not None:
            self.framing = _LENGTH
            self.length_left = length
        elif request.http_version == "1.1":
            self.framing = _CHUNKED
            block += b"transfer-encoding: chunked\r\n"
        else:  # an HTTP/1.0 client: the body ends at the close
            self.framing = _UNTIL_CLOSE
            close = True
        if length is not None:
            block += b"content-length: %d\r\n" % length
        if close:
            self.close_after = True
            block += b"connection: close\r\n"
        head = b"%sdate: %s\r\n%s\r\n" % (line, self.server.date(), block)
        return head, length

    async def _bad_length(self, what: str) -> NoReturn:
        """The app's body does not match its Content-Length: nothing may follow."""
        held = self.head is not None
        self.head = None
        self.answer = BROKEN
        if held:  # nothing went out yet: the client gets a 502
            await self._unsendable(ValueError(what))
        raise RuntimeError(f"the answer has {what}")

    async def _unsendable(self, exc: Exception) -> NoReturn:
        """Nothing of the app's answer went out and none can: a 502 goes instead, and
        the app learns it from the exception."""
        message = f"the answer's head cannot be sent: {exc}"
        await self._refuse(
            502, ErrorCode.BACKEND_ERROR, message, self._path(), "backend", self.request
        )
        raise UnsendableHead(str(exc)) from exc

    async def _write(self, data: bytes) -> None:
        # A client that left gets nothing more; the app learns it from its ON_DISCONNECT
        # callback or from receive(). The checkpoint lets an app that keeps writing in a
        # loop still be cancelled.
        if self.state is CLOSED:
            self.unsent = b""
            await trio.lowlevel.checkpoint()
            return
        if self.unsent:
            data, self.unsent = self.unsent + data, b""
        if not data:
            return
        raw = self.raw
        if raw is not None and len(data) <= WRITE_PIECE_BYTES:
            # Straight to the socket while the kernel has room: trio's send_all adds an
            # async context manager and a pass through its scheduler to each write,
            # 16.8 against 8.9 µs of CPU for a 300-byte write (`python -m
            # bench.socket_io`), and a stream relays one write per agent frame. A
            # cancellation is still checked; the schedule point is the caller's next
            # await (the relay's wait for the agent's next frame), or trio's wait for
            # room once the kernel's buffer is full, so no app writes unboundedly long
            # without letting other tasks run.
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                sent = send_at_once(raw, data)
            except OSError:
                self._lost()
                return
            if sent == len(data):
                return
            data = data[sent:]  # the rest waits for room, through trio
        try:
            if len(data) <= WRITE_PIECE_BYTES:
                self.write_began = trio.current_time()
                await self.stream.send_all(data)
            else:
                view = memoryview(data)
                for start in range(0, len(data), WRITE_PIECE_BYTES):
                    self.write_began = trio.current_time()
                    await self.stream.send_all(view[start : start + WRITE_PIECE_BYTES])
        except _GONE:
            self._lost()
        except BaseException:
            # Cancelled part way: the connection cannot carry another answer. Before an
            # answer (a 100 Continue cut short) nothing more may follow on it at all.
            if self.answer is READING:
                self.state = CLOSED
            else:
                self.answer = BROKEN
            raise
        finally:
            self.write_began = math.inf

    async def _ready_for_next(self) -> bool:
        if self.answer is not DONE or self.state is CLOSED or self.server.stopping:
            return False
        if self._cancelled():
            return False
        if self.close_after:
            return False
        if not self.body_done:
            await self._discard_body()
        return self.body_done

    async def _discard_body(self) -> None:
        """The app answered without reading the whole body: drop the rest."""
        dropped = 0
        reader = self.reader
        with trio.move_on_after(DISCARD_TIMEOUT):
            while dropped <= DISCARD_BYTES:
                event = reader.next_event()
                if type(event) is bytes:
                    dropped += len(event)
                elif event is END:
                    self.body_done = True
                    return
                elif event is NEED_DATA:
                    if not await self._read():
                        return
                else:  # the body broke: the connection ends with this answer
                    return

    async def _refuse(
        self,
        status: int,
        code: ErrorCode,
        message: str,
        path: str,
        source: str = "router",
        request: Head | None = None,
    ) -> None:
        """Answer for the app in the caller's error format, and close after it.
        `request`: the head being served, whose X-Request-ID the answer keeps when
        valid (as the app's answers do); otherwise, or with no head, a new one."""
        self.answer = REFUSED
        given = None
        if request is not None:
            given = next((v for k, v in request.headers if k == b"x-request-id"), None)
        rid = kept_request_id(given.decode("latin-1") if given is not None else None)
        rid = rid or str(uuid.uuid4())
        log.info(
            "req=%s http_refused status=%d code=%s client=%s path=%s reason=%s",
            rid,
            status,
            code,
            self.peer,
            quote(path),
            quote(message),
        )
        err = RouterError(code, message, source)
        if self.server.protocol_of(path) == "anthropic":
            payload = anthropic_error_body(err)
        else:
            payload = openai_error_body(err)
        body = json.dumps(payload, separators=(",", ":")).encode()
        head = (
            b"HTTP/1.1 %d %s\r\ndate: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nx-request-id: %s\r\nconnection: close\r\n\r\n"
            % (
                status,
                http.HTTPStatus(status).phrase.encode(),
                self.server.date(),
                len(body),
                rid.encode("latin-1"),
            )
        )
        await self._write(head + body)

    def _path(self) -> str:
        if self.request is None:
            return ""
        return _path_of(self.request.target)

    async def _close(self) -> None:
        self._forget()
        try:
            # Shed while idle, it has no answer on its way a lingering close would save.
            if self.state is not CLOSED and not self.shed:
                await self.stream.send_eof()
                with trio.move_on_after(LINGER_TIMEOUT):
                    while await self.stream.receive_some(READ_BYTES):
                        pass
        except _GONE:
            pass
        finally:
            await self.stream.aclose()


def _path_of(target: bytes) -> str:
    """The percent-decoded path of a request target ("" when there is none)."""
    return unquote(target.partition(b"?")[0].decode("ascii", "replace"))


def _addr(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return (str(value[0]), int(value[1]))
    return None
