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
"""

from __future__ import annotations

import contextlib
import email.utils
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import h11
import trio

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

_DISCONNECT = {"type": "http.disconnect"}
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class HttpServer:
    def __init__(
        self,
        app: App,
        keep_alive_timeout: float = 75.0,
        graceful_timeout: float = 1.0,
    ) -> None:
        self.app = app
        self.keep_alive_timeout = keep_alive_timeout
        self.graceful_timeout = graceful_timeout
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

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # out of descriptors, say: keep serving the others
                log.warning("http_accept_failed error=%s", type(exc).__name__)
                await trio.sleep(0.1)
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
        self.idle = False
        # Per request:
        self.request: h11.Request | None = None
        self.head: h11.Response | None = None
        self.started = False
        self.complete = False
        self.body_done = False
        self.gone = False
        self.must_close = False
        self.client = self.server_addr = None
        sock = getattr(stream, "socket", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                self.client = _addr(sock.getpeername())
                self.server_addr = _addr(sock.getsockname())

    def stop_if_idle(self) -> None:
        if self.idle:
            self.scope.cancel()

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
        self.idle = True
        self.scope.deadline = trio.current_time() + self.server.keep_alive_timeout
        try:
            while True:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError as exc:
                    await self._refuse(exc.error_status_hint)
                    return None
                if event is h11.NEED_DATA:
                    if not await self._read():
                        return None
                    continue
                return event if isinstance(event, h11.Request) else None
        finally:
            self.idle = False
            self.scope.deadline = math.inf

    async def _read(self) -> bool:
        """Feed h11 one read from the socket; False when the client is gone."""
        try:
            data = await self.stream.receive_some(READ_BYTES)
        except _GONE:
            data = b""
        self.h11.receive_data(data)
        if not data:
            self.gone = True
        return bool(data)

    async def _serve(self, request: h11.Request) -> None:
        self.request = request
        self.head = None
        self.started = self.complete = self.body_done = False
        target = bytes(request.target)
        raw_path, _, query = target.partition(b"?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode(),
            "method": request.method.decode(),
            "scheme": "http",
            "path": unquote(raw_path.decode("ascii", "replace")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
            "client": self.client,
            "server": self.server_addr,
        }
        try:
            await self.server.app(scope, self.receive, self.send)
        except Exception:
            log.exception("http_app_error path=%s", scope["path"])
        if not self.started and not self.gone:
            # The app ended without an answer: the client still gets one.
            self.head = None
            await self.send({"type": "http.response.start", "status": 500, "headers": []})
            await self.send({"type": "http.response.body", "body": b""})
        if not self.complete:
            self.must_close = True

    async def receive(self) -> dict:
        if self.body_done or self.gone:
            return await self._wait_for_disconnect()
        if self.h11.they_are_waiting_for_100_continue:
            await self._write(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
        parts: list[bytes] = []
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError:
                self.gone = self.must_close = True
                return _DISCONNECT
            if isinstance(event, h11.Data):
                parts.append(bytes(event.data))
                continue
            if isinstance(event, h11.EndOfMessage):
                self.body_done = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            if event is h11.NEED_DATA and not parts:
                if not await self._read():
                    return _DISCONNECT
                continue
            if parts:
                return {"type": "http.request", "body": b"".join(parts), "more_body": True}
            self.gone = True
            return _DISCONNECT

    async def _wait_for_disconnect(self) -> dict:
        """After the body: the only message left is the client leaving."""
        ahead = 0
        while not self.gone:
            if ahead > MAX_AHEAD_BYTES:
                await trio.sleep_forever()
            try:
                data = await self.stream.receive_some(READ_BYTES)
            except _GONE:
                data = b""
            if not data:
                self.gone = True
                break
            ahead += len(data)
            self.h11.receive_data(data)  # a pipelined request, kept for later
        return _DISCONNECT

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            headers = [(b"date", self.server.date()), *message.get("headers", ())]
            if self.server.stopping:  # this connection ends after this answer: say so
                headers.append((b"connection", b"close"))
            self.head = h11.Response(status_code=message["status"], headers=headers)
            if any(name.lower() == b"content-length" for name, _ in headers):
                return  # held until the body, so both leave in one write
            await self._flush_head()
        elif kind == "http.response.body":
            if not self.started or self.complete:
                raise RuntimeError("http.response.body outside a response")
            body = message.get("body", b"")
            more = message.get("more_body", False)
            parts = []
            if self.head is not None:
                parts.append(self.h11.send(self.head))
                self.head = None
            if body and self.request is not None and self.request.method != b"HEAD":
                parts.append(self.h11.send(h11.Data(data=body)))
            if not more:
                parts.append(self.h11.send(h11.EndOfMessage()))
                self.complete = True
            if parts:
                await self._write(b"".join(parts))

    async def _flush_head(self) -> None:
        if self.head is not None:
            head, self.head = self.head, None
            await self._write(self.h11.send(head))

    async def _write(self, data: bytes | None) -> None:
        # A client that left gets nothing more; the app learns it from receive().
        if not data or self.gone:
            return
        done = False
        try:
            await self.stream.send_all(data)
            done = True
        except _GONE:
            self.gone = True
            done = True
        finally:
            if not done:  # cancelled part way: the connection cannot carry another answer
                self.must_close = True

    async def _ready_for_next(self) -> bool:
        if self.must_close or self.gone or self.server.stopping:
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

    async def _refuse(self, status: int) -> None:
        """A request h11 cannot parse: answer with its status and close."""
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        headers = [
            (b"date", self.server.date()),
            (b"content-length", b"0"),
            (b"connection", b"close"),
        ]
        try:
            data = self.h11.send(h11.Response(status_code=status, headers=headers))
            data = (data or b"") + (self.h11.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            return
        await self._write(data)

    async def _close(self) -> None:
        try:
            if not self.gone:
                await self.stream.send_eof()
                with trio.move_on_after(LINGER_TIMEOUT):
                    while await self.stream.receive_some(READ_BYTES):
                        pass
        except _GONE:
            pass
        finally:
            await self.stream.aclose()


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
