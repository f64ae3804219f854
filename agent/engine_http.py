"""The agent's HTTP/1.1 client for its one engine, on the request path.

httpx cost the agent more CPU per request than the whole router (docs/benchmarks/index.md,
*Router overhead*): its pool, h11's pure-Python parsing, and per-request machinery the agent
never uses (cookies alone were 5% of the agent's samples, redirects, proxies, auth,
content decoding). The agent talks to one origin over a handful of keep-alive
connections, so this is all it needs: a LIFO pool of trio streams, responses parsed by
llhttp (`httptools`, the parser uvicorn uses, hardened against request smuggling), the
body handed on as it arrives, every chunk of one socket read together.

Failures are two exceptions. `EngineUnavailable`: no answer head came (refused,
unreachable, timed out, a head that is not HTTP/1.1 or larger than `MAX_HEAD_BYTES`);
nothing of the answer exists, so another agent can be tried. `EngineBrokeOff`: the head
came and the body did not arrive whole (closed early, a bad chunk, silent for the read
timeout, larger than the caller's limit).

Timeouts, from `--http-timeout`: connecting gets `connect`; the request write and the
whole head get one `read` from the moment the connection is ready (so an engine that
dribbles its head a byte at a time cannot hold the request longer than that), as does a
whole answer read with `read_all`; a streamed body may go on as long as its engine is
never silent for `read` (it is cut off between 1 and 1.25 times `read` after its last
bytes). Within one answer these are deadlines of one cancel scope (`ReadLimits`), or,
in an agent's session, deadlines its watchdog keeps for that scope.
"""

from __future__ import annotations

import base64
import contextlib
import math
import select
import socket
import ssl
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import SplitResult, unquote, urlsplit

import httptools
import outcome
import trio

from protocol.sockets import readable_now, receive_when_ready, send_at_once, stdlib_socket

RECEIVE_BYTES = 64 * 1024
# After a wake-up that found several streams with bytes, the pump reads again this much
# later at the soonest, so that what their engines write meanwhile leaves in one frame
# and one write: read as soon as it came, each stream's bytes went in more, smaller
# frames, which cost both daemons (`bench.stream_relay --tokens 512 --concurrency 8`:
# router 5.55 → 3.26, agent 9.75 → 5.92 ms CPU per stream). The pause ends with a loop
# turn at least this late: epoll's timeout is whole milliseconds, so in a loop that
# nothing else wakes it lasts 1.1 ms. An event that comes in it waits for its end, up
# to that; a stream read alone never waits. A pause of exactly 0.2 ms (a timerfd,
# tried 2026-12-06) coalesced less: router 3.73 → 8.56, agent 6.57 → 11.47 ms.
PUMP_PACE = 0.0002
# An engine's head is a few hundred bytes; h11 (httpx) refused any over 16 KiB. A
# head still unfinished after this much is not an answer.
MAX_HEAD_BYTES = 64 * 1024
# What the pool reads of a finished stream's body after its last event, and how long it
# waits for it, before it gives up on the connection (`EngineResponse.finish_later`):
# only the chunked end is expected, microseconds after the last event.
FINISH_BYTES = 64 * 1024
FINISH_SECONDS = 1.0
# uvicorn (vLLM, SGLang) and hypercorn (the sim) close a connection idle for 5 s; the
# agent drops its own a second earlier, so it never writes into one being closed.
KEEPALIVE_EXPIRY = 4.0
# Bodies smaller than this are written with their head, in one send.
_JOIN_BODY_BYTES = 64 * 1024
# Set by the client itself; a header of the router's by these names is left out.
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
_NO_BODY_STATUS = frozenset({204, 304})


class EngineError(Exception):
    """The engine call failed; the message says how."""


