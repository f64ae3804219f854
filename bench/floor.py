"""The floor under hivenet's design on trio: a router and an agent that do nothing but
carry requests, in the shape hivenet carries them.

    python -m bench.floor router LISTEN_PORT AGENT_PORT
    python -m bench.floor agent LISTEN_PORT ENGINE_PORT

The router reads each client's HTTP/1.1 requests (httptools, keep-alive, a task per
connection), reads the JSON body's `model` and `stream` (the least any router must
parse), and forwards the request as one msgpack frame over a single TCP connection to
the agent; the agent sends it to the engine over a pool of keep-alive connections and
returns the answer's head, body parts and end as frames, which the router writes to
the client (whole with a content-length, or streamed chunked). The agent has no task
per request: its link reader sends each request at once, and one task reads every
engine socket that has bytes. Frames to the other daemon are written once per turn of
trio's loop, as hivenet's link writes them. No policy, gates, slots, metrics,
logs, encryption or multiplexer: what is left is trio, the sockets, HTTP parsing and
framing, so its CPU per request is the least a router of this shape on trio can spend.
`python -m bench.peers --peers trio-floor` starts the pair in front of the engine.
"""

from __future__ import annotations

import select
import socket
import sys
from collections.abc import Callable

import httptools
import msgpack
import msgspec
import trio

from protocol.sockets import stdlib_socket

HEAD, BODY, END = 0, 1, 2


class Fields(msgspec.Struct):
    """What the router reads of a request's body."""

    model: str
    stream: bool = False


_fields = msgspec.json.Decoder(Fields)


class Frames:
    """Length-prefixed msgpack frames on one plain TCP socket; writes held until the end
    of the loop's batch (`flush`)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.held: list[bytes] = []
        self.backlog = b""  # what the kernel had no room for: `write_backlog`'s
        self.more = trio.Event()
        self.buf = b""

    def send(self, frame: list) -> None:
        data = msgpack.packb(frame)
        self.held.append(len(data).to_bytes(4, "big") + data)

    def flush(self) -> None:
        if self.held and not self.backlog:
            data = b"".join(self.held)
            self.held.clear()
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                self.backlog = data[sent:]
                self.more.set()

    async def write_backlog(self) -> None:
        """Writes what `flush` could not, as the kernel makes room; then what was held
        meanwhile. Never blocks the loop: both daemons may be writing to each other."""
        while True:
            await self.more.wait()
            self.more = trio.Event()
            while self.backlog:
                await trio.lowlevel.wait_writable(self.sock)
                try:
                    sent = self.sock.send(self.backlog)
                except BlockingIOError:
                    continue
                self.backlog = self.backlog[sent:]
                if not self.backlog and self.held:
                    self.backlog = b"".join(self.held)
                    self.held.clear()

    async def receive(self) -> list[list]:
        while True:
            await trio.lowlevel.wait_readable(self.sock)
            try:
                data = self.sock.recv(262144)
            except BlockingIOError:
                continue
            if not data:
                raise EOFError
            buf = self.buf + data
            out, pos = [], 0
            while len(buf) - pos >= 4:
                size = int.from_bytes(buf[pos : pos + 4], "big")
                if len(buf) - pos - 4 < size:
                    break
                out.append(msgpack.unpackb(buf[pos + 4 : pos + 4 + size]))
                pos += 4 + size
            self.buf = buf[pos:]
            if out:
                return out


class FlushAtBatchEnd(trio.abc.Instrument):
    def __init__(self, frames: list[Frames]) -> None:
        self.frames = frames

    def before_io_wait(self, timeout: float) -> None:
        for f in self.frames:
            f.flush()


def raw(stream: object) -> socket.socket:
    """The plain socket under a trio TCP stream, read and written directly."""
    sock = stdlib_socket(stream)
    assert sock is not None, "a plain TCP stream"
    return sock


async def read_some(sock: socket.socket) -> bytes:
    while True:
        try:
            return sock.recv(65536)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


async def send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


# --- router ---------------------------------------------------------------------------


class Waiter:
    """A client's task waiting for its answer's frames; the link's reader wakes it."""

    __slots__ = ("parked", "parts", "task")

    def __init__(self) -> None:
        self.parts: list[list] = []
        self.task = trio.lowlevel.current_task()
        # Waiting for frames (not writing to its client): only then may it be woken.
        self.parked = False


class Requests:
    """httptools' callbacks: the requests read whole so far, as (url, headers, body)."""

    def __init__(self) -> None:
        self.whole: list[tuple[bytes, list[tuple[bytes, bytes]], bytes]] = []
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def on_url(self, url: bytes) -> None:
        self.url, self.headers, self.body = url, [], []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.whole.append((self.url, self.headers, b"".join(self.body)))


