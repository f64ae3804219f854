"""A small trio-native Redis client for the request path: the tenant and admission
counts (router/tenants/shared.py, router/admission/shared.py).

Why our own: there is no well-kept Redis client that runs under trio. redis-py's
asyncio client needs asyncio, and the trio ones on PyPI have had no release in years.
redis-py's synchronous client in `trio.to_thread` cost a worker-thread hand-off per
call: 1.95 ms of router CPU per request against 0.35 ms without Redis (issue 51). This
client speaks just what the router sends: RESP2 commands, replies parsed by hand, scripts
by EVALSHA (EVAL again on NOSCRIPT, after a restart or a failover).

One connection per router process, pipelined: a call appends its command to the
connection's buffer and waits for its reply; one writer task sends everything queued
since its last write in one `send`, and one reader task hands out every reply a `recv`
brought, in order. Under load the calls of concurrent requests share a round trip and a
pair of system calls, and no call needs a thread. The two tasks are trio system tasks
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
import ssl
from collections import deque
from dataclasses import dataclass, field
from typing import Any

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
    """One command as a RESP array of bulk strings; numbers as redis-py writes them."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            raw = arg
        elif isinstance(arg, str):
            raw = arg.encode()
        elif isinstance(arg, bool):
            raise TypeError("a bool is not a Redis argument")
        elif isinstance(arg, int):
            raw = b"%d" % arg
        elif isinstance(arg, float):
            raw = repr(arg).encode()
        else:
            raise TypeError(f"{type(arg).__name__} is not a Redis argument")
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


@dataclass
class _Slot:
    """One call's reply, filled by the reader (or an error, by whoever broke the link)."""

    done: trio.Event = field(default_factory=trio.Event)
    value: Any = _NOTHING
    error: StoreError | None = None


class _Connection:
    def __init__(self, stream: trio.abc.Stream, sock: trio.socket.SocketType) -> None:
        self.stream = stream
        self.sock = sock
        self.parser = RespParser()
        self.waiting: deque[_Slot] = deque()
        self.out: list[bytes] = []
        self.wake_writer = trio.Event()
        self.broken: StoreError | None = None
        self.token = trio.lowlevel.current_trio_token()

    def start(self) -> None:
        trio.lowlevel.spawn_system_task(self._write_loop, name="redis-writer")
        trio.lowlevel.spawn_system_task(self._read_loop, name="redis-reader")

    def send(self, payload: bytes) -> _Slot:
        if self.broken is not None:
            raise self.broken
        slot = _Slot()
        self.waiting.append(slot)
        self.out.append(payload)
        self.wake_writer.set()
        return slot

    def fail(self, error: StoreError) -> None:
        """Every waiting call gets `error`; the socket closes (both tasks then end)."""
        if self.broken is not None:
            return
        self.broken = error
        while self.waiting:
            slot = self.waiting.popleft()
            slot.error = error
            slot.done.set()
        self.wake_writer.set()
        self.sock.close()

    async def _write_loop(self) -> None:
        try:
            while self.broken is None:
                await self.wake_writer.wait()
                self.wake_writer = trio.Event()
                if self.out and self.broken is None:
                    data = b"".join(self.out)
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
                data = await self.stream.receive_some(RECV_SIZE)
                if not data:
                    raise StoreError("Redis closed the connection")
                self.parser.feed(data)
                while (value := self.parser.get()) is not _NOTHING:
                    if not self.waiting:
                        raise ProtocolError("a reply nobody asked for")
                    slot = self.waiting.popleft()
                    slot.value = value
                    slot.done.set()
                    if isinstance(value, ReplyError) and value.args[0].startswith("READONLY"):
                        # A demoted primary: connect again, through the sentinels.
                        raise StoreError(f"Redis is a replica now: {value.args[0][:200]}")
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
        conn = None
        with trio.move_on_after(self.timeout):
            conn = await self._connection()
            slot = conn.send(payload)
            await slot.done.wait()
            if slot.error is not None:
                raise slot.error
            if isinstance(slot.value, ReplyError):
                raise ReplyError(*slot.value.args)
            return slot.value
        # No answer in time: a hung Redis. Nothing after this call can be trusted to
        # come in order, so the connection goes and the next call makes a new one.
        error = StoreError(f"no answer from Redis within {self.timeout:g} s")
        if conn is not None:
            conn.fail(error)
        raise error

    async def _connection(self) -> _Connection:
        token = trio.lowlevel.current_trio_token()
        conn = self._conn
        if conn is not None and conn.broken is None and conn.token is token:
            return conn
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
        slot = conn.send(encode(args))
        await slot.done.wait()
        if slot.error is not None:
            raise slot.error
        if isinstance(slot.value, ReplyError):
            raise ReplyError(*slot.value.args)
        return slot.value

    def close(self) -> None:
        if self._conn is not None:
            self._conn.fail(StoreError("closed"))
            self._conn = None
