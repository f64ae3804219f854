"""A small HTTP/1.1 server for ASGI apps on trio, built on h11.

It replaced Hypercorn in the router because Hypercorn's per-request machinery (a task
and several cancel scopes per request, a shielded socket write per ASGI message, a
separate write for the response head) cost more router CPU than all of the routing:
see the README's Benchmarks. Only what the router's apps use is here: HTTP/1.1 and
1.0 with keep-alive, request bodies streamed to `receive()`, `http.disconnect` when the
client leaves, and a graceful stop. There is no lifespan protocol (the router's apps
keep no state that needs it), no HTTP/2 and no WebSocket.

Per connection: one task and one cancel scope, whose deadline is the keep-alive
timeout while the connection waits for a request. A response head whose length is
known is held until the first body part, so a whole answer leaves in one write.

Hostile input ends in an answer in the caller's error format and a close, never in a
connection left usable for bytes the server did not frame itself: a head over 16 KiB
(431), Content-Length with Transfer-Encoding (RFC 9112 §6.1: request smuggling behind
a proxy that frames by Content-Length), a transfer coding other than `chunked`, or a
malformed chunked body (400). A response head that cannot go on the wire (a status
outside 200-599, CR/LF/NUL in a header) becomes a 502 and `send` raises. A client that
stops reading is closed after `write_timeout` without progress: one server task checks
every connection once a second, because a cancel scope around each write took a
200-byte socket write from 12 to 20 µs here.
"""

from __future__ import annotations

import contextlib
import email.utils
import errno
import http
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any, NoReturn
from urllib.parse import unquote

import h11
import trio

from protocol.errors import ErrorCode, RouterError, anthropic_error_body, openai_error_body
from protocol.logs import quote

log = logging.getLogger("http")

App = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Any]

READ_BYTES = 64 * 1024
# Request heads larger than this are refused with 431 (h11's own default).
MAX_HEAD_BYTES = 16 * 1024
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
# How often the write watchdog looks at every connection (at most): the timeout fires
# between write_timeout and write_timeout + this.
WATCH_PERIOD = 1.0

# What `accept` can fail with while the server itself is sound: out of descriptors or
# kernel memory (trio's ACCEPT_CAPACITY_ERRNOS). Serving the connections already open
# frees some; any other error is a bug or a broken listener and ends the server.
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_DELAY = 0.1

_DISCONNECT = {"type": "http.disconnect"}
# What the app hears after the server refused the body (malformed chunking) and answered
# for it: not a client that left, so its log and audit line can say 400, not 499.
_BODY_REFUSED = {"type": "http.disconnect", "status": 400}
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


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
    ) -> None:
        self.app = app
        self.keep_alive_timeout = keep_alive_timeout
        self.graceful_timeout = graceful_timeout
        self.write_timeout = write_timeout
        # The error format a caller of a path understands ("openai" or "anthropic"),
        # for the answers the server gives itself.
        self.protocol_of = protocol_of
        self.stopping = False
        self.connections: set[_Connection] = set()
        self._all_closed = trio.Event()
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
        reuse_port: bool = False,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until `shutdown_trigger` returns; then stop accepting, let requests in
        progress finish for up to graceful_timeout, and cancel what is left. Started
        with the port it listens on (for port 0). `reuse_port`: share the port with the
        host's other router workers (SO_REUSEPORT; the kernel spreads connections)."""
        if reuse_port:
            listeners = [await _reuse_port_listener(addr)]
        else:
            listeners = await trio.open_tcp_listeners(addr[1], host=addr[0])
        async with trio.open_nursery() as nursery:
            accepting = trio.CancelScope()

            async def accept_all() -> None:
                with accepting:
                    async with trio.open_nursery() as accepters:
                        for listener in listeners:
                            accepters.start_soon(self._accept, listener, nursery)

            nursery.start_soon(accept_all)
            nursery.start_soon(self.watch_writes)
            task_status.started(listeners[0].socket.getsockname()[1])
            await shutdown_trigger()
            self.stopping = True
            accepting.cancel()
            for listener in listeners:
                await listener.aclose()
            for conn in list(self.connections):
                conn.stop_if_idle()
            with trio.move_on_after(self.graceful_timeout):
                if self.connections:
                    await self._all_closed.wait()
            nursery.cancel_scope.cancel()

    async def watch_writes(self) -> None:
        """Close every connection whose write made no progress for write_timeout.

        The keep-alive deadline covers a connection waiting for a request; this covers
        one blocked writing to a client that reads nothing, which would otherwise hold
        its request, and the agent's slot, until the request's deadline. Closing the
        socket ends the blocked write and the app's wait for `http.disconnect` at once,
        so the request ends the way a client that left ends it.
        """
        period = min(WATCH_PERIOD, self.write_timeout / 4)
        while True:
            await trio.sleep(period)
            since = trio.current_time() - self.write_timeout
            for conn in list(self.connections):
                if conn.write_began < since:
                    await conn.abandon()

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                log.warning(
                    "http_accept_failed error=%s retry_s=%g",
                    errno.errorcode[exc.errno],
                    ACCEPT_RETRY_DELAY,
                )
                await trio.sleep(ACCEPT_RETRY_DELAY)
                continue
            nursery.start_soon(self.run_connection, stream)

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


