"""The agent's engine client against hostile and ordinary engines on loopback.

Each engine here is a raw TCP server written for the test, so it can do what a real
engine only does when broken: an endless head, a bad chunk size, a close in the middle,
a head dribbled a byte at a time. `forward` is driven as the agent's session drives
it, its frames recorded; the outcome is the frame the router would get.
"""

from __future__ import annotations

import contextlib
import datetime
import gzip
import ipaddress
import json
import os
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent import engine_http
from agent import forward as forward_module
from agent.engine_http import (
    MAX_HEAD_BYTES,
    EngineBrokeOff,
    EnginePool,
    EngineTimeouts,
    EngineUnavailable,
    MetricsPage,
    ReadLimits,
)
from agent.forward import forward
from protocol import messages as m
from tests.scheduler_passes import passes_of_this_task

Handler = Callable[["Conn"], Awaitable[None]]
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()


class Engine:
    """A raw engine on a loopback port: every connection runs `handler`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = trio.Event()  # a connection ended from the agent's side


class Conn:
    """One connection of an engine, as its handler sees it."""

    def __init__(self, stream: trio.SocketStream, engine: Engine) -> None:
        self.stream = stream
        self.engine = engine

    async def send_all(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def receive_some(self) -> bytes:
        return await self.stream.receive_some(65536)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def read_request(conn: Conn, buf: bytearray) -> bool:
    """One request (head and Content-Length body) off the connection; False at its end."""
    while b"\r\n\r\n" not in buf:
        data = await conn.receive_some()
        if not data:
            conn.engine.closed.set()
            return False
        buf += data
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end]).lower()
    length = 0
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(buf) < end + length:
        buf += await conn.receive_some()
    conn.engine.requests.append(bytes(buf[: end + length]))
    del buf[: end + length]
    return True


def json_answer(body: bytes = ANSWER, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
        % (extra, len(body), body)
    )


def answering(*answers: bytes) -> Handler:
    """Answer each request on a connection with the next of `answers`, then wait."""

    async def handler(conn: Conn) -> None:
        buf = bytearray()
        for answer in answers:
            if not await read_request(conn, buf):
                return
            await conn.send_all(answer)
        await read_request(conn, buf)

    return handler


@pytest.fixture
async def serve(nursery: trio.Nursery) -> AsyncIterator[Callable[[Handler], Awaitable[Engine]]]:
    async def start(handler: Handler) -> Engine:
        engine = Engine(0)

        async def counted(stream: Conn) -> None:
            engine.connections += 1
            try:
                await handler(Conn(stream, engine))
            except trio.BrokenResourceError:
                engine.closed.set()

        serve_tcp = partial(trio.serve_tcp, host="127.0.0.1")
        listeners = await nursery.start(serve_tcp, counted, 0)
        engine.port = listeners[0].socket.getsockname()[1]
        return engine

    yield start


# Set while a test runs with a ReadPump reading its streams (`pumped`).
_PUMPED: list[bool] = []


@pytest.fixture(autouse=True, params=[False, True], ids=["own-reads", "pumped"])
def pumped(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Every test here runs twice: streamed bodies read by their own tasks, and by a
    ReadPump, as the agent daemon has them read (agent/app.py)."""
    if request.param:
        _PUMPED.append(True)
    yield request.param
    _PUMPED.clear()


def pool(engine: Engine, read: float = 5.0) -> EnginePool:
    p = EnginePool(f"http://127.0.0.1:{engine.port}", EngineTimeouts(2.0, read), 8)
    if _PUMPED:
        p.pump = engine_http.ReadPump(lone=True)
        trio.lowlevel.spawn_system_task(p.pump.run)
    return p


def request(stream: bool = False, req_id: int = 1, **headers: str) -> dict:
    body = json.dumps({"model": "m1", "stream": stream}).encode()
    return m.request(
        req_id,
        "POST",
        "/v1/chat/completions",
        {"content-type": "application/json", **headers},
        body,
        stream,
    )


async def run(engine_pool: EnginePool, msg: dict) -> list[dict]:
    sent: list[dict] = []
    await forward(engine_pool, msg, sent.append)
    return sent


def only_error(sent: list[dict]) -> dict:
    assert [f["type"] for f in sent] == [m.ERROR], sent
    return sent[0]


# --- ordinary answers --------------------------------------------------------------


async def test_requests_share_one_kept_alive_connection(serve: Callable) -> None:
    engine = await serve(answering(json_answer(), json_answer(), json_answer()))
    async with pool(engine) as p:
        for i in range(3):
            sent = await run(p, request(req_id=i))
            assert [f["type"] for f in sent] == [m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END]
            assert sent[1]["data"] == ANSWER
    assert engine.connections == 1
    assert len(engine.requests) == 3
    head = engine.requests[0].split(b"\r\n\r\n")[0].lower()
    assert b"host: 127.0.0.1:%d" % engine.port in head
    # None of what httpx added: no cookies, no user agent, no compression asked for.
    assert b"cookie" not in head and b"user-agent" not in head and b"accept-encoding" not in head


