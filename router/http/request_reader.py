"""Request bytes in, request events out: llhttp (through httptools) behind a pull API.

Pure, no I/O, in the manner of h11's `Connection.receive_data/next_event`, which this
replaced: h11's pure-Python parsing was about 15% of the router's CPU at 64 clients
(docs/benchmarks/index.md, *Router overhead*). llhttp is a push parser: one `feed` runs
every callback for the bytes it is given, a pipelined request's included, so the events
wait in a queue until the server asks for them. The server feeds only what it reads, and reads
ahead at most MAX_AHEAD_BYTES while it answers, so the queue stays bounded.

What llhttp accepts and the server must not, this refuses (a `Refusal` event, after
which nothing more is parsed): a head over MAX_HEAD_BYTES (431), a transfer coding other
than a lone `chunked` (llhttp takes `gzip, chunked` as chunked), Transfer-Encoding with
Content-Length (RFC 9112 §6.1, request smuggling) and an HTTP/1.1 request with no Host
(RFC 9112 §3.2). What llhttp refuses (bad framing, bad chunk sizes, control characters
in a header) becomes a Refusal with llhttp's reason. A request that asks for a protocol
upgrade is served as plain HTTP, as h11 did, and is the connection's last: the bytes
after it are not HTTP.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

import httptools

# Request heads larger than this are refused with 431 (h11's default, kept).
MAX_HEAD_BYTES = 16 * 1024
# A request line plus the CRLFs around it: "METHOD SP target SP HTTP/1.1 CRLF" and the
# blank line, as `head_size` counts a head.
_LINE_OVERHEAD = 14
# An absolute-form target's beginnings (RFC 9112 §3.2.2); origin-form starts with `/`.
_ABSOLUTE = (b"http://", b"https://")


@dataclass(frozen=True, slots=True)
class Head:
    """A request's head, parsed and checked."""

    method: str
    target: bytes
    http_version: str
    headers: list[tuple[bytes, bytes]]  # names lowercased, values stripped of OWS
    keep_alive: bool
    expects_continue: bool


@dataclass(frozen=True, slots=True)
class Refusal:
    """Input the server must answer with `status` and a close; nothing after it is
    parsed. `in_body`: the head was accepted and the body broke (the app may be reading
    it). `target`: the request line's target when it was read, for the error format."""

    status: int
    message: str
    in_body: bool
    target: bytes


class _End:
    def __repr__(self) -> str:
        return "END"


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


# The last event of a request (its body is complete); no more events until more input.
END: Final = _End()
NEED_DATA: Final = _NeedData()

Event = Head | bytes | _End | Refusal


class _Stop(Exception):
    """Raised in a callback to stop llhttp at once: the refusal is queued."""


