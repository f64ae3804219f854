"""A small trio-native Redis client for the request path: the tenant and admission
counts (router/tenants/shared.py, router/admission/shared.py).

Why our own: there is no well-kept Redis client that runs under trio. redis-py's
asyncio client needs asyncio, and the trio ones on PyPI have had no release in years.
redis-py's synchronous client in `trio.to_thread` cost a worker-thread hand-off per
call: 1.95 ms of router CPU per request against 0.35 ms without Redis (issue 51). This
client speaks just what the router sends: RESP2 commands, replies parsed by hand, scripts
by EVALSHA (EVAL again on NOSCRIPT, after a restart or a failover).

One connection per router process, pipelined: a call appends its command to the
connection's buffer and parks until its reply; one writer task sends everything queued
in one `send`, one batch in flight at a time, and one reader task hands out every reply
a `recv` brought, in order. Under load the calls of concurrent requests share a round
trip and a pair of system calls (16 to 18 calls a write in `bench.scale`), and no call
needs a thread. A call's deadline costs no cancel scope of its own: the reader's one
deadline is its oldest call's. The two tasks are trio system tasks
(`spawn_system_task`): callers need no nursery, and they end with the connection.

Failure is quick and loud, like before: every call has one deadline (`timeout`,
connecting included); a call past it, a closed socket, or a reply that is not RESP
breaks the connection and fails every call waiting on it with `StoreError`, and the
next call connects again. Hostile replies are bounded: a line over `MAX_LINE`, a bulk
string over `MAX_BULK`, an array over `MAX_ITEMS` or nested past `MAX_DEPTH`, a byte
that starts no RESP type, or a reply nobody asked for.

Sentinel (`redis+sentinel://`): at connect time the sentinels are asked in turn
(`SENTINEL get-master-addr-by-name`), and the Redis they name must say it is the primary
(`ROLE`). A demoted primary answers writes READONLY: that breaks the connection too, and
the next call asks the sentinels again.
"""

from __future__ import annotations

import hashlib
import math
import ssl
from collections import deque
from dataclasses import dataclass
from typing import Any

import outcome
import trio
from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url

from router.state_url import SENTINEL_SCHEME, parse_sentinel_url

# Our replies are counts and short strings; these only bound what a hostile peer sends.
MAX_LINE = 64 * 1024
MAX_BULK = 1024 * 1024
MAX_ITEMS = 4096
MAX_DEPTH = 4
RECV_SIZE = 64 * 1024


class StoreError(Exception):
    """Redis unreachable, too slow, or answering with something that is not RESP."""


class ReplyError(StoreError):
    """Redis answered an error reply (`-ERR …`, `-NOSCRIPT …`, `-READONLY …`)."""


class ProtocolError(StoreError):
    """Bytes that are not a RESP2 reply."""


class _Incomplete(Exception):
    pass


_NOTHING: Any = object()


def encode(args: tuple[object, ...]) -> bytes:
    """One command as a RESP array of bulk strings; numbers as redis-py writes them.
    (By exact type: this was the client's largest cost, 9 µs of a call's 12.)"""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        kind = type(arg)
        if kind is str:
            raw = arg.encode()  # type: ignore[attr-defined]
        elif kind is int:
            raw = b"%d" % arg  # type: ignore[str-bytes-safe]
        elif kind is bytes:
            raw = arg  # type: ignore[assignment]
        elif kind is float:
            raw = repr(arg).encode()
        else:
            raise TypeError(f"{kind.__name__} is not a Redis argument")
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


def _integer(line: bytes) -> int:
    digits = line[1:] if line[:1] == b"-" else line
    if not digits.isdigit() or len(line) > 20:
        raise ProtocolError(f"{line[:40]!r} is not a RESP integer")
    return int(line)