@pytest.mark.parametrize("size", [1000, 4 * 1024 * 1024])
async def test_a_request_goes_out_whole_small_or_past_the_kernels_room(
    serve: Callable, size: int
) -> None:
    """A request the kernel takes at once goes straight to the socket; a body past the
    kernel's room waits for it and still arrives whole, in order, once."""
    engine = await serve(answering(json_answer()))
    body = bytes(range(256)) * (size // 256)
    async with pool(engine) as p:
        response = await p.send("POST", "/v1/embeddings", {}, body)
        try:
            assert response.status == 200
        finally:
            response.close()
    [sent] = engine.requests
    assert sent.endswith(b"\r\n\r\n" + body)


async def test_a_whole_body_already_there_after_its_head_is_read_without_a_wait(
    serve: Callable,
) -> None:
    """Engines write a whole answer's head and body apart. The body, there by the time
    the head is handled, is taken without a pass through the scheduler; one that comes
    later is still waited for."""
    answer = json_answer()
    head, body = answer[: answer.index(b"\r\n\r\n") + 4], answer[answer.index(b"\r\n\r\n") + 4 :]
    arrived = trio.Event()
    late = trio.Event()

    async def apart(conn: Conn) -> None:
        buf = bytearray()
        for wait in (arrived, late):
            if not await read_request(conn, buf):
                return
            await conn.send_all(head)
            await wait.wait()
            await conn.send_all(body)
        await read_request(conn, buf)

    engine = await serve(apart)
    async with pool(engine) as p:
        for wait in (arrived, late):
            response = await p.send("POST", "/v1/chat/completions", {}, b"{}")
            try:
                if wait is arrived:
                    arrived.set()
                    await trio.sleep(0.05)  # the body is in the agent's socket now
                    with passes_of_this_task() as passes:
                        assert await response.read_all(1 << 20) == body
                    assert passes.count == 0
                else:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_set_later, late)
                        assert await response.read_all(1 << 20) == body
            finally:
                response.close()
    assert engine.connections == 1


async def _set_later(event: trio.Event) -> None:
    await trio.sleep(0.05)
    event.set()


async def test_a_request_the_kernel_has_room_for_leaves_without_a_scheduler_pass(
    serve: Callable,
) -> None:
    engine = await serve(answering(json_answer()))
    async with pool(engine) as p:
        conn = await p._connect()
        try:
            with passes_of_this_task() as passes:
                await conn.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert passes.count == 0
            with trio.fail_after(5):  # the engine read it whole, and answers
                assert (await conn.stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
        finally:
            conn.close()
    assert engine.requests == [b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"]


async def test_chunked_and_close_delimited_bodies_arrive_whole(serve: Callable) -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
        b"\r\n5\r\n"
        + ANSWER[:5]
        + b"\r\n%x\r\n" % (len(ANSWER) - 5)
        + ANSWER[5:]
        + b"\r\n0\r\n\r\n"
    )

    async def close_delimited(stream: Conn) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
        await stream.send_all(ANSWER)
        await stream.aclose()

    engine = await serve(answering(chunked, chunked))
    async with pool(engine) as p:
        for _ in range(2):
            assert (await run(p, request()))[1]["data"] == ANSWER
    assert engine.connections == 1
    engine = await serve(close_delimited)
    async with pool(engine) as p:
        for _ in range(2):
            assert (await run(p, request()))[1]["data"] == ANSWER
    assert engine.connections == 2  # a body that ends with its connection ends it


async def test_headers_repeated_are_joined_and_hop_by_hop_ones_dropped(serve: Callable) -> None:
    extra = b"x-a: 1\r\nX-A: 2\r\nconnection: keep-alive\r\ndate: today\r\nserver: sim\r\n"
    informational = b"HTTP/1.1 100 Continue\r\nx-early: 1\r\n\r\n"
    engine = await serve(answering(informational + json_answer(extra=extra)))
    async with pool(engine) as p:
        head = (await run(p, request()))[0]
    assert head["status"] == 200
    assert head["headers"] == {"content-type": "application/json", "x-a": "1, 2"}


async def test_events_read_together_leave_in_one_frame_and_none_waits(
    serve: Callable,
) -> None:
    events = [b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % i for i in range(5)]
    together = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    step = trio.Event()

    async def handler(stream: Conn) -> None:
        await read_request(stream, bytearray())
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
        await stream.send_all(head + b"\r\n\r\n" + together)
        await step.wait()
        last = b"data: [DONE]\n\n"
        await stream.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))

    engine = await serve(handler)
    sent: list[dict] = []

    def record(frame: dict) -> None:
        sent.append(frame)
        if frame["type"] == m.RESPONSE_CHUNK:
            step.set()  # the first events left before the engine sent the last one

    async with pool(engine) as p:
        await forward(p, request(stream=True), record)
    chunks = [f["data"] for f in sent if f["type"] == m.RESPONSE_CHUNK]
    assert chunks == [b"".join(events), b"data: [DONE]\n\n"]
    assert sent[-1]["type"] == m.RESPONSE_END


# --- hostile engines ---------------------------------------------------------------


async def test_an_endless_head_is_refused_as_unavailable(serve: Callable) -> None:
    async def handler(stream: Conn) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\n")
        with trio.move_on_after(10):
            while True:
                await stream.send_all(b"x-pad: " + b"a" * 1000 + b"\r\n")

    engine = await serve(handler)
    async with pool(engine) as p:
        error = only_error(await run(p, request()))
    assert error["code"] == "backend_unavailable"
    assert error["message"] == f"engine unreachable: answer head larger than {MAX_HEAD_BYTES} bytes"


@pytest.mark.parametrize(
    ("answer", "code", "says"),
    [
        (b"SMTP ready\r\n\r\n", "backend_unavailable", "engine unreachable: answer head is not"),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabc",
            "backend_unavailable",
            "engine unreachable: answer head is not HTTP/1.1: Duplicate Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            "backend_error",
            "engine answer broke off: answer is not valid HTTP/1.1: Invalid character in chunk",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFFFFF\r\n",
            "backend_error",
            "engine answer broke off: answer is not valid HTTP/1.1: Chunk size overflow",
        ),
    ],
)
async def test_answers_that_are_not_http_fail_in_the_routers_terms(
    serve: Callable, answer: bytes, code: str, says: str
) -> None:
    engine = await serve(answering(answer))
    async with pool(engine) as p:
        error = only_error(await run(p, request()))
    assert error["code"] == code
    assert error["message"].startswith(says), error["message"]