class EngineUnavailable(EngineError):
    """No answer head arrived: nothing of an answer exists."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class EngineBrokeOff(EngineError):
    """The head arrived, the body did not arrive whole."""


@dataclass(frozen=True)
class EngineTimeouts:
    connect: float
    read: float


class ClosableStream(Protocol):
    """A stream with a synchronous close, as tests hand in instead of a socket."""

    async def send_all(self, data: bytes) -> None: ...

    async def receive_some(self, max_bytes: int | None = None) -> bytes: ...

    def close(self) -> None: ...


OpenStream = Callable[[], Awaitable[ClosableStream]]


class _Connection:
    __slots__ = ("idle_since", "pending", "raw", "sock", "stream")

    def __init__(
        self, stream: trio.abc.Stream | ClosableStream, sock: trio.socket.SocketType | None
    ) -> None:
        self.stream = stream
        # The socket under the stream, to look at while idle and to close; None for a
        # stream handed in by a test.
        self.sock = sock
        # The stdlib socket under a plain TCP stream (`EngineResponse._read`).
        self.raw = stdlib_socket(stream)
        self.idle_since = 0.0
        # The answer whose body's end is still to be read (`EngineResponse.finish_later`).
        self.pending: EngineResponse | None = None

    def reusable(self) -> bool | None:
        """Whether an idle connection can carry the next request: its last answer read
        to its end, and nothing else to read (an engine's close, or bytes no request
        asked for); None while the end of its last answer is still on its way
        (`EngineResponse.finish_later`). One poll, or the pending end's reads, no wait."""
        pending = self.pending
        if pending is None:
            return self.sock is None or not readable_now(self.sock)
        assert self.raw is not None  # finish_later holds only plain TCP connections
        done = pending.finish_now(self.raw)
        if done is not None:
            self.pending = None
        return done

    async def send_all(self, data: bytes) -> None:
        """Straight to the socket while the kernel has room: trio's `send_all` passes
        through the scheduler after a write that went out whole, one task step more
        before each request reaches the engine. The rest waits for room through trio."""
        raw = self.raw
        sent = 0
        if raw is not None:
            sent = send_at_once(raw, data)
            if sent == len(data):
                return
        await self.stream.send_all(memoryview(data)[sent:] if sent else data)

    def close(self) -> None:
        # Synchronous, so it runs in any `finally`, cancelled or not: the engine sees the
        # connection end, which is how it notices an abandoned request.
        if self.sock is not None:
            self.sock.close()
        else:
            self.stream.close()  # type: ignore[union-attr]