class RespParser:
    """Replies out of a byte stream, fed as it arrives. `get` returns the next whole
    reply (an error reply as a `ReplyError` value, not raised) or `None`-less `_NOTHING`
    while one is incomplete; ProtocolError for bytes that are not RESP."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pos = 0

    def feed(self, data: bytes) -> None:
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        self.buf += data

    def get(self) -> Any:
        if self.pos >= len(self.buf):
            return _NOTHING
        try:
            value, self.pos = self._parse(self.pos, 0)
        except _Incomplete:
            return _NOTHING
        return value

    def _line(self, pos: int) -> tuple[bytes, int]:
        end = self.buf.find(b"\r\n", pos, pos + MAX_LINE + 2)
        if end < 0:
            if len(self.buf) - pos > MAX_LINE:
                raise ProtocolError(f"a reply line over {MAX_LINE} bytes")
            raise _Incomplete
        return bytes(self.buf[pos:end]), end + 2

    def _parse(self, pos: int, depth: int) -> tuple[Any, int]:
        if pos >= len(self.buf):
            raise _Incomplete
        kind = self.buf[pos]
        line, pos = self._line(pos + 1)
        if kind == 0x24:  # $ bulk string
            n = _integer(line)
            if n == -1:
                return None, pos
            if not 0 <= n <= MAX_BULK:
                raise ProtocolError(f"a bulk string of {n} bytes")
            if len(self.buf) < pos + n + 2:
                raise _Incomplete
            if self.buf[pos + n : pos + n + 2] != b"\r\n":
                raise ProtocolError("a bulk string longer than its length")
            return bytes(self.buf[pos : pos + n]), pos + n + 2
        if kind == 0x3A:  # : integer
            return _integer(line), pos
        if kind == 0x2B:  # + simple string
            return line, pos
        if kind == 0x2D:  # - error
            return ReplyError(line.decode("utf-8", "replace")), pos
        if kind == 0x2A:  # * array
            n = _integer(line)
            if n == -1:
                return None, pos
            if not 0 <= n <= MAX_ITEMS:
                raise ProtocolError(f"an array of {n} items")
            if depth >= MAX_DEPTH:
                raise ProtocolError(f"arrays nested over {MAX_DEPTH} deep")
            items = []
            for _ in range(n):
                item, pos = self._parse(pos, depth + 1)
                items.append(item)
            return items, pos
        raise ProtocolError(f"byte {bytes([kind])!r} starts no RESP2 reply")


class _Slot:
    """One call waiting for its reply: its task, parked until the reader (or whoever
    breaks the connection) reschedules it with the reply or an error."""

    __slots__ = ("deadline", "task")

    def __init__(self, task: trio.lowlevel.Task | None, deadline: float) -> None:
        self.task = task
        self.deadline = deadline


def _resume(slot: _Slot, result: outcome.Outcome[Any]) -> None:
    task, slot.task = slot.task, None
    if task is not None:  # None: its caller was cancelled, the reply goes nowhere
        trio.lowlevel.reschedule(task, result)


class _Connection:
    """One socket to Redis, its writer and reader tasks, and the calls in flight in the
    order they were sent (the order Redis answers them)."""

    def __init__(self, stream: trio.abc.Stream, sock: trio.socket.SocketType) -> None:
        self.stream = stream
        self.sock = sock
        self.parser = RespParser()
        self.waiting: deque[_Slot] = deque()
        self.out: list[bytes] = []
        self.in_flight = 0  # calls sent whose replies have not come yet
        self.writer: trio.lowlevel.Task | None = None  # parked with nothing to send
        self.read_scope = trio.CancelScope()
        self.broken: StoreError | None = None
        self.token = trio.lowlevel.current_trio_token()

    def start(self) -> None:
        trio.lowlevel.spawn_system_task(self._write_loop, name="redis-writer")
        trio.lowlevel.spawn_system_task(self._read_loop, name="redis-reader")

    def send(self, payload: bytes, deadline: float, task: trio.lowlevel.Task | None) -> _Slot:
        if self.broken is not None:
            raise self.broken
        slot = _Slot(task, deadline)
        if not self.waiting:
            # The reader's one deadline is its oldest call's: no cancel scope per call.
            self.read_scope.deadline = deadline
        self.waiting.append(slot)
        self.out.append(payload)
        if self.writer is not None and not self.in_flight:
            writer, self.writer = self.writer, None
            trio.lowlevel.reschedule(writer)
        return slot

    async def reply(self, payload: bytes, deadline: float) -> Any:
        """Send `payload`; its reply (an error reply raised as ReplyError)."""
        slot = self.send(payload, deadline, trio.lowlevel.current_task())

        def abort(_: object) -> trio.lowlevel.Abort:
            slot.task = None  # cancelled: the slot stays, its reply is read and dropped
            return trio.lowlevel.Abort.SUCCEEDED

        value = await trio.lowlevel.wait_task_rescheduled(abort)
        if isinstance(value, ReplyError):
            raise ReplyError(*value.args)
        return value

    def fail(self, error: StoreError) -> None:
        """Every waiting call gets `error`; the socket closes (both tasks then end)."""
        if self.broken is not None:
            return
        self.broken = error
        while self.waiting:
            _resume(self.waiting.popleft(), outcome.Error(error))
        if self.writer is not None:
            writer, self.writer = self.writer, None
            trio.lowlevel.reschedule(writer)
        self.read_scope.cancel()
        self.sock.close()

    async def _write_loop(self) -> None:
        def abort(_: object) -> trio.lowlevel.Abort:
            self.writer = None
            return trio.lowlevel.Abort.SUCCEEDED

        try:
            while self.broken is None:
                if not self.out or self.in_flight:
                    self.writer = trio.lowlevel.current_task()
                    await trio.lowlevel.wait_task_rescheduled(abort)
                    continue
                # One batch in flight at a time (Nagle's rule, for commands): a call
                # made while one is in flight waits for its replies, at most one round
                # trip, and goes with every other call made meanwhile: one system call
                # each way per batch. Under `bench.scale` (1,500 requests/s, three calls
                # each) a write carried 16 to 18 calls.
                data = b"".join(self.out)
                self.in_flight = len(self.out)
                self.out.clear()
                await self.stream.send_all(data)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.fail(StoreError(f"Redis connection lost: {exc}"))
        except trio.Cancelled:
            self.fail(StoreError("the router is stopping"))
            raise

    async def _read_loop(self) -> None:
        try:
            while self.broken is None:
                with self.read_scope:
                    data = await self.stream.receive_some(RECV_SIZE)
                if self.read_scope.cancelled_caught:
                    if self.broken is not None:
                        return
                    # A hung Redis: nothing after this call can be trusted to come in
                    # order, so the connection goes and the next call makes a new one.
                    raise StoreError("no answer from Redis in time")
                if not data:
                    raise StoreError("Redis closed the connection")
                self.parser.feed(data)
                while (value := self.parser.get()) is not _NOTHING:
                    if self.in_flight <= 0:
                        raise ProtocolError("a reply nobody asked for")
                    _resume(self.waiting.popleft(), outcome.Value(value))
                    self.in_flight -= 1
                    if isinstance(value, ReplyError) and value.args[0].startswith("READONLY"):
                        # A demoted primary: connect again, through the sentinels.
                        raise StoreError(f"Redis is a replica now: {value.args[0][:200]}")
                if not self.in_flight and self.out and self.writer is not None:
                    writer, self.writer = self.writer, None
                    trio.lowlevel.reschedule(writer)
                self.read_scope = trio.CancelScope(
                    deadline=self.waiting[0].deadline if self.waiting else math.inf
                )
        except StoreError as exc:
            self.fail(exc)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.fail(StoreError(f"Redis connection lost: {exc}"))
        except trio.Cancelled:
            self.fail(StoreError("the router is stopping"))
            raise


@dataclass(frozen=True)
class Script:
    """A Lua script, sent by its SHA1 once Redis knows it."""

    source: str
    sha: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


@dataclass(frozen=True)
class _Target:
    host: str = ""
    port: int = 6379
    path: str = ""  # a unix socket
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = ""


def target(url: str) -> _Target:
    """Where `url` points; ValueError for one that is no Redis URL."""
    if url.startswith(SENTINEL_SCHEME + "://"):
        parts = parse_sentinel_url(url)
        return _Target(
            db=parts.db, password=parts.password, sentinels=parts.sentinels, master=parts.master
        )
    options = parse_url(url)  # redis-py's reading of its own URL forms
    cls = options.get("connection_class")
    return _Target(
        host=options.get("host", "localhost"),
        port=int(options.get("port", 6379)),
        path=options.get("path", "") if cls is UnixDomainSocketConnection else "",
        tls=cls is SSLConnection,
        db=int(options.get("db", 0) or 0),
        username=options.get("username"),
        password=options.get("password"),
    )


def _token() -> trio.lowlevel.TrioToken:
    return trio.lowlevel.current_trio_token()


class RedisTrio:
    """Calls to one Redis (or Sentinel's primary), each within `timeout` seconds."""

    def __init__(self, url: str, timeout: float) -> None:
        self.target = target(url)
        self.timeout = timeout
        self._conn: _Connection | None = None
        self._connecting: trio.Lock | None = None
        self._lock_token: object = None

    async def call(self, *args: object) -> Any:
        """One command's reply; StoreError (ReplyError for an error reply) otherwise."""
        return await self._timed(encode(args))

    async def evalsha(self, script: Script, keys: list[str], args: list[object]) -> Any:
        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except ReplyError as exc:
            if not exc.args[0].startswith("NOSCRIPT"):
                raise
        # A Redis that restarted, or the replica Sentinel promoted: it caches it now.
        return await self.call("EVAL", script.source, len(keys), *keys, *args)

    async def _timed(self, payload: bytes) -> Any:
        conn = self._conn
        if conn is None or conn.broken is not None or conn.token is not _token():
            with trio.move_on_after(self.timeout):
                conn = await self._connection()
            if conn is None or conn.broken is not None:
                raise StoreError(f"no connection to Redis within {self.timeout:g} s")
        return await conn.reply(payload, trio.current_time() + self.timeout)

    async def _connection(self) -> _Connection:
        token = _token()
        if self._connecting is None or self._lock_token is not token:
            # A trio lock belongs to one trio.run (a benchmark runs several).
            self._connecting, self._lock_token = trio.Lock(), token
        async with self._connecting:
            conn = self._conn
            if conn is None or conn.broken is not None or conn.token is not token:
                if conn is not None:
                    conn.fail(StoreError("replaced"))
                self._conn = conn = await self._connect()
        return conn

    async def _connect(self) -> _Connection:
        t = self.target
        if not t.sentinels:
            return await self._open(t.host, t.port, primary=False)
        reasons = []
        for host, port in t.sentinels:
            try:
                sentinel = await self._open(host, port, handshake=False)
            except (StoreError, OSError) as exc:
                reasons.append(f"{host}:{port}: {exc}")
                continue
            try:
                where = await self._ask(sentinel, "SENTINEL", "get-master-addr-by-name", t.master)
            except StoreError as exc:
                reasons.append(f"{host}:{port}: {exc}")
                continue
            finally:
                sentinel.fail(StoreError("done"))
            if not isinstance(where, list) or len(where) != 2:
                reasons.append(f"{host}:{port}: knows no master {t.master!r}")
                continue
            try:
                return await self._open(where[0].decode(), int(where[1]), primary=True)
            except (StoreError, OSError, ValueError) as exc:
                reasons.append(f"{host}:{port} named a master that failed: {exc}")
        raise StoreError(f"no primary for {t.master!r} from any sentinel: " + "; ".join(reasons))

    async def _open(
        self, host: str, port: int, primary: bool = False, handshake: bool = True
    ) -> _Connection:
        t = self.target
        try:
            if t.path:
                stream: trio.abc.Stream = await trio.open_unix_socket(t.path)
            else:
                stream = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            raise StoreError(f"cannot connect to Redis: {exc}") from exc
        raw = stream
        sock = raw.socket  # type: ignore[attr-defined]
        if t.tls and handshake:
            stream = trio.SSLStream(stream, ssl.create_default_context(), server_hostname=host)
        conn = _Connection(stream, sock)
        conn.start()
        if not handshake:
            return conn
        try:
            if t.password is not None:
                auth = (t.username, t.password) if t.username else (t.password,)
                await self._ask(conn, "AUTH", *auth)
            if t.db:
                await self._ask(conn, "SELECT", t.db)
            if primary:
                role = await self._ask(conn, "ROLE")
                if not isinstance(role, list) or role[:1] != [b"master"]:
                    raise StoreError(f"{host}:{port} is not the primary")
        except StoreError:
            conn.fail(StoreError("handshake failed"))
            raise
        return conn

    async def _ask(self, conn: _Connection, *args: object) -> Any:
        return await conn.reply(encode(args), trio.current_time() + self.timeout)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.fail(StoreError("closed"))
            self._conn = None