async def test_a_close_before_or_inside_the_answer(serve: Callable) -> None:
    async def before(stream: Conn) -> None:
        await read_request(stream, bytearray())
        await stream.aclose()

    async def inside(stream: Conn) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + ANSWER[:10])
        await stream.aclose()

    async def inside_chunked(stream: Conn) -> None:
        await read_request(stream, bytearray())
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
        await stream.send_all(head + b'\r\n\r\n12\r\ndata: {"a": 1}\n\n\r\n')
        await stream.aclose()

    engine = await serve(before)
    async with pool(engine) as p:
        error = only_error(await run(p, request()))
    assert error == {
        **error,
        "code": "backend_unavailable",
        "message": "engine unreachable: engine closed the connection without an answer",
    }
    engine = await serve(inside)
    async with pool(engine) as p:
        error = only_error(await run(p, request()))
    assert error["code"] == "backend_error"
    assert error["message"] == (
        "engine answer broke off: engine closed the connection inside the answer"
    )
    engine = await serve(inside_chunked)
    async with pool(engine) as p:
        sent = await run(p, request(stream=True))
    # The checked event already left; the stream then fails.
    assert [f["type"] for f in sent] == [m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.ERROR]
    assert sent[-1]["message"].startswith("engine answer broke off: engine closed")


@pytest.mark.parametrize("waiting", [True, False], ids=["reset-while-waiting", "reset-queued"])
async def test_a_reset_inside_the_answer_breaks_it_off(serve: Callable, waiting: bool) -> None:
    """The engine resets the connection part way through a stream, while the agent
    waits for more or before it reads again: the stream ends with an error, never
    hangs (reads wait for readiness on the bare socket, `EngineResponse._read`)."""

    async def reset(stream: Conn) -> None:
        await read_request(stream, bytearray())
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
        await stream.send_all(head + b'\r\n\r\n12\r\ndata: {"a": 1}\n\n\r\n')
        if waiting:
            await trio.sleep(0.2)
        stream.stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()

    engine = await serve(reset)
    async with pool(engine, read=5) as p:
        with trio.fail_after(4):
            sent = await run(p, request(stream=True))
    assert sent[-1]["type"] == m.ERROR
    assert sent[-1]["message"].startswith("engine answer broke off: engine connection failed"), (
        sent[-1]
    )


async def test_a_slowloris_head_times_out_within_the_read_timeout(serve: Callable) -> None:
    async def handler(stream: Conn) -> None:
        await read_request(stream, bytearray())
        for byte in json_answer():
            await stream.send_all(bytes([byte]))
            await trio.sleep(0.05)  # each byte well within the read timeout

    engine = await serve(handler)
    async with pool(engine, read=0.3) as p:
        error = only_error(await run(p, request()))
    assert error["code"] == "backend_unavailable"
    assert error["message"] == "engine timed out: no answer head within 0.3 s"


async def test_a_silent_stream_and_a_dribbled_whole_answer_break_off(serve: Callable) -> None:
    async def silent(stream: Conn) -> None:
        await read_request(stream, bytearray())
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
        await stream.send_all(head + b'\r\n\r\n12\r\ndata: {"a": 1}\n\n\r\n')
        await read_request(stream, bytearray())  # until the agent hangs up

    async def dribbled(stream: Conn) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(ANSWER))
        for byte in ANSWER:
            await stream.send_all(bytes([byte]))
            await trio.sleep(0.05)

    engine = await serve(silent)
    async with pool(engine, read=0.3) as p:
        sent = await run(p, request(stream=True))
    assert sent[-1]["message"] == "engine answer broke off: no answer data for 0.3 s"
    assert await _closed_soon(engine)
    engine = await serve(dribbled)
    async with pool(engine, read=0.3) as p:
        error = only_error(await run(p, request()))
    assert error["message"] == "engine answer broke off: answer not whole within 0.3 s"


async def test_a_steady_stream_outlives_its_first_read_deadline(serve: Callable) -> None:
    """Events every 0.2 s against a 0.5 s read timeout (0.3 s of slack for a busy
    host's scheduler), for four times as long as the stream's first deadline: each
    arrival moves it on (`ReadIdle`)."""
    events = 10

    async def steady(stream: Conn) -> None:
        await read_request(stream, bytearray())
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
        await stream.send_all(head + b"\r\n\r\n")
        for i in range(events):
            event = b'data: {"i": %d}\n\n' % i
            await stream.send_all(b"%x\r\n%s\r\n" % (len(event), event))
            await trio.sleep(0.2)
        done = b"data: [DONE]\n\n"
        await stream.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        await read_request(stream, bytearray())

    engine = await serve(steady)
    async with pool(engine, read=0.5) as p:
        began = trio.current_time()
        sent = await run(p, request(stream=True))
        took = trio.current_time() - began
    assert took > 1.25 * 0.5 * 3  # well past where a deadline never moved would cut it
    assert [f["type"] for f in sent][-1] == m.RESPONSE_END, sent[-1]
    relayed = b"".join(f["data"] for f in sent if f["type"] == m.RESPONSE_CHUNK)
    assert relayed.count(b"data: ") == events + 1