class RequestReader:
    """Feed it what the socket gave; take events with `next_event`: a Head, body bytes
    (never empty), END, a Refusal, or NEED_DATA."""

    __slots__ = (
        "_body",
        "_chunked",
        "_expects",
        "_head_read",
        "_headers",
        "_host",
        "_parser",
        "_size",
        "_tail",
        "_target",
        "buffered",
        "events",
        "stopped",
    )

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self.events: deque[Event] = deque()
        # Bytes held in queued body events, for the server's bound on reading ahead.
        self.buffered = 0
        self.stopped = False
        # Raw bytes of the head being read (from the end of the last one), and the end
        # of the last read while no blank line had come, which may hold part of one.
        self._head_read = 0
        self._tail = b""
        self._target = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._size = _LINE_OVERHEAD
        self._chunked = False
        self._host = False
        self._expects = False
        self._body = False

    def __repr__(self) -> str:
        return f"<RequestReader {len(self.events)} events, {self.buffered} body bytes>"

    def feed(self, data: bytes) -> None:
        if self.stopped or not data:
            return
        if not self._body and self._over_head_limit(data):
            self._refuse(431, f"request head larger than {MAX_HEAD_BYTES} bytes")
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Its head and END are queued, with keep_alive False; what follows is not HTTP.
            self.stopped = True
        except httptools.HttpParserError as exc:
            if not self.stopped:  # llhttp's own verdict (a _Stop queued its refusal)
                self._refuse(400, _reason(str(exc), self._body))

    def _over_head_limit(self, data: bytes) -> bool:
        """Whether the head being read, with `data`, is over MAX_HEAD_BYTES as it came:
        up to its blank line, the whitespace llhttp skips before a value without a
        callback (and so `_size` never sees) included, as is a header line llhttp holds
        unfinished. A head that follows another request's body in the same read is
        counted from the next read on."""
        scan = self._tail + data
        end = scan.find(b"\r\n\r\n")
        if end < 0:
            self._head_read += len(data)
            self._tail = scan[-3:]
        else:
            self._head_read += end + 4 - len(self._tail)
            self._tail = b""
        if self._head_read <= MAX_HEAD_BYTES:
            return False
        if not self._target:
            # Refused before llhttp saw it: the target, for the answer's format.
            words = scan.split(b"\r\n", 1)[0].split(b" ")
            self._target = words[1] if len(words) > 1 else b""
        return True

    def next_event(self) -> Event | _NeedData:
        if not self.events:
            return NEED_DATA
        event = self.events.popleft()
        if type(event) is bytes:
            self.buffered -= len(event)
        return event

    def _refuse(self, status: int, message: str) -> None:
        self.stopped = True
        self.events.append(Refusal(status, message, self._body, self._target))

    def _stop(self, status: int, message: str) -> _Stop:
        self._refuse(status, message)
        return _Stop()

    # llhttp's callbacks (httptools calls them by these names).

    def on_message_begin(self) -> None:
        self._target = b""
        self._headers = []
        self._size = _LINE_OVERHEAD
        self._chunked = self._host = self._body = self._expects = False

    def on_url(self, url: bytes) -> None:
        self._target += url
        self._size += len(url)
        if self._size > MAX_HEAD_BYTES:
            raise self._stop(431, f"request head larger than {MAX_HEAD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        # Counted with the whitespace after it, which llhttp hands over (the whitespace
        # before a value it skips without keeping it, which the raw count sees), and the
        # least a header line adds: a colon and a CRLF.
        self._size += len(name) + len(value) + 3
        if self._size > MAX_HEAD_BYTES:
            raise self._stop(431, f"request head larger than {MAX_HEAD_BYTES} bytes")
        if self._body:
            # A trailer field, after a chunked body: no request header. Merged into the
            # head, it would reach the engine as one a proxy in front never saw.
            return
        value = value.rstrip(b" \t")
        if name == b"transfer-encoding":
            if self._chunked or value.lower() != b"chunked":
                raise self._stop(400, "only Transfer-Encoding: chunked is supported")
            self._chunked = True
        elif name == b"host":
            if self._host:
                # Which one names the origin is anyone's guess (RFC 9112 §3.2: 400).
                raise self._stop(400, "malformed request: more than one Host header")
            self._host = True
        elif name == b"expect" and value.lower() == b"100-continue":
            self._expects = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        self._head_read, self._tail = 0, b""
        version = parser.get_http_version()
        method = parser.get_method().decode("ascii")
        size = len(method) + self._size  # the target is in `_size` (on_url)
        if size > MAX_HEAD_BYTES:
            raise self._stop(431, f"request head larger than {MAX_HEAD_BYTES} bytes")
        if version not in ("1.0", "1.1"):
            raise self._stop(505, f"HTTP/{version} is not served here: send HTTP/1.1")
        if version == "1.1" and not self._host:
            raise self._stop(400, "malformed request: missing mandatory Host header")
        target = self._target
        if not target.startswith(b"/") and target[:8].lower().startswith(_ABSOLUTE):
            # Absolute form (RFC 9112 §3.2.2), which a server must accept: its path.
            rest = target.partition(b"://")[2]
            slash = rest.find(b"/")
            query = rest.find(b"?")
            if slash < 0 or 0 <= query < slash:
                self._target = b"/" + (rest[query:] if query >= 0 else b"")
            else:
                self._target = rest[slash:]
        # As h11: only HTTP/1.1 keeps a connection alive (1.0's keep-alive is not kept).
        keep_alive = version == "1.1" and parser.should_keep_alive()
        if parser.should_upgrade():
            if self._chunked or any(
                k == b"content-length" and v.strip(b"0") for k, v in self._headers
            ):
                # llhttp hands nothing after an upgrade's head over: its body would be
                # lost, and the app would call the request empty.
                raise self._stop(400, "a request asking for an Upgrade may not have a body")
            keep_alive = False
        self._body = True
        self.events.append(
            Head(
                method,
                self._target,
                version,
                self._headers,
                keep_alive,
                self._expects and version == "1.1",
            )
        )

    def on_body(self, body: bytes) -> None:
        self.buffered += len(body)
        self.events.append(body)

    def on_message_complete(self) -> None:
        self._body = False
        self.events.append(END)


def _reason(llhttp: str, in_body: bool) -> str:
    """What to tell the client about a request llhttp refused."""
    if "Content-Length" in llhttp and "Transfer-Encoding" in llhttp:
        return "a request may not have both Content-Length and Transfer-Encoding"
    if "Transfer-Encoding" in llhttp:
        return "only Transfer-Encoding: chunked is supported"
    if in_body:
        return f"malformed request body: {llhttp}"
    return f"malformed request: {llhttp}"