class _Connection:
    def __init__(self, server: HttpServer, stream: trio.abc.Stream) -> None:
        self.server = server
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.scope = trio.CancelScope()
        self.state = ACTIVE
        self.requests = 0
        # When the write in progress began (inf: none), for the write watchdog.
        self.write_began = math.inf
        # Per request:
        self.request: h11.Request | None = None
        self.answer = READING
        self.head: h11.Response | None = None
        self.client = self.server_addr = None
        sock = getattr(stream, "socket", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                self.client = _addr(sock.getpeername())
                self.server_addr = _addr(sock.getsockname())

    @property
    def peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "-"

    def __repr__(self) -> str:
        return (
            f"<_Connection HTTP/1.1, {self.state.value}, request {self.answer.value},"
            f" Request Count: {self.requests}, peer {self.peer}>"
        )

    def stop_if_idle(self) -> None:
        if self.state is IDLE:
            self.scope.cancel()

    async def abandon(self) -> None:
        """The client stopped reading: close the socket under the blocked write."""
        log.info("http_write_timeout client=%s timeout_s=%g", self.peer, self.server.write_timeout)
        self.state = CLOSED
        self.write_began = math.inf
        await self.stream.aclose()

    async def run(self) -> None:
        try:
            with self.scope:
                while not self.server.stopping:
                    request = await self._next_request()
                    if request is None:
                        break
                    await self._serve(request)
                    if not await self._ready_for_next():
                        break
        finally:
            await self._close()

    async def _next_request(self) -> h11.Request | None:
        self.state = IDLE
        self.scope.deadline = trio.current_time() + self.server.keep_alive_timeout
        first_read = b""
        try:
            while True:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError as exc:
                    await self._refuse_head(exc, first_read)
                    return None
                if event is h11.NEED_DATA:
                    data = await self._read()
                    if not data:
                        return None
                    first_read = first_read or data
                    continue
                return event if isinstance(event, h11.Request) else None
        finally:
            if self.state is IDLE:
                self.state = ACTIVE
            self.scope.deadline = math.inf

    async def _read(self) -> bytes:
        """Feed h11 one read from the socket; b"" when the client is gone."""
        try:
            data = await self.stream.receive_some(READ_BYTES)
        except _GONE:
            data = b""
        self.h11.receive_data(data)
        if not data:
            self.state = CLOSED
        return data

    async def _serve(self, request: h11.Request) -> None:
        self.request = request
        self.requests += 1
        self.head = None
        self.answer = READING
        target = bytes(request.target)
        raw_path, _, query = target.partition(b"?")
        path = unquote(raw_path.decode("ascii", "replace"))
        headers = list(request.headers)
        problem = _head_problem(request, headers)
        if problem is not None:
            await self._refuse(problem[0], ErrorCode.REQUEST_INVALID, problem[1], path)
            return
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode(),
            "method": request.method.decode(),
            "scheme": "http",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self.client,
            "server": self.server_addr,
        }
        try:
            await self.server.app(scope, self.receive, self.send)
        except Exception:
            log.exception("http_app_error path=%s", path)
        if self.answer is READING and self.state is not CLOSED:
            # The app ended without an answer: the client still gets one.
            self.head = None
            await self.send({"type": "http.response.start", "status": 500, "headers": []})
            await self.send({"type": "http.response.body", "body": b""})
        if self.answer is RESPONDING:  # the app left mid-answer
            self.answer = BROKEN

    async def receive(self) -> dict:
        if self.state is CLOSED or self.h11.their_state is not h11.SEND_BODY:
            if self.answer is REFUSED:
                return _BODY_REFUSED
            return await self._wait_for_disconnect()
        if self.h11.they_are_waiting_for_100_continue:
            await self._write(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
        parts: list[bytes] = []
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                # Bad chunked framing (a body cut short ends at the empty read below).
                if self.answer is READING and self.state is not CLOSED:
                    message = f"malformed request body: {exc}"
                    await self._refuse(400, ErrorCode.REQUEST_INVALID, message, self._path())
                    return _BODY_REFUSED
                if self.answer is not REFUSED:
                    self.answer = BROKEN
                return _DISCONNECT
            if isinstance(event, h11.Data):
                parts.append(bytes(event.data))
                continue
            if isinstance(event, h11.EndOfMessage):
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            if event is h11.NEED_DATA and not parts:
                if not await self._read():
                    return _DISCONNECT
                continue
            if parts:
                return {"type": "http.request", "body": b"".join(parts), "more_body": True}
            self.state = CLOSED
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
            self.h11.receive_data(data)  # a pipelined request, kept for later
        return _DISCONNECT

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.answer is not READING:
                if self.answer is REFUSED:
                    return
                raise RuntimeError("http.response.start sent twice")
            status = message["status"]
            headers = [(b"date", self.server.date()), *message.get("headers", ())]
            if self.server.stopping:  # this connection ends after this answer: say so
                headers.append((b"connection", b"close"))
            try:
                if type(status) is not int or not 200 <= status <= 599:
                    raise ValueError(f"status {status!r} is outside 200-599")
                self.head = h11.Response(status_code=status, headers=headers)
            except (h11.LocalProtocolError, ValueError, TypeError) as exc:
                await self._unsendable(exc)
            self.answer = RESPONDING
            if any(name.lower() == b"content-length" for name, _ in headers):
                return  # held until the body, so both leave in one write
            await self._flush_head()
        elif kind == "http.response.body":
            if self.answer is not RESPONDING:
                if self.answer is REFUSED:
                    return
                if self.answer is not BROKEN:
                    raise RuntimeError("http.response.body outside a response")
            body = message.get("body", b"")
            more = message.get("more_body", False)
            parts = []
            held = self.head is not None
            try:
                if held:
                    parts.append(self.h11.send(self.head))
                    self.head = None
                if body and self.request is not None and self.request.method != b"HEAD":
                    parts.append(self.h11.send(h11.Data(data=body)))
                if not more:
                    parts.append(self.h11.send(h11.EndOfMessage()))
            except h11.LocalProtocolError as exc:  # more body than its Content-Length, say
                self.head = None
                if held:
                    await self._unsendable(exc)
                self.answer = BROKEN
                raise
            if not more and self.answer is RESPONDING:
                self.answer = DONE
            if parts:
                await self._write(b"".join(parts))

    async def _flush_head(self) -> None:
        if self.head is not None:
            head, self.head = self.head, None
            try:
                data = self.h11.send(head)
            except h11.LocalProtocolError as exc:
                await self._unsendable(exc)
            await self._write(data)

    async def _unsendable(self, exc: Exception) -> NoReturn:
        """Nothing of the app's answer went out and none can: a 502 goes instead, and
        the app learns it from the exception."""
        message = f"the answer's head cannot be sent: {exc}"
        await self._refuse(502, ErrorCode.BACKEND_ERROR, message, self._path(), "backend")
        raise UnsendableHead(str(exc)) from exc

    async def _write(self, data: bytes | None) -> None:
        # A client that left gets nothing more; the app learns it from receive(). The
        # checkpoint lets an app that keeps writing in a loop still be cancelled.
        if self.state is CLOSED:
            await trio.lowlevel.checkpoint()
            return
        if not data:
            return
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
            self.state = CLOSED
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
        if self.h11.their_state is h11.SEND_BODY:
            await self._discard_body()
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            return True
        return False

    async def _discard_body(self) -> None:
        """The app answered without reading the whole body: drop the rest."""
        dropped = 0
        with trio.move_on_after(DISCARD_TIMEOUT):
            while dropped <= DISCARD_BYTES:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError:
                    return
                if isinstance(event, h11.Data):
                    dropped += len(event.data)
                elif event is h11.NEED_DATA:
                    if not await self._read():
                        return
                else:
                    return

    async def _refuse_head(self, exc: h11.RemoteProtocolError, first_read: bytes) -> None:
        """A request head h11 cannot take: 400, or 431 when it is too large."""
        status = exc.error_status_hint
        if status == 431:
            message = f"request head larger than {MAX_HEAD_BYTES} bytes"
            # Nothing of the head was consumed: it starts the buffer.
            first_read = self.h11.trailing_data[0]
        elif status == 501:  # h11's answer to a transfer coding other than `chunked`
            status, message = 400, "only Transfer-Encoding: chunked is supported"
        else:
            message = f"malformed request: {exc}"
        # The path chooses the error format; a head that began in an earlier read (a
        # pipelined one) is answered in the default format.
        await self._refuse(status, ErrorCode.REQUEST_INVALID, message, _path_of(first_read))

    async def _refuse(
        self, status: int, code: ErrorCode, message: str, path: str, source: str = "router"
    ) -> None:
        """Answer for the app in the caller's error format, and close after it."""
        self.answer = REFUSED
        log.info(
            "http_refused status=%d code=%s client=%s path=%s reason=%s",
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
            b"content-length: %d\r\nconnection: close\r\n\r\n"
            % (status, http.HTTPStatus(status).phrase.encode(), self.server.date(), len(body))
        )
        await self._write(head + body)

    def _path(self) -> str:
        if self.request is None:
            return ""
        return unquote(bytes(self.request.target).partition(b"?")[0].decode("ascii", "replace"))

    async def _close(self) -> None:
        try:
            if self.state is not CLOSED:
                await self.stream.send_eof()
                with trio.move_on_after(LINGER_TIMEOUT):
                    while await self.stream.receive_some(READ_BYTES):
                        pass
        except _GONE:
            pass
        finally:
            await self.stream.aclose()


def _head_problem(
    request: h11.Request, headers: list[tuple[bytes, bytes]]
) -> tuple[int, str] | None:
    """Why a parsed head must be refused (status, message), or None.

    h11 bounds a head only while it is incomplete, so one read of up to 64 KiB can
    bring a whole head of any size: it is measured here, as its request line and
    `name: value` lines. h11 frames a request with both Content-Length and
    Transfer-Encoding by its chunks; a proxy in front may frame it by its length.
    """
    size = len(request.method) + len(request.target) + 14
    size += sum(len(name) + len(value) + 4 for name, value in headers)
    if size > MAX_HEAD_BYTES:
        return 431, f"request head larger than {MAX_HEAD_BYTES} bytes"
    names = dict(headers)
    if b"transfer-encoding" in names and b"content-length" in names:
        return 400, "a request may not have both Content-Length and Transfer-Encoding"
    return None


def _path_of(head: bytes) -> str:
    """The path of the request line that starts `head`, or "" when there is none."""
    line = head[:MAX_HEAD_BYTES].partition(b"\r\n")[0]
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return ""
    return unquote(parts[1].partition(b"?")[0].decode("ascii", "replace"))


def _addr(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return (str(value[0]), int(value[1]))
    return None


async def _reuse_port_listener(addr: tuple[str, int]) -> trio.SocketListener:
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    try:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEPORT, 1)
        await sock.bind(addr)
        # trio's own default backlog (open_tcp_listeners), the kernel's somaxconn.
        sock.listen(0xFFFF)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)