@pytest.mark.parametrize("apart", [False, True], ids=["end-with-done", "end-after-done"])
async def test_a_stream_s_connection_is_reused_whether_its_end_came_with_done_or_after(
    serve: Callable, apart: bool
) -> None:
    """After `[DONE]` the chunked body's end is read when the pool next takes the
    connection, not waited for: a request that comes before it opens another, and
    the connection serves the next one once its end has come."""
    done = b"data: [DONE]\n\n"
    event = b"%x\r\n%s\r\n" % (len(done), done)
    end = b"0\r\n\r\n"

    async def handler(stream: Conn) -> None:
        buf = bytearray()
        while await read_request(stream, buf):
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            first = b'data: {"a": 1}\n\n'
            await stream.send_all(
                head + b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(first), first)
            )
            if apart:
                await stream.send_all(event)
                await trio.sleep(0.1)
                await stream.send_all(end)
            else:
                await stream.send_all(event + end)

    engine = await serve(handler)
    async with pool(engine) as p:
        for i in range(2):
            sent = await run(p, request(stream=True, req_id=i))
            assert sent[-1]["type"] == m.RESPONSE_END, sent
        assert engine.connections == (2 if apart else 1)
        await trio.sleep(0.3)  # every end has come
        for i in range(2, 5):
            sent = await run(p, request(stream=True, req_id=i))
            assert sent[-1]["type"] == m.RESPONSE_END, sent
            if apart:
                await trio.sleep(0.3)
        # Whole only if the end came with `[DONE]`.
        response = await p.send("POST", "/v1/chat/completions", {}, b"{}")
        try:
            pieces = b""
            while b"[DONE]" not in pieces:
                pieces += await response.receive()
            assert response.read_whole is not apart
        finally:
            response.close()
    assert engine.connections == (2 if apart else 1)


@pytest.mark.parametrize(
    "after",
    [b"junk", b"0\r\n\r\nHTTP/1.1 200 OK\r\n", b"%x\r\n%s\r\n" % (70000, b"x" * 70000)],
    ids=["junk", "bytes-past-the-end", "more-body-than-finish-bytes"],
)
async def test_a_stream_s_connection_whose_end_is_not_an_end_is_closed_not_reused(
    serve: Callable, after: bytes
) -> None:
    """What the pool reads after a stream's last event must be the chunked body's end
    and no more, within FINISH_BYTES; anything else and the connection is closed."""
    done = b"data: [DONE]\n\n"

    async def handler(stream: Conn) -> None:
        buf = bytearray()
        while await read_request(stream, buf):
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            await stream.send_all(
                head + b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(done), done)
            )
            await trio.sleep(0.05)
            await stream.send_all(after)

    engine = await serve(handler)
    async with pool(engine) as p:
        sent = await run(p, request(stream=True))
        assert sent[-1]["type"] == m.RESPONSE_END, sent
        await trio.sleep(0.3)
        sent = await run(p, request(stream=True, req_id=2))
        assert sent[-1]["type"] == m.RESPONSE_END, sent
        assert engine.connections == 2
        assert await _closed_soon(engine, 0.5)  # the first, when the second was asked