def check_engine_url(url: str) -> SplitResult:
    """The parts of an engine URL; ValueError says what is wrong with it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--backend-url must be an http:// or https:// URL: {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise ValueError(f"--backend-url {url!r}: {exc}") from None
    return parts


class EnginePool:
    """Keep-alive connections to one engine origin, most recently used first.

    Taking a connection looks at one socket (`_Connection.reusable`), not at every pooled
    one as httpcore did; connections idle for `KEEPALIVE_EXPIRY` are dropped as others
    come back. At most `max_idle` wait; every connection in use is one request in
    flight, which the agent's `--capacity` bounds.
    """

    def __init__(
        self,
        backend_url: str,
        timeouts: EngineTimeouts,
        max_idle: int,
        open_stream: OpenStream | None = None,
    ) -> None:
        parts = check_engine_url(backend_url)
        self._tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        host = parts.netloc.rpartition("@")[2]  # never the URL's user:password
        self.origin = f"{parts.scheme}://{host}"
        # The engine's kind (`--engine`), for what its API can be asked (agent/usage.py).
        self.kind = ""
        self._own_lines = [f"host: {host}"]
        self._skip = _OWN_HEADERS
        if parts.username is not None:
            # A user and password in the URL are the engine's Basic authentication (as
            # httpx sent them): they replace any authorization the request carried.
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            token = base64.b64encode(pair.encode()).decode()
            self._own_lines.append(f"authorization: Basic {token}")
            self._skip = _OWN_HEADERS | {"authorization"}
        self._prefix = parts.path.rstrip("/")
        self.timeouts = timeouts
        self._max_idle = max(1, max_idle)
        self._open_stream = open_stream
        self._idle: deque[_Connection] = deque()
        self.connections_opened = 0
        # Reads streamed bodies while `run_pump` runs (the daemon's); None: each
        # stream's task reads its own.
        self.pump: ReadPump | None = None

    def __repr__(self) -> str:
        idle, opened = len(self._idle), self.connections_opened
        return f"<EnginePool {self.origin}, {idle} idle, {opened} opened>"

    async def __aenter__(self) -> EnginePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def send(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        limits: ReadLimits | None = None,
    ) -> EngineResponse:
        """Send one request and read its head; raises EngineUnavailable.

        The head's timeout is a deadline of `limits`' scope, which the caller holds
        and reads the expiry of; without `limits`, a scope of its own.
        The caller must `close()` the response, read or not.
        """
        head = self._head(method, path, headers, len(body))
        conn = self._take()
        if conn is None:
            conn = await self._connect()
        response = EngineResponse(self, conn, method == "HEAD")
        try:
            if limits is not None:
                limits.head()
                await self._ask(conn, head, body, response)
            else:
                with trio.move_on_after(self.timeouts.read) as scope:
                    await self._ask(conn, head, body, response)
                if scope.cancelled_caught:
                    raise head_timeout(self.timeouts.read)
        except BaseException:
            conn.close()
            raise
        return response

    async def _ask(
        self, conn: _Connection, head: bytes, body: bytes, response: EngineResponse
    ) -> None:
        try:
            if len(body) < _JOIN_BODY_BYTES:
                await conn.send_all(head + body)
            else:
                await conn.send_all(head)
                await conn.send_all(body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise EngineUnavailable(f"engine closed the connection: {_why(exc)}") from None
        await response.read_head()

    def _head(self, method: str, path: str, headers: dict[str, str], length: int) -> bytes:
        lines = [f"{method} {self._prefix}{path} HTTP/1.1", *self._own_lines]
        if length or method not in ("GET", "HEAD"):
            lines.append(f"content-length: {length}")
        skip = self._skip
        lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in skip]
        text = "\r\n".join(lines) + "\r\n\r\n"
        # A CR or LF inside a name, value or the path would start a line of its own: a
        # header (or a request) nobody asked for.
        if text.count("\n") != len(lines) + 1 or text.count("\r") != len(lines) + 1:
            raise EngineUnavailable("request line or header holds a line break; not sent")
        try:
            return text.encode("latin-1")
        except UnicodeEncodeError:
            raise EngineUnavailable("request header is not Latin-1 text; not sent") from None

    def _take(self) -> _Connection | None:
        now = trio.current_time()
        idle = self._idle
        unfinished: list[_Connection] | None = None
        taken = None
        while idle:
            conn = idle.pop()
            if now - conn.idle_since >= KEEPALIVE_EXPIRY:
                conn.close()
                continue
            usable = conn.reusable()
            if usable:
                taken = conn
                break
            if usable is None and now - conn.idle_since < FINISH_SECONDS:
                unfinished = unfinished or []
                unfinished.append(conn)
            else:
                conn.close()
        if unfinished:
            # Back where they were, under every connection ready to use.
            idle.extendleft(unfinished)
        return taken

    async def tidy(self, every: float = 1.0) -> None:
        """Close, every `every` seconds, the idle connections past `KEEPALIVE_EXPIRY` and
        those whose answer's end has not come within `FINISH_SECONDS`, so that an
        engine still writing an answer nobody reads sees it dropped even when no other
        request comes to take the connection."""
        while True:
            await trio.sleep(every)
            now = trio.current_time()
            kept: deque[_Connection] = deque()
            for conn in self._idle:
                if now - conn.idle_since >= KEEPALIVE_EXPIRY or (
                    conn.pending is not None
                    and now - conn.idle_since >= FINISH_SECONDS
                    and not conn.reusable()
                ):
                    conn.close()
                else:
                    kept.append(conn)
            self._idle = kept

    async def run_pump(self) -> None:
        """Read the streamed bodies of this pool's plain TCP connections in one task
        (`ReadPump`) until cancelled."""
        pump = self.pump = ReadPump()
        try:
            await pump.run()
        finally:
            self.pump = None
            pump.close()

    def _put_back(self, conn: _Connection) -> None:
        now = conn.idle_since = trio.current_time()
        idle = self._idle
        # The oldest are at the left: drop the expired ones, and the surplus.
        while idle and (
            now - idle[0].idle_since >= KEEPALIVE_EXPIRY or len(idle) >= self._max_idle
        ):
            idle.popleft().close()
        if conn.pending is None:
            idle.append(conn)
        else:
            # Its answer's end is due any moment: taken after those ready now, by
            # when it has come.
            idle.appendleft(conn)

    async def _connect(self) -> _Connection:
        with trio.move_on_after(self.timeouts.connect) as scope:
            try:
                if self._open_stream is not None:
                    stream = await self._open_stream()
                    self.connections_opened += 1
                    return _Connection(stream, None)
                tcp = await trio.open_tcp_stream(self._host, self._port)
                stream = tcp
                if self._tls:
                    # https_compatible: an HTTPS server may end a close-delimited
                    # body without TLS's close_notify.
                    stream = trio.SSLStream(
                        tcp,
                        ssl.create_default_context(),
                        server_hostname=self._host,
                        https_compatible=True,
                    )
                    try:
                        await stream.do_handshake()
                    except BaseException:
                        tcp.socket.close()
                        raise
                self.connections_opened += 1
                return _Connection(stream, tcp.socket)
            except (trio.BrokenResourceError, OSError) as exc:
                raise EngineUnavailable(f"cannot connect to {self.origin}: {_why(exc)}") from None
        raise EngineUnavailable(
            f"no connection to {self.origin} within {self.timeouts.connect:g} s",
            timed_out=scope.cancelled_caught,
        )


_HEAD, _WHOLE, _STREAM, _DRAIN = "head", "whole", "stream", "drain"


class ReadLimits:
    """One answer's read timeouts, as deadlines of one cancel scope: the request's.

    Entering and leaving a trio cancel scope costs some 5 µs; a scope for each phase
    of an answer (its head, its body, the drain after a stream's last event) was three
    per streamed answer besides the request's own, which the router's cancel ends.
    Each phase moves that one scope's deadline instead. From the moment each begins:

    - `head`: the request's write and the whole answer head within `timeout`;
    - `whole`: a whole answer's body within `timeout`;
    - `stream`: a streamed body is never silent for `timeout`. The deadline moves only
      when bytes arrive less than `timeout` before it, and then to 1.25 timeouts
      ahead: an engine is cut off between 1 and 1.25 timeouts after its last bytes,
      for one deadline change every few hundred reads of a busy stream;
    - `drain`: `seconds` to read the end of a body whose answer is already complete.

    `watched`: the deadline is kept in `deadline` only, and a watchdog (the agent
    session's, agent/link.py) cancels the scope within a quarter second after it has
    passed; a stream's moves with each read, to `timeout` ahead. A change of the
    scope's own deadline cost trio 1.9 µs, three or four per answer.
    """

    __slots__ = ("_now", "_phase", "deadline", "scope", "timeout", "watched")

    def __init__(
        self,
        timeout: float,
        scope: trio.CancelScope | None = None,
        watched: bool = False,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.timeout = timeout
        self.scope = scope if scope is not None else trio.CancelScope()
        self.watched = watched
        self.deadline = math.inf
        self._phase = _HEAD
        # The run's clock, read without trio.current_time()'s two calls around it: it
        # is read on every read of a stream. A session passes its own.
        self._now = clock or trio.lowlevel.current_clock().current_time

    def head(self) -> None:
        self._begin(_HEAD, self.timeout)

    def whole(self) -> None:
        self._begin(_WHOLE, self.timeout)

    def stream(self) -> None:
        self._begin(_STREAM, 1.25 * self.timeout)

    def drain(self, seconds: float) -> None:
        self._begin(_DRAIN, seconds)

    def arrived(self) -> None:
        """Bytes of a stream came: it has at least `timeout` more to send the next."""
        now = self._now()
        if self.watched:
            self.deadline = now + self.timeout
        elif self.scope.deadline < now + self.timeout:
            self.scope.deadline = now + 1.25 * self.timeout

    def expired(self) -> EngineError | None:
        """When the scope was cancelled: the failure its deadline made, if the deadline
        ended it.

        None when something else cancelled it (the router's cancel) or it ended the
        drain, after which the answer was already whole."""
        deadline = self.deadline if self.watched else self.scope.deadline
        if trio.current_time() < deadline:
            return None
        if self._phase is _HEAD:
            return head_timeout(self.timeout)
        if self._phase is _WHOLE:
            return EngineBrokeOff(f"answer not whole within {self.timeout:g} s")
        if self._phase is _STREAM:
            return EngineBrokeOff(f"no answer data for {self.timeout:g} s")
        return None

    def _begin(self, phase: str, seconds: float) -> None:
        self._phase = phase
        if self.watched:
            self.deadline = self._now() + seconds
        else:
            self.scope.deadline = self._now() + seconds


def head_timeout(timeout: float) -> EngineUnavailable:
    return EngineUnavailable(f"no answer head within {timeout:g} s", timed_out=True)


class EngineResponse:
    """One answer: status and headers once `send` returns, then the body as it comes.

    It is its own llhttp protocol object: the parser's callbacks land on it.
    """

    __slots__ = (
        "_body",
        "_complete",
        "_conn",
        "_error",
        "_extra",
        "_finish_later",
        "_finish_left",
        "_head_only",
        "_keep_alive",
        "_parser",
        "_pool",
        "_raw",
        "headers",
        "status",
    )

    def __init__(self, pool: EnginePool, conn: _Connection, head_only: bool) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self._head_only = head_only
        self._parser = httptools.HttpResponseParser(self)
        self._raw: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._complete = False
        self._extra = False
        self._finish_later = False
        self._finish_left = FINISH_BYTES
        self._keep_alive = False
        self._error = ""
        self.status = 0
        # Lower-case names; a repeated header's values joined with ", " (as httpx did).
        self.headers: dict[str, str] = {}

    def __repr__(self) -> str:
        state = "complete" if self._complete else "open" if self._conn else "closed"
        return f"<EngineResponse {self.status}, {state}>"

    # --- llhttp callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            self._extra = True  # bytes after the answer: the connection is not reused

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            self._raw = []  # an informational answer; the real one follows
            return
        self.status = status
        self._keep_alive = self._parser.should_keep_alive()
        headers = self.headers
        for name, value in self._raw:
            key = name.decode("latin-1").lower()
            text = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if self._head_only or status in _NO_BODY_STATUS:
            self._complete = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.status:
            self._complete = True

    # --- reading ---------------------------------------------------------------------

    async def read_head(self) -> None:
        fed = 0
        while not self.status:
            data = await self._read()
            if not data:
                raise EngineUnavailable("engine closed the connection without an answer")
            fed += len(data)
            self._feed(data)
            if self._error and not self.status:
                raise EngineUnavailable(f"answer head is not HTTP/1.1: {self._error}")
            if not self.status and fed > MAX_HEAD_BYTES:
                raise EngineUnavailable(f"answer head larger than {MAX_HEAD_BYTES} bytes")

    async def receive(self, wait_first: bool = True) -> bytes:
        """The next body bytes, all that one socket read brought; b"" at the end.

        No read timeout of its own: the caller's cancel scope bounds the wait, one for
        a whole answer (`read_all`) or a stream (`ReadLimits.stream`). A scope armed for each
        read was the agent's largest single cost on streams: 6.6 cancel scopes per
        16-token stream, about a fifth of its Python time (cProfile, 64 clients).
        `wait_first=False`: the socket's first read is tried before any wait (`_read`).
        """
        while True:
            if self._body:
                parts = self._body
                self._body = []
                return parts[0] if len(parts) == 1 else b"".join(parts)
            if self._error:
                raise EngineBrokeOff(f"answer is not valid HTTP/1.1: {self._error}")
            if self._complete:
                return b""
            data = await self._read(wait_first)
            wait_first = True
            if not data:
                return self._closed_by_engine()
            self._feed(data)

    def _closed_by_engine(self) -> bytes:
        """The engine closed the connection: the end of an answer it delimits so (b""),
        else EngineBrokeOff."""
        if self._close_delimited():
            self._complete = True
            self._keep_alive = False
            return b""
        raise EngineBrokeOff("engine closed the connection inside the answer")

    async def read_all(self, limit: int, limits: ReadLimits | None = None) -> bytes:
        """The whole body, within one read timeout; EngineBrokeOff past `limit` bytes.

        The timeout is a deadline of `limits`' scope when given (`EnginePool.send`)."""
        declared = self.headers.get("content-length")
        if declared is not None and int(declared) > limit:
            raise EngineBrokeOff(f"answer of {declared} bytes exceeds {limit}")
        if limits is not None:
            limits.whole()
            return await self._read_all(limit)
        with trio.move_on_after(self._pool.timeouts.read):
            return await self._read_all(limit)
        raise EngineBrokeOff(f"answer not whole within {self._pool.timeouts.read:g} s")

    async def _read_all(self, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        # Engines write a whole answer's head and body apart, the body microseconds
        # later: by the time the head is handled it is mostly there, and a read that
        # takes it at once spares a wait in epoll and a pass through trio's loop.
        wait_first = False
        while chunk := await self.receive(wait_first):
            wait_first = True
            size += len(chunk)
            if size > limit:
                raise EngineBrokeOff(f"answer larger than {limit} bytes")
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def read_whole(self) -> bool:
        """Everything of the answer has been read: `receive` has nothing left to wait for."""
        return self._complete and not self._body

    def close(self) -> None:
        """Give the connection back when the answer was read whole (or its end is left
        to read, `finish_later`), else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._extra or self._error:
            conn.close()
        elif self._complete and self._keep_alive:
            self._pool._put_back(conn)
        elif self._finish_later and self._keep_alive:
            conn.pending = self
            self._pool._put_back(conn)
        else:
            conn.close()

    def finish_later(self) -> bool:
        """Leave what is left of the body (a stream's chunked end after its last event)
        to be read when the pool next takes the connection, by then long arrived: no
        wait for it now, one pass through trio's loop and epoll less per stream. False
        where it cannot be read without waiting (TLS, a test's stream): the caller
        reads it."""
        if self._conn is None or self._conn.raw is None:
            return False
        self._finish_later = True
        return True

    def finish_now(self, raw: socket.socket) -> bool | None:
        """Read the body's end without waiting (`finish_later`): whether the answer is
        now complete and the connection can carry another request; None when its end
        has not come yet. More than `FINISH_BYTES` of body, a close or bytes past the
        end: False."""
        while not self._complete:
            try:
                data = raw.recv(RECEIVE_BYTES)
            except BlockingIOError:
                return None
            except OSError:
                return False
            self._finish_left -= len(data)
            if not data or self._finish_left < 0:
                return False
            self._feed(data)
            self._body.clear()
            if self._error:
                return False
        return self._keep_alive and not self._extra and not self._error and not readable_now(raw)

    async def _read(self, wait_first: bool = True) -> bytes:
        """The next read, waiting for it. A plain TCP connection waits for readiness
        first: trio's receive_some tries a read first, and on a stream that read mostly
        finds nothing yet, a system call wasted per wait (`perf trace -s` on the agent,
        64 clients streaming: 4.4 of 7.6 reads per answer were EAGAIN); 5% less of the
        agent's CPU per stream (`python -m bench.stream_relay --against`). With
        `wait_first=False` the read is tried first, for bytes that are mostly there."""
        conn = self._conn
        assert conn is not None
        raw = conn.raw
        try:
            if raw is None:
                return await conn.stream.receive_some(RECEIVE_BYTES)
            if not wait_first:
                try:
                    return raw.recv(RECEIVE_BYTES)
                except BlockingIOError:
                    pass
            return await receive_when_ready(raw, RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            if not self.status:
                raise EngineUnavailable(f"engine connection failed: {_why(exc)}") from None
            raise EngineBrokeOff(f"engine connection failed: {_why(exc)}") from None

    def raw_socket(self) -> socket.socket | None:
        """The plain TCP socket this answer is read from; None for TLS or a test's
        stream, which only `receive` reads."""
        conn = self._conn
        return None if conn is None else conn.raw

    def read_now(self, raw: socket.socket | None) -> bytes | None:
        """`receive`'s next step without a wait, for a reader that has seen `raw`
        readable (`ReadPump`): the body bytes one read brought, b"" at the answer's
        end, None when that read held no body bytes (a chunk's framing alone, or
        nothing yet). Raises as `receive` does. `raw` None: only what is read already."""
        if not self._body:
            if self._error:
                raise EngineBrokeOff(f"answer is not valid HTTP/1.1: {self._error}")
            if self._complete:
                return b""
            if raw is None:
                return None
            try:
                data = raw.recv(RECEIVE_BYTES)
            except BlockingIOError:
                return None
            except OSError as exc:
                raise EngineBrokeOff(f"engine connection failed: {_why(exc)}") from None
            if not data:
                return self._closed_by_engine()
            self._feed(data)
            if not self._body:
                return self.read_now(None)
        parts = self._body
        self._body = []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _feed(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._error = "the engine switched protocols"
        except httptools.HttpParserError as exc:
            if not self._complete:
                self._error = str(exc) or type(exc).__name__
            else:
                self._extra = True  # junk after a whole answer: not reused, not an error

    def _close_delimited(self) -> bool:
        """Whether this answer's body ends with the connection (no length, not chunked)."""
        return (
            bool(self.status)
            and "content-length" not in self.headers
            and "chunked" not in self.headers.get("transfer-encoding", "").lower()
        )


class ReadPump:
    """Reads the answers of many requests in one task.

    A task that waits for its own socket costs trio a registration, a wake-up and a
    resume through its coroutines for every read, and a streamed answer is a read per
    event or two (15 reads for a 16-token stream at 64 clients, `bench.stream_relay`).
    Here a socket is registered once per wait, in an epoll set of the pump's own that
    trio watches as one descriptor, and each wake-up reads every socket that has
    bytes, handing them on at once (`wait`'s `step`); the task that waits is woken
    only when its step is done (a stream's end). After a wake-up that read several
    sockets it waits `PUMP_PACE` before it reads again.
    """

    def __init__(self, lone: bool = False) -> None:
        self._epoll = select.epoll()
        self._waits: dict[int, _PumpWait] = {}
        # Whether a stream is read here with none other (`takes`).
        self.lone = lone
        # Streamed bodies being read now, here or by their own tasks (agent/forward.py).
        self.streams = 0

    async def run(self) -> None:
        epoll, waits = self._epoll, self._waits
        while True:
            await trio.lowlevel.wait_readable(epoll)
            ready = epoll.poll(0)
            for fd, _ in ready:
                wait = waits.get(fd)
                if wait is not None:
                    wait.ready()
            if len(ready) > 1:
                await trio.sleep(PUMP_PACE)

    def takes(self) -> bool:
        """Whether a stream starting now (counted in `streams`) is read here. A stream
        that starts alone reads for itself:
        the pump saves the scheduler's work per read only where one wake-up reads
        several streams, and costs a lone one a registration and a wake-up more
        (`bench.stream_relay --concurrency 1`)."""
        return self.lone or self.streams > 1

    def close(self) -> None:
        """The pump stops: each wait still registered ends as broken off."""
        for wait in list(self._waits.values()):
            wait.end(EngineBrokeOff("the agent's engine reader stopped"))
        self._epoll.close()

    async def wait(self, raw: socket.socket, step: Callable[[], bool]) -> None:
        """Call `step` each time `raw` is readable, until it returns True; raises what
        it raises. Cancelled as a wait for the socket is (the router's cancel, a read
        timeout), and the socket is then the pump's no more. One read per call of
        `step`: what is left the pump finds again (the set is level-triggered)."""
        if self._epoll.closed:
            raise EngineBrokeOff("the agent's engine reader stopped")
        wait = _PumpWait(self, raw.fileno(), step)
        self._epoll.register(wait.fd, select.EPOLLIN)
        self._waits[wait.fd] = wait

        def abort(_: object) -> trio.lowlevel.Abort:
            wait.unregister()
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


class _PumpWait:
    """One task's wait on a `ReadPump`."""

    __slots__ = ("fd", "pump", "step", "task")

    def __init__(self, pump: ReadPump, fd: int, step: Callable[[], bool]) -> None:
        self.pump = pump
        self.fd = fd
        self.step = step
        self.task = trio.lowlevel.current_task()

    def ready(self) -> None:
        try:
            done = self.step()
        except Exception as exc:  # the answer's failure, raised in its own task
            self.end(exc)
            return
        if done:
            self.end(None)

    def end(self, error: BaseException | None) -> None:
        self.unregister()
        trio.lowlevel.reschedule(
            self.task, outcome.Value(None) if error is None else outcome.Error(error)
        )

    def unregister(self) -> None:
        pump = self.pump
        if pump._waits.get(self.fd) is self:
            del pump._waits[self.fd]
            # A socket closed meanwhile has left the set on its own.
            with contextlib.suppress(OSError, ValueError):
                pump._epoll.unregister(self.fd)


def _why(exc: BaseException) -> str:
    """The error, or what trio's BrokenResourceError wraps (a TLS failure, a reset)."""
    return repr(exc.__cause__ if exc.__cause__ is not None else exc)


# A gzip or deflate body can be decoded; zlib tells which (wbits 47).
DECODABLE = frozenset({"gzip", "deflate"})


def decompressed(body: bytes, limit: int) -> bytes:
    """`body`, gzip or deflate, decoded; ValueError when it does not decode, stops short
    or decodes past `limit` bytes. A body of a few MiB can decode to gigabytes: the
    decoder stops at the limit instead of filling the agent's memory."""
    decoder = zlib.decompressobj(47)
    try:
        out = decoder.decompress(body, limit)
    except zlib.error as exc:
        raise ValueError(str(exc)) from None
    if decoder.unconsumed_tail:
        raise ValueError(f"decodes past {limit} bytes")
    if not decoder.eof:
        raise ValueError("incomplete or truncated stream")
    return out


class MetricsPage:
    """An engine's Prometheus page, fetched again and again over one kept-alive
    connection of this client. httpx spent some 2.5 ms of the agent's CPU on each
    fetch, one every half second (`--engine-sample-interval`): most of an idle agent's
    16 ms a second (py-spy)."""

    MAX_BYTES = 16 * 1024 * 1024
    TIMEOUT = 5.0

    def __init__(self, url: str) -> None:
        self._url = url
        self._pool: EnginePool | None = None
        parts = urlsplit(url)
        # The pool asks for its URL's path without a trailing slash, and no query.
        tail = "/" if parts.path.endswith("/") else ""
        tail += f"?{parts.query}" if parts.query else ""
        self._tail = tail if parts.path.rstrip("/") or tail else "/"

    async def text(self) -> str:
        """The page; EngineError or ValueError when there is none to read."""
        if self._pool is None:
            # A `--metrics-url` the client cannot use (ValueError) fails each scrape, as
            # an engine that is down does: the agent serves on without the values.
            try:
                self._pool = EnginePool(self._url, EngineTimeouts(self.TIMEOUT, self.TIMEOUT), 1)
            except ValueError:
                raise ValueError("not an http:// or https:// URL with a host") from None
        response = await self._pool.send("GET", self._tail, {}, b"")
        try:
            if not 200 <= response.status < 300:
                raise ValueError(f"answered HTTP {response.status}")
            body = await response.read_all(self.MAX_BYTES)
        finally:
            response.close()
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if encoding in DECODABLE:
            try:
                body = decompressed(body, self.MAX_BYTES)
            except ValueError as exc:
                raise ValueError(f"does not decode as {encoding}: {exc}") from None
        elif encoding not in ("", "identity"):
            raise ValueError(f"answered in content-encoding {encoding!r}")
        return body.decode("utf-8", "replace")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