async def router(listen: int, agent_port: int) -> None:
    # The agent may still be starting: its port is tried until it answers.
    while True:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", agent_port)
            break
        except OSError:
            await trio.sleep(0.05)
    link = Frames(raw(stream))
    trio.lowlevel.add_instrument(FlushAtBatchEnd([link]))
    waiting: dict[int, Waiter] = {}
    ids = iter(range(1, 1 << 62))

    async def reader() -> None:
        while True:
            for frame in await link.receive():
                waiter = waiting.get(frame[0])
                if waiter is not None:
                    waiter.parts.append(frame)
                    if waiter.parked:
                        waiter.parked = False
                        trio.lowlevel.reschedule(waiter.task)

    async def client(stream: trio.SocketStream) -> None:
        sock = raw(stream)
        requests = Requests()
        parser = httptools.HttpRequestParser(requests)
        async with stream:
            while True:
                data = await read_some(sock)
                if not data:
                    return
                parser.feed_data(data)
                while requests.whole:
                    url, _headers, body = requests.whole.pop(0)
                    if url == b"/health":
                        await send_all(sock, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        continue
                    fields = _fields.decode(body)
                    rid = next(ids)
                    waiter = waiting[rid] = Waiter()
                    link.send([rid, url.decode(), body, fields.stream])
                    try:
                        await relay(sock, waiter)
                    finally:
                        del waiting[rid]

    async def relay(sock: socket.socket, waiter: Waiter) -> None:
        streamed = False
        while True:
            if not waiter.parts:
                waiter.parked = True
                await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)
            parts, waiter.parts = waiter.parts, []
            out = []
            for _, kind, *rest in parts:
                if kind == HEAD:
                    status, content_type, whole = rest
                    if whole is not None:
                        out.append(
                            b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                            % (status, content_type.encode(), len(whole))
                            + whole
                        )
                        await send_all(sock, b"".join(out))
                        return
                    streamed = True
                    out.append(
                        b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked"
                        b"\r\n\r\n" % (status, content_type.encode())
                    )
                elif kind == BODY:
                    out.append(b"%x\r\n%s\r\n" % (len(rest[0]), rest[0]))
                else:
                    if streamed:
                        out.append(b"0\r\n\r\n")
                    await send_all(sock, b"".join(out))
                    return
            await send_all(sock, b"".join(out))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        nursery.start_soon(link.write_backlog)
        await trio.serve_tcp(client, listen, host="127.0.0.1")


# --- agent ----------------------------------------------------------------------------


class Answer:
    """One engine answer, parsed as it arrives; frames go out through `emit`."""

    def __init__(self, rid: int, emit: Callable[[list], None], stream: bool) -> None:
        self.rid, self.emit, self.stream = rid, emit, stream
        self.parser = httptools.HttpResponseParser(self)
        self.content_type = "application/json"
        self.body: list[bytes] = []
        self.done = False
        self.keep_alive = False
        self.fed = False  # the engine has said something

    def on_message_begin(self) -> None:
        self.fed = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value.decode()

    def on_headers_complete(self) -> None:
        if self.stream:
            self.emit([self.rid, HEAD, self.parser.get_status_code(), self.content_type, None])

    def on_body(self, body: bytes) -> None:
        if self.stream:
            self.emit([self.rid, BODY, body])
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True
        # Asked here: once the callback returns the parser answers False.
        self.keep_alive = self.parser.should_keep_alive()
        if self.stream:
            self.emit([self.rid, END])
        else:
            whole = b"".join(self.body)
            self.emit([self.rid, HEAD, self.parser.get_status_code(), self.content_type, whole])


async def agent(listen: int, engine_port: int) -> None:
    """No task per request: the link's reader sends each request to the engine at
    once, and one task reads every engine socket that has bytes, from an epoll set of
    its own, feeding each answer's parser, whose callbacks queue the frames."""
    listener = (await trio.open_tcp_listeners(listen, host="127.0.0.1"))[0]
    accepted = await listener.accept()
    link = Frames(raw(accepted))
    trio.lowlevel.add_instrument(FlushAtBatchEnd([link]))
    idle: list[socket.socket] = []
    reading: dict[int, tuple[socket.socket, Answer, bytes]] = {}
    epoll = select.epoll()

    async def connect() -> socket.socket:
        # A plain socket: trio's would close it when collected.
        stream = await trio.open_tcp_stream("127.0.0.1", engine_port)
        return raw(stream).dup()

    async def ask(sock: socket.socket, answer: Answer, request: bytes) -> None:
        await send_all(sock, request)  # on loopback the kernel takes it at once
        reading[sock.fileno()] = (sock, answer, request)
        epoll.register(sock.fileno(), select.EPOLLIN)

    async def again(answer: Answer, request: bytes) -> None:
        await ask(await connect(), answer, request)

    async def pump(nursery: trio.Nursery) -> None:
        while True:
            await trio.lowlevel.wait_readable(epoll)
            for fd, _ in epoll.poll(0):
                sock, answer, request = reading[fd]
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                if data:
                    answer.parser.feed_data(data)
                    if not answer.done:
                        continue
                epoll.unregister(fd)
                del reading[fd]
                if answer.done and answer.keep_alive:
                    idle.append(sock)
                    continue
                sock.close()
                if not answer.done:
                    if answer.fed:
                        link.send([answer.rid, END])  # broke off: the router ends it
                    else:
                        # An idle connection the engine closed meanwhile (Hypercorn
                        # ends one after 1,000 requests): the request goes again.
                        nursery.start_soon(again, answer, request)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.write_backlog)
        nursery.start_soon(pump, nursery)
        while True:
            for rid, path, body, stream in await link.receive():
                request = (
                    f"POST {path} HTTP/1.1\r\nhost: engine\r\n"
                    f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                ).encode() + body
                sock = idle.pop() if idle else await connect()
                await ask(sock, Answer(rid, link.send, stream), request)


def main() -> None:
    role, listen, target = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    trio.run(router if role == "router" else agent, listen, target)


if __name__ == "__main__":
    main()