def _stream_answers(end_apart: float | None) -> Handler:
    """Streamed answers of two events and `[DONE]`; the chunked body's end follows
    `end_apart` seconds later, or never (None) while the connection lasts."""

    async def handler(stream: Conn) -> None:
        buf = bytearray()
        while await read_request(stream, buf):
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            await stream.send_all(head + b"transfer-encoding: chunked\r\n\r\n")
            for event in (b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"):
                await stream.send_all(b"%x\r\n%s\r\n" % (len(event), event))
            if end_apart is None:
                await read_request(stream, buf)  # until the agent hangs up
                return
            await trio.sleep(end_apart)
            await stream.send_all(b"0\r\n\r\n")

    return handler


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_an_answer_enters_one_cancel_scope_for_all_its_read_timeouts(
    serve: Callable, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The head's timeout, the body's and the drain's are deadlines of the request's
    one scope (`ReadLimits`): a scope each cost some 5 µs, three per stream."""
    handler = _stream_answers(0.05) if stream else answering(json_answer(), json_answer())
    engine = await serve(handler)
    entered = 0
    enter = trio.CancelScope.__enter__
    this_task = trio.lowlevel.current_task()

    def counted(scope: trio.CancelScope) -> trio.CancelScope:
        nonlocal entered
        entered += trio.lowlevel.current_task() is this_task  # not the engine's sleeps
        return enter(scope)

    async with pool(engine) as p:
        await run(p, request(stream=stream))  # the connection opens (its own scope)
        await trio.sleep(0.1)  # a stream's end has come: the connection is taken again
        monkeypatch.setattr(trio.CancelScope, "__enter__", counted)
        sent = await run(p, request(stream=stream, req_id=2))
        monkeypatch.undo()
        assert sent[-1]["type"] == m.RESPONSE_END, sent
        assert repr(p).endswith("1 idle, 1 opened>")  # kept, a stream's end read later
    assert entered == 1


@pytest.mark.parametrize("taken", [False, True], ids=["tidied", "taken"])
async def test_a_stream_whose_body_never_ends_is_complete_and_its_connection_closed(
    serve: Callable, monkeypatch: pytest.MonkeyPatch, nursery: trio.Nursery, taken: bool
) -> None:
    """`[DONE]` came but the chunked body's end does not: the client has its whole
    answer, and the connection is dropped FINISH_SECONDS later, by the pool's tidying
    or by the next request that would take it, and not pooled."""
    monkeypatch.setattr(engine_http, "FINISH_SECONDS", 0.2)
    engine = await serve(_stream_answers(None))
    async with pool(engine, read=5.0) as p:
        if not taken:
            nursery.start_soon(partial(p.tidy, every=0.05))
        began = trio.current_time()
        sent = await run(p, request(stream=True))
        assert trio.current_time() - began < 2.0
        assert [f["type"] for f in sent][-1] == m.RESPONSE_END, sent
        assert not [f for f in sent if f["type"] == m.ERROR]
        if taken:
            await trio.sleep(0.3)
            assert p._take() is None
        assert await _closed_soon(engine, 1.0)  # not KEEPALIVE_EXPIRY's 4 s
        assert repr(p).endswith("0 idle, 1 opened>")


async def test_a_stream_s_end_is_read_in_the_request_where_it_cannot_be_read_later(
    serve: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection the pool cannot read without waiting (TLS; here a test's stream)
    has its stream's end read before the request is over, at most FINISH_SECONDS."""
    monkeypatch.setattr(engine_http, "FINISH_SECONDS", 0.2)
    engine = await serve(_stream_answers(None))

    class Wrapped:  # not a plain TCP stream: no socket the pool could read
        def __init__(self, stream: trio.SocketStream) -> None:
            self.stream = stream

        async def send_all(self, data: bytes) -> None:
            await self.stream.send_all(data)

        async def receive_some(self, max_bytes: int | None = None) -> bytes:
            return await self.stream.receive_some(max_bytes)

        def close(self) -> None:
            self.stream.socket.close()

    async def open_stream() -> Wrapped:
        return Wrapped(await trio.open_tcp_stream("127.0.0.1", engine.port))

    url = f"http://127.0.0.1:{engine.port}"
    async with EnginePool(url, EngineTimeouts(2.0, 5.0), 8, open_stream) as p:
        began = trio.current_time()
        sent = await run(p, request(stream=True))
        assert 0.2 <= trio.current_time() - began < 2.0
        assert [f["type"] for f in sent][-1] == m.RESPONSE_END, sent
        assert await _closed_soon(engine)
        assert repr(p).endswith("0 idle, 1 opened>")


@pytest.mark.parametrize("phase", ["head", "stream"])
async def test_a_cancel_before_a_deadline_reports_nothing_and_closes_the_connection(
    serve: Callable, phase: str
) -> None:
    """The router's cancel ends the request's scope too: no timeout is reported for
    it (the router stopped listening), and the engine sees its connection close."""

    async def handler(stream: Conn) -> None:
        await read_request(stream, bytearray())
        if phase == "stream":
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            event = b'data: {"a": 1}\n\n'
            chunk = b"%x\r\n%s\r\n" % (len(event), event)
            await stream.send_all(head + b"transfer-encoding: chunked\r\n\r\n" + chunk)
        await read_request(stream, bytearray())  # until the agent hangs up

    engine = await serve(handler)
    sent: list[dict] = []
    scope = trio.CancelScope()

    async def worker(p: EnginePool) -> None:
        with scope:  # as the session's worker enters it
            limits = ReadLimits(p.timeouts.read, scope)
            await forward(p, request(stream=True), sent.append, limits=limits)

    async with pool(engine, read=5.0) as p, trio.open_nursery() as nursery:
        nursery.start_soon(worker, p)
        await trio.sleep(0.2)
        scope.cancel()
    assert scope.cancelled_caught
    assert [f["type"] for f in sent] == (
        [m.RESPONSE_HEAD, m.RESPONSE_CHUNK] if phase == "stream" else []
    )
    assert await _closed_soon(engine)


async def _closed_soon(engine: Engine, within: float = 5.0) -> bool:
    with trio.move_on_after(within):
        await engine.closed.wait()
    return engine.closed.is_set()


async def test_answers_larger_than_a_frame_are_refused(
    serve: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forward_module, "MAX_ANSWER_BYTES", 1000)
    declared = b"HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\r\n"
    chunked = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"100\r\n%s\r\n" % (b"a" * 256) * 5
    )
    for answer, says in ((declared, "answer of 5000 bytes exceeds 1000"), (chunked, "larger")):
        engine = await serve(answering(answer))
        async with pool(engine) as p:
            error = only_error(await run(p, request()))
        assert error["code"] == "backend_error"
        assert error["message"].startswith("engine answer broke off: "), error
        assert says in error["message"]


async def test_unreachable_and_connect_timeout(serve: Callable) -> None:
    with trio.socket.socket() as unused:
        await unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        async with EnginePool(f"http://127.0.0.1:{port}", EngineTimeouts(2.0, 2.0), 1) as p:
            error = only_error(await run(p, request()))
    assert error["code"] == "backend_unavailable"
    assert error["message"].startswith(
        f"engine unreachable: cannot connect to http://127.0.0.1:{port}"
    )

    async def never() -> trio.SocketStream:
        await trio.sleep_forever()
        raise AssertionError

    async with EnginePool("http://engine", EngineTimeouts(0.2, 2.0), 1, never) as p:
        error = only_error(await run(p, request()))
    assert error["message"] == "engine timed out: no connection to http://engine within 0.2 s"


async def test_a_backend_url_s_user_and_password_are_the_engine_s_basic_authentication(
    serve: Callable,
) -> None:
    """As httpx sent them: every request carries them, in place of any authorization
    the request had; neither the Host header nor an error message shows them."""
    engine = await serve(answering(json_answer()))
    url = f"http://agent:s%3Acret@127.0.0.1:{engine.port}"
    async with EnginePool(url, EngineTimeouts(2.0, 2.0), 1) as p:
        sent = await run(p, request(authorization="Bearer client-key"))
        assert [f["type"] for f in sent] == [m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END]
    head = engine.requests[0].split(b"\r\n\r\n")[0].decode()
    # agent:s:cret
    assert head.lower().count("authorization:") == 1, head
    assert "\r\nauthorization: Basic YWdlbnQ6czpjcmV0\r\n" in head
    assert f"\r\nhost: 127.0.0.1:{engine.port}\r\n" in head and "cret@" not in head

    with trio.socket.socket() as unused:
        await unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        async with EnginePool(
            f"http://agent:s3cret@127.0.0.1:{port}", EngineTimeouts(2.0, 2.0), 1
        ) as p:
            error = only_error(await run(p, request()))
    assert f"cannot connect to http://127.0.0.1:{port}" in error["message"]
    assert "s3cret" not in error["message"]


async def test_a_header_with_a_line_break_is_never_sent(serve: Callable) -> None:
    engine = await serve(answering(json_answer()))
    async with pool(engine) as p:
        error = only_error(await run(p, request(**{"x-request-id": "a\r\nx-evil: 1"})))
        assert error["message"] == (
            "engine unreachable: request line or header holds a line break; not sent"
        )
        error = only_error(await run(p, request(**{"x-request-id": "\u20ac"})))
        assert "not Latin-1" in error["message"]
    assert engine.requests == []


async def test_junk_after_an_answer_and_an_engine_closing_idle_connections(
    serve: Callable,
) -> None:
    engine = await serve(answering(json_answer() + b"HTTP/1.1 200 OK\r\n", json_answer()))
    async with pool(engine) as p:
        for _ in range(2):
            assert (await run(p, request()))[1]["data"] == ANSWER
    assert engine.connections == 2  # the connection that carried junk was not reused

    async def one_each(stream: Conn) -> None:
        # Closes after one answer without saying so (no `connection: close`).
        await read_request(stream, bytearray())
        await stream.send_all(json_answer())
        await stream.aclose()

    engine = await serve(one_each)
    async with pool(engine) as p:
        for _ in range(3):
            assert (await run(p, request()))[1]["data"] == ANSWER
            await trio.sleep(0.05)  # the engine's FIN arrives while the connection idles
    assert engine.connections == 3


async def test_a_cancelled_request_closes_its_engine_connection(serve: Callable) -> None:
    async def endless(stream: Conn) -> None:
        await read_request(stream, bytearray())
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
        await stream.send_all(head + b"\r\n\r\n")
        event = b'data: {"a": 1}\n\n'
        while True:
            await stream.send_all(b"%x\r\n%s\r\n" % (len(event), event))
            await trio.sleep(0.01)

    engine = await serve(endless)
    sent: list[dict] = []
    async with pool(engine) as p:
        with trio.move_on_after(0.3):
            await forward(p, request(stream=True), sent.append)
        assert await _closed_soon(engine)
        assert repr(p).endswith("0 idle, 1 opened>")
    assert sent[0]["type"] == m.RESPONSE_HEAD


async def test_the_response_object_reads_and_limits(serve: Callable) -> None:
    engine = await serve(answering(json_answer()))
    async with pool(engine) as p:
        response = await p.send("POST", "/x", {}, b"{}")
        with pytest.raises(EngineBrokeOff, match="exceeds 3"):
            await response.read_all(3)
        response.close()
        with pytest.raises(EngineUnavailable):
            await p.send("GET", "/x\r\nevil: 1", {}, b"")


def test_an_engine_url_the_client_cannot_use_stops_the_agent_at_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agent.cli import main

    router = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGQaEXi5zdK6sv4u1rjM8EQrfH3GnjJb8GrmyrXrU2yZ8"
    for url, says in (("unix:///tmp/x", "http:// or https://"), ("http://h:port", "port")):
        assert main(["--router", router, "--model", "m", "--backend-url", url]) == 2
        assert says in capsys.readouterr().err
        with pytest.raises(ValueError, match=says):
            EnginePool(url, EngineTimeouts(1.0, 1.0), 1)


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1 and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def test_an_https_engine_is_verified_and_its_connection_kept(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = _self_signed(tmp_path)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    connections = 0

    async def handler(stream: trio.SSLStream) -> None:
        nonlocal connections
        connections += 1
        buf = bytearray()
        with contextlib.suppress(trio.BrokenResourceError):
            for body in (ANSWER, ANSWER):
                while b"}" not in buf:  # the request's JSON body has ended
                    buf += await stream.receive_some(65536)
                buf.clear()
                await stream.send_all(json_answer(body))
            await stream.receive_some(65536)

    serve_tls = partial(trio.serve_ssl_over_tcp, host="127.0.0.1")
    listeners = await nursery.start(serve_tls, handler, 0, server)
    port = listeners[0].transport_listener.socket.getsockname()[1]
    timeouts = EngineTimeouts(2.0, 5.0)
    # Not trusted: the client verifies the engine's certificate.
    async with EnginePool(f"https://localhost:{port}", timeouts, 2) as p:
        error = only_error(await run(p, request()))
    assert error["message"].startswith("engine unreachable: cannot connect")
    assert "CERTIFICATE_VERIFY_FAILED" in error["message"]
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    async with EnginePool(f"https://localhost:{port}", timeouts, 2) as p:
        for _ in range(2):
            assert (await run(p, request()))[1]["data"] == ANSWER
    assert connections == 2  # the refused one, then one kept for two requests


async def test_idle_connections_are_looked_at_past_1024_descriptors(serve: Callable) -> None:
    """An agent with many router sessions holds descriptors past select()'s limit."""
    held = [os.dup(0) for _ in range(1100)]
    try:

        async def one_each(stream: Conn) -> None:
            await read_request(stream, bytearray())
            await stream.send_all(json_answer())
            await stream.aclose()

        engine = await serve(one_each)
        async with pool(engine) as p:
            for _ in range(2):
                assert (await run(p, request()))[1]["data"] == ANSWER
                await trio.sleep(0.05)
        assert engine.connections == 2
    finally:
        for fd in held:
            os.close(fd)


# --- the engine's metrics page -------------------------------------------------------


def _page_answer(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    head = b"HTTP/1.1 %s\r\ncontent-type: text/plain; version=0.0.4\r\n%s" % (status, extra)
    return head + b"content-length: %d\r\n\r\n%s" % (len(body), body)


async def test_the_metrics_page_is_fetched_again_over_one_connection(serve: Callable) -> None:
    """`MetricsPage` replaces httpx for the scrape every half second: one kept-alive
    connection, the URL's own path, query and trailing slash, a gzip page decoded."""
    text = 'vllm:num_requests_running{model_name="m"} 3\n'
    engine = await serve(
        answering(
            _page_answer(text.encode()),
            _page_answer(gzip.compress(text.encode()), extra=b"content-encoding: gzip\r\n"),
            _page_answer(b"loading", b"503 Service Unavailable"),
        )
    )
    page = MetricsPage(f"http://127.0.0.1:{engine.port}/metrics/?name=a%20b")
    try:
        assert await page.text() == text
        assert await page.text() == text
        with pytest.raises(ValueError, match="answered HTTP 503"):
            await page.text()
    finally:
        page.close()
    assert engine.connections == 1
    assert [r.split(b"\r\n")[0] for r in engine.requests] == [
        b"GET /metrics/?name=a%20b HTTP/1.1"
    ] * 3


@pytest.mark.parametrize(
    ("path", "target"), [("", b"/"), ("/", b"/"), ("/metrics", b"/metrics"), ("/m?x", b"/m?x")]
)
async def test_the_metrics_page_asks_for_its_url_s_target(
    serve: Callable, path: str, target: bytes
) -> None:
    asked = await _one_page(serve, lambda port: f"http://127.0.0.1:{port}{path}")
    assert asked.startswith(b"GET %s HTTP/1.1\r\n" % target)


async def _one_page(serve: Callable, url: Callable[[int], str]) -> bytes:
    """Fetch a one-line page once from `url(port)`; the request the engine got."""
    engine = await serve(answering(_page_answer(b"x 1\n")))
    page = MetricsPage(url(engine.port))
    try:
        assert await page.text() == "x 1\n"
    finally:
        page.close()
    return engine.requests[0]


async def test_a_metrics_page_that_does_not_decode_is_a_failed_scrape(serve: Callable) -> None:
    engine = await serve(
        answering(
            _page_answer(b"not gzip", extra=b"content-encoding: gzip\r\n"),
            _page_answer(b"x 1\n", extra=b"content-encoding: br\r\n"),
        )
    )
    page = MetricsPage(f"http://127.0.0.1:{engine.port}/metrics")
    try:
        with pytest.raises(ValueError, match="does not decode as gzip"):
            await page.text()
        with pytest.raises(ValueError, match="content-encoding 'br'"):
            await page.text()
    finally:
        page.close()


@pytest.mark.parametrize(
    "url", ["localhost:8000/metrics", "ftp://engine/metrics", "http://:1/m", "http://e:x/m"]
)
async def test_a_metrics_url_the_client_cannot_use_fails_each_scrape(url: str) -> None:
    """As httpx did: the agent logs `engine_metrics_failed` and serves on without the
    values, rather than stopping."""
    page = MetricsPage(url)
    try:
        for _ in range(2):
            with pytest.raises(ValueError, match="not an http:// or https:// URL with a host"):
                await page.text()
    finally:
        page.close()


async def test_a_metrics_url_s_user_and_password_are_basic_authentication(
    serve: Callable,
) -> None:
    asked = await _one_page(serve, lambda port: f"http://scraper:p%40ss@127.0.0.1:{port}/m")
    head = asked.decode()
    assert "authorization: Basic c2NyYXBlcjpwQHNz\r\n" in head  # scraper:p@ss
    assert "\r\nhost: 127.0.0.1:" in head and "scraper" not in head.split("host:")[1]


async def test_a_metrics_page_too_large_or_decoding_too_large_fails_the_scrape(
    serve: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page past MAX_BYTES, as sent or once decoded (a gzip bomb), is a failed scrape;
    neither is held whole in memory."""
    monkeypatch.setattr(MetricsPage, "MAX_BYTES", 1024)
    bomb = gzip.compress(b"x 1\n" * 100_000)
    engine = await serve(
        answering(
            _page_answer(b"x 1\n" * 1000),
            _page_answer(bomb, extra=b"content-encoding: gzip\r\n"),
        )
    )
    page = MetricsPage(f"http://127.0.0.1:{engine.port}/metrics")
    try:
        with pytest.raises(EngineBrokeOff, match="exceeds 1024"):
            await page.text()
        with pytest.raises(ValueError, match="decodes past 1024 bytes"):
            await page.text()
    finally:
        page.close()


async def test_a_stream_the_pump_reads_when_the_pump_stops_breaks_off(
    serve: Callable, pumped: bool
) -> None:
    """The agent's engine reader stopping (the daemon ending) ends each stream it was
    reading as broken off, and a stream that comes later reads for itself."""
    if pumped:
        return  # this test runs the pool's own pump
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    head += b"transfer-encoding: chunked\r\n\r\n"
    event = b'data: {"a":1}\n\ndata: [DONE]\n\n'
    whole = head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event)

    async def first_silent(conn: Conn) -> None:
        await answering(head if conn.engine.connections == 1 else whole)(conn)

    engine = await serve(first_silent)
    async with pool(engine) as p, trio.open_nursery() as nursery:
        pump_scope = trio.CancelScope()

        async def pump() -> None:
            with pump_scope:
                await p.run_pump()

        nursery.start_soon(pump)
        await trio.sleep(0.05)
        assert p.pump is not None
        p.pump.lone = True
        sent: list[dict] = []
        nursery.start_soon(forward, p, request(stream=True), sent.append)
        await trio.sleep(0.1)
        assert sent == []  # no event yet: the stream waits in the pump
        pump_scope.cancel()
        await trio.sleep(0.05)
        assert p.pump is None
        assert only_error(sent)["code"] == "backend_error"
        assert "engine reader stopped" in sent[0]["message"]
        later = await run(p, request(stream=True, req_id=2))
        assert [f["type"] for f in later][-1] == m.RESPONSE_END


async def test_a_lone_stream_reads_for_itself_and_concurrent_ones_join_the_pump(
    serve: Callable, pumped: bool
) -> None:
    """Streams are read by the pump where there are several at once; one alone is read
    by its own task (the pump would cost it a registration and a wake-up more). Both
    relay the same frames."""
    if pumped:
        return  # this test runs a pool's pump of its own
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    head += b"transfer-encoding: chunked\r\n\r\n"
    event = b'data: {"a":1}\n\ndata: [DONE]\n\n'
    go = trio.Event()

    async def held(conn: Conn) -> None:
        buf = bytearray()
        while await read_request(conn, buf):
            await conn.send_all(head)
            await go.wait()
            await conn.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))

    engine = await serve(held)
    async with pool(engine) as p, trio.open_nursery() as nursery:
        p.pump = engine_http.ReadPump()
        trio.lowlevel.spawn_system_task(p.pump.run)
        sent: list[list[dict]] = [[], []]
        nursery.start_soon(forward, p, request(stream=True), sent[0].append)
        await trio.sleep(0.1)
        assert p.pump.streams == 1 and not p.pump._waits  # alone: its own reads
        nursery.start_soon(forward, p, request(stream=True, req_id=2), sent[1].append)
        await trio.sleep(0.1)
        assert p.pump.streams == 2 and len(p.pump._waits) == 1  # the second: the pump's
        go.set()
    assert p.pump.streams == 0 and not p.pump._waits
    for frames in sent:
        assert [f["type"] for f in frames] == [m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END]
        assert frames[1]["data"] == event


# --- llama.cpp's count with its chat template (agent/chat_template.py) ---------------


def _llama_server(template: bool | bytes) -> Handler:
    """llama-server's two endpoints, as it answers them (`/apply-template` only where
    `template`: older builds answer 404; bytes: what a broken one answers instead)."""

    async def handler(conn: Conn) -> None:
        buf = bytearray()
        while await read_request(conn, buf):
            request = conn.engine.requests[-1]
            path = request.split(b" ")[1]
            payload = json.loads(request.split(b"\r\n\r\n", 1)[1])
            if path == b"/apply-template" and isinstance(template, bytes):
                await conn.send_all(json_answer(template))
            elif path == b"/apply-template" and template:
                turns = "".join(f"<|{t['role']}|>{t['content']}\n" for t in payload["messages"])
                tools = "".join(
                    f"<|tool|>{t['function']['name']}\n" for t in payload.get("tools", [])
                )
                answer = json.dumps({"prompt": tools + turns + "<|assistant|>"}).encode()
                await conn.send_all(json_answer(answer))
            elif path == b"/tokenize":
                ids = list(range(len(payload["content"].split()) + payload["add_special"]))
                await conn.send_all(json_answer(json.dumps({"tokens": ids}).encode()))
            else:
                await conn.send_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")

    return handler


def _count(body: dict) -> dict:
    return m.request(7, "POST", "/tokenize", {}, json.dumps(body).encode(), False)


_CONVERSATION = {
    "content": "be brief\nhello there",
    "add_special": True,
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ],
}


@pytest.mark.parametrize(
    "template",
    [True, False, b'{"prompt": 12}', b"not json"],
    ids=["templated", "older-server", "no-prompt", "junk"],
)
async def test_llamacpp_counts_the_conversation_as_its_template_makes_it(
    serve: Callable, template: bool | bytes
) -> None:
    engine = await serve(_llama_server(template))
    async with pool(engine) as p:
        p.kind = "llamacpp"
        sent = await run(p, _count(_CONVERSATION))
    paths = [r.split(b" ")[1] for r in engine.requests]
    assert paths == [b"/apply-template", b"/tokenize"]
    asked = json.loads(engine.requests[0].split(b"\r\n\r\n", 1)[1])
    assert asked == {"messages": _CONVERSATION["messages"]}
    tokenized = json.loads(engine.requests[1].split(b"\r\n\r\n", 1)[1])
    if template is True:
        prompt = "<|system|>be brief\n<|user|>hello there\n<|assistant|>"
        assert tokenized == {"content": prompt, "add_special": True}
    else:  # the text alone, as the router wrote it
        assert tokenized == {"content": "be brief\nhello there", "add_special": True}
    assert [f["type"] for f in sent] == [m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END]
    words = len(tokenized["content"].split())
    assert json.loads(sent[1]["data"]) == {"tokens": list(range(words + 1))}


async def test_a_text_count_or_another_engine_is_not_templated(serve: Callable) -> None:
    engine = await serve(_llama_server(True))
    async with pool(engine) as p:
        p.kind = "llamacpp"
        # A continuation's count of the text sent (router/continuation_relay.py).
        await run(p, _count({"content": "some text", "add_special": True}))
        p.kind = "sglang"
        await run(p, _count(_CONVERSATION))
    assert [r.split(b" ")[1] for r in engine.requests] == [b"/tokenize", b"/tokenize"]
    assert json.loads(engine.requests[1].split(b"\r\n\r\n", 1)[1]) == _CONVERSATION


async def test_a_count_body_that_is_no_json_object_goes_as_it_came(serve: Callable) -> None:
    engine = await serve(answering(json_answer(), json_answer()))
    async with pool(engine) as p:
        p.kind = "llamacpp"
        for body in (b"not json", b'["messages"]'):
            msg = m.request(7, "POST", "/tokenize", {}, body, False)
            assert (await run(p, msg))[0]["type"] == m.RESPONSE_HEAD
    assert [r.split(b"\r\n\r\n", 1)[1] for r in engine.requests] == [b"not json", b'["messages"]']
    assert all(r.startswith(b"POST /tokenize ") for r in engine.requests)  # no template asked
