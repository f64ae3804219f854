"""The router's HTTP/1.1 server (router/http/server.py) on its own, with small ASGI apps.

Whole-router behaviour (errors, cancels, shutdown, closed connections) is covered by
the API tests; these pin the server's own promises, hostile input through real
sockets among them, and its one router flag (`--http-write-timeout`) end to end.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import resource
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import httpx
import pytest
import trio
import trio.testing

from router.cli import build_parser, settings_from
from router.http.app import protocol_of
from router.http.asgi import ANSWER_SCOPE, BODY_READY, HOLD_HEAD, ON_DISCONNECT, is_request_id
from router.http.server import (
    IDLE,
    MAX_HEAD_BYTES,
    WRITE_PIECE_BYTES,
    HttpServer,
    UnsendableHead,
    _Connection,
)
from tests.fleet import Fleet, wait_until

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


async def echo(scope: dict, receive: Receive, send: Send) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = b"%s %s %s" % (scope["method"].encode(), scope["path"].encode(), body)
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


async def writes_of(app: Callable, request: bytes) -> tuple[list[bytes], bytes]:
    """Serve `request` over an in-memory stream; each socket write the server made."""
    client, server_side = trio.testing.memory_stream_pair()
    writes: list[bytes] = []
    send_stream = server_side.send_stream
    original = send_stream.send_all

    async def recording_send_all(data: bytes) -> None:
        writes.append(bytes(data))
        await original(data)

    send_stream.send_all = recording_send_all  # type: ignore[method-assign]
    server = HttpServer(app, keep_alive_timeout=5)
    received = b""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run_connection, server_side)
        await client.send_all(request)
        await client.send_eof()
        while chunk := await client.receive_some(65536):
            received += chunk
    return writes, received


async def test_a_whole_answer_leaves_in_one_write() -> None:
    request = (
        b"POST /v1/x%20y?q=1 HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
        b"Connection: close\r\n\r\nhello"
    )
    writes, received = await writes_of(echo, request)
    assert len(writes) == 1, writes
    assert received.startswith(b"HTTP/1.1 200 "), received
    assert b"\r\ndate: " in received.lower()
    assert received.endswith(b"\r\n\r\nPOST /v1/x y hello")


async def test_a_streamed_answer_is_chunked_and_complete() -> None:
    async def stream(scope: dict, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"one", b"", b"two"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    request = b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    _, received = await writes_of(stream, request)
    assert b"transfer-encoding: chunked" in received.lower()
    assert received.endswith(b"3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n"), received


async def test_pipelined_requests_are_answered_in_order() -> None:
    request = b"".join(
        b"POST /%d HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\n%d" % (i, i) for i in range(3)
    )
    _, received = await writes_of(echo, request)
    assert received.count(b"HTTP/1.1 200") == 3
    order = [received.index(b"POST /%d %d" % (i, i)) for i in range(3)]
    assert order == sorted(order)


async def test_an_app_that_answers_nothing_gives_500_and_a_failing_app_too() -> None:
    async def silent(scope: dict, receive: Receive, send: Send) -> None:
        return

    async def failing(scope: dict, receive: Receive, send: Send) -> None:
        raise ValueError("bug")

    request = b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    for app in (silent, failing):
        _, received = await writes_of(app, request)
        assert received.startswith(b"HTTP/1.1 500 "), received


async def test_malformed_request_gets_400_and_the_connection_closes() -> None:
    _, received = await writes_of(echo, b"NOT HTTP AT ALL\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 400 "), received
    assert b"connection: close" in received.lower()


async def test_an_unread_body_is_dropped_and_the_connection_serves_the_next_request() -> None:
    async def ignores_body(scope: dict, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": b"no"})

    body = b"x" * 100_000
    request = b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    _, received = await writes_of(ignores_body, request * 2)
    assert received.count(b"HTTP/1.1 413") == 2


async def test_client_leaving_is_http_disconnect() -> None:
    seen: list[str] = []
    answered = trio.Event()

    async def waits(scope: dict, receive: Receive, send: Send) -> None:
        await receive()  # the (empty) body
        seen.append((await receive())["type"])
        answered.set()

    async with trio.open_nursery() as nursery:
        server = HttpServer(waits)
        port = await nursery.start(server.serve, ("127.0.0.1", 0), trio.sleep_forever)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await trio.sleep(0.2)
        await stream.aclose()
        with trio.fail_after(10):
            await answered.wait()
        nursery.cancel_scope.cancel()
    assert seen == ["http.disconnect"]


async def test_keep_alive_timeout_and_graceful_stop() -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        server = HttpServer(echo, keep_alive_timeout=0.3, graceful_timeout=1)
        port = await nursery.start(server.serve, ("127.0.0.1", 0), stop.wait)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            r = await client.post("/a", content=b"b")
            assert r.text == "POST /a b"
        # An idle keep-alive connection is closed by the server after the timeout.
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(10):
            assert await idle.receive_some(100) == b""
        await idle.aclose()
        # On stop, the listener closes; a connection that never sent a request gets
        # the graceful time to send one, then ends.
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await trio.sleep(0.05)
        stop.set()
        with trio.fail_after(10):
            assert await idle.receive_some(100) == b""
        await idle.aclose()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


async def test_closing_the_listener_serves_what_was_accepted_and_refuses_new_connections() -> None:
    """The router's drain (router/app.py): `accept_until` closes the listener while the
    answers in progress go on until the stop. What the server had accepted is served:
    a connection that had not sent its request yet gets one answer, with `Connection:
    close`; one waiting between requests ends; `arriving` tells a drain to wait."""
    closing, stop = trio.Event(), trio.Event()
    request = b"GET /late HTTP/1.1\r\nHost: x\r\n\r\n"
    async with trio.open_nursery() as nursery:
        server = HttpServer(echo, graceful_timeout=1)
        port = await nursery.start(
            partial(server.serve, accept_until=closing.wait), ("127.0.0.1", 0), stop.wait
        )
        # One connection served a request and waits for the next; one sent nothing yet.
        kept = await trio.open_tcp_stream("127.0.0.1", port)
        await kept.send_all(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"GET /first" in await kept.receive_some(1000)
        fresh = await trio.open_tcp_stream("127.0.0.1", port)
        await trio.to_thread.run_sync(
            lambda: wait_until(lambda: len(server.connections) == 2, 5, "both accepted")
        )
        closing.set()
        await trio.to_thread.run_sync(
            lambda: wait_until(lambda: server.stopping, 5, "the listener closed")
        )
        with socket.socket() as s:  # refused, never answered
            assert s.connect_ex(("127.0.0.1", port)) != 0
        assert server.arriving(60)  # the fresh one has a request to come
        with trio.fail_after(5):
            assert await kept.receive_some(100) == b""  # ended between requests
        await fresh.send_all(request)
        answer = b""
        with trio.fail_after(5):
            while chunk := await fresh.receive_some(1000):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"GET /late ")
        assert b"connection: close" in answer.lower()
        with trio.fail_after(5):
            while server.arriving(60):  # noqa: ASYNC110 (the connection's own close)
                await trio.sleep(0.01)
        stop.set()
    await kept.aclose()
    await fresh.aclose()


@pytest.mark.parametrize("served", [True, False], ids=["watchdog", "connection-alone"])
async def test_keep_alive_ends_idle_and_half_sent_heads_never_a_request_in_progress(
    served: bool,
) -> None:
    """Under `serve` the watchdog holds the keep-alive timeout; a connection served
    alone arms a deadline per wait. Either way: a connection waiting for a request,
    or for the rest of a head, ends after the timeout (and not before), and a request
    that takes longer than the timeout to answer is not cut by it."""

    async def slow(scope: dict, receive: Receive, send: Send) -> None:
        await trio.sleep(1.0)  # longer than the keep-alive timeout
        await echo(scope, receive, send)

    timeout = 0.3
    server = HttpServer(slow, keep_alive_timeout=timeout, graceful_timeout=1)

    async def connect(nursery: trio.Nursery) -> trio.abc.Stream:
        if served:
            return await trio.open_tcp_stream("127.0.0.1", port)
        client, server_side = trio.testing.memory_stream_pair()
        nursery.start_soon(server.run_connection, server_side)
        return client

    async def ends_after(stream: trio.abc.Stream, began: float) -> float:
        with trio.fail_after(10):
            while await stream.receive_some(1000):
                pass
        return trio.current_time() - began

    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        port = 0
        if served:
            port = await nursery.start(server.serve, ("127.0.0.1", 0), stop.wait)
        # Timed from before the connection: a half-sent head does not restart the wait
        # for a request, which began when the server took the connection.
        began = trio.current_time()
        idle = await connect(nursery)
        assert timeout <= await ends_after(idle, began) < timeout + 2
        began = trio.current_time()
        half = await connect(nursery)
        await half.send_all(b"GET /a HTTP/1.1\r\nHost: t\r\n")
        assert timeout <= await ends_after(half, began) < timeout + 2
        busy = await connect(nursery)
        await busy.send_all(b"GET /b HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = b""
        with trio.fail_after(10):
            while not answer.endswith(b"GET /b "):
                answer += await busy.receive_some(1000)
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert server.watching is served
        stop.set()
        if not served:
            nursery.cancel_scope.cancel()


async def test_body_ready_says_whether_reading_the_body_could_wait() -> None:
    """BODY_READY is True only while the whole body sits unread in the server's buffer:
    not for a body still arriving, not once it is read, not while a 100 Continue is
    owed; with a request pipelined behind, each request's answer is its own body's."""
    seen: list[tuple[str, bool]] = []

    async def app(scope: dict, receive: Receive, send: Send) -> None:
        ready = scope["extensions"][BODY_READY]
        seen.append((scope["path"], ready()))
        await echo(scope, receive, send)
        seen.append((scope["path"] + " read", ready()))

    async def served(*parts: bytes) -> None:
        client, server_side = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(HttpServer(app).run_connection, server_side)
            for part in parts:
                await client.send_all(part)
                await trio.testing.wait_all_tasks_blocked()
            await client.send_eof()
            with trio.fail_after(10):
                while await client.receive_some(65536):
                    pass

    whole = b"POST /whole HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nbody"
    await served(whole)
    await served(b"POST /late HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nbo", b"dy")
    await served(
        b"POST /continue HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n",
        b"body",
    )
    await served(b"POST /first HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\nb" + whole)
    assert seen == [
        ("/whole", True),
        ("/whole read", False),
        ("/late", False),
        ("/late read", False),
        ("/continue", False),
        ("/continue read", False),
        ("/first", True),
        ("/first read", False),  # /whole's body, queued behind, is not this request's
        ("/whole", True),
        ("/whole read", False),
    ]


async def test_expect_100_continue_is_answered_before_the_body_is_read() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(HttpServer(echo).serve, ("127.0.0.1", 0), trio.sleep_forever)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(
            b"POST /e HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        )
        with trio.fail_after(10):
            interim = await stream.receive_some(1000)
        assert interim.startswith(b"HTTP/1.1 100 "), interim
        await stream.send_all(b"hi")
        with trio.fail_after(10):
            answer = await stream.receive_some(1000)
        assert answer.endswith(b"POST /e hi"), answer
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_fault_in_one_connection_leaves_the_server_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    faults = 0

    async def fails_once(self: object) -> bool:
        nonlocal faults
        faults += 1
        if faults == 1:
            raise RuntimeError("injected")
        return False

    monkeypatch.setattr(_Connection, "_ready_for_next", fails_once)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(HttpServer(echo).serve, ("127.0.0.1", 0), trio.sleep_forever)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(2):
                r = await client.post("/f", content=b"x", headers={"connection": "close"})
                assert r.text == "POST /f x"
        nursery.cancel_scope.cancel()
    assert faults == 2


def _lowest_free_fd() -> int:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd


class LogEvent(logging.Handler):
    """Sets `event` when a record containing `text` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


async def test_accept_retries_when_out_of_descriptors() -> None:
    """A real EMFILE: the soft descriptor limit is lowered to the lowest free number,
    so the kernel refuses the accepted socket until it is raised again."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    failed = LogEvent("http_accept_failed error=EMFILE")
    logging.getLogger("http").addHandler(failed)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(HttpServer(echo).serve, ("127.0.0.1", 0), trio.sleep_forever)
        client = trio.socket.socket()
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_fd(), hard))
            await client.connect(("127.0.0.1", port))
            with trio.fail_after(10):
                await failed.event.wait()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            logging.getLogger("http").removeHandler(failed)
        stream = trio.SocketStream(client)
        await stream.send_all(b"POST /m HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\nx")
        with trio.fail_after(10):
            answer = await stream.receive_some(1000)
        assert answer.endswith(b"POST /m x"), answer
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_out_of_descriptors_the_longest_idle_connection_makes_room() -> None:
    """Connections left open by the thousand must not lock every client out: at EMFILE
    the server closes its longest-idle ones, and the new client is served while the
    limit stays where it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    server = HttpServer(echo)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, ("127.0.0.1", 0), trio.sleep_forever)
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await trio.testing.wait_all_tasks_blocked()
        assert [c.state for c in server.connections] == [IDLE]
        client = trio.socket.socket()
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_fd(), hard))
            await client.connect(("127.0.0.1", port))
            stream = trio.SocketStream(client)
            await stream.send_all(b"POST /m HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\nx")
            with trio.fail_after(10):
                answer = await stream.receive_some(1000)
                with contextlib.suppress(trio.BrokenResourceError):  # closed or reset
                    assert await idle.receive_some(100) == b""  # closed to make room
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert answer.endswith(b"POST /m x"), answer
        await stream.aclose()
        await idle.aclose()
        nursery.cancel_scope.cancel()


async def test_an_accept_error_it_cannot_name_ends_the_server() -> None:
    # accept() on a listening socket shut down for reading fails with EINVAL on Linux:
    # retrying it would spin forever, so the error reaches the caller.
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    sock.listen()
    listener = trio.SocketListener(sock)
    sock.shutdown(socket.SHUT_RD)
    async with trio.open_nursery() as nursery:
        with pytest.raises(OSError) as raised, trio.fail_after(10):
            await HttpServer(echo)._accept(listener, nursery)
    assert raised.value.errno == errno.EINVAL
    await listener.aclose()


async def test_a_connection_shows_its_state_in_its_repr() -> None:
    seen: list[str] = []
    server = HttpServer(echo)

    async def shows(scope: dict, receive: Receive, send: Send) -> None:
        seen.append(repr(next(iter(server.connections))))
        await echo(scope, receive, send)

    server.app = shows
    client, server_side = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run_connection, server_side)
        for _ in range(2):
            await client.send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            await client.receive_some(65536)
        await trio.testing.wait_all_tasks_blocked()
        seen.append(repr(next(iter(server.connections))))
        await client.aclose()
    assert seen == [
        "<_Connection HTTP/1.1, ACTIVE, request READING, Request Count: 1, peer ->",
        "<_Connection HTTP/1.1, ACTIVE, request READING, Request Count: 2, peer ->",
        "<_Connection HTTP/1.1, IDLE, request DONE, Request Count: 2, peer ->",
    ]


# --- hostile input through real sockets -----------------------------------------------------


@contextlib.asynccontextmanager
async def serving(app: Callable, **options: float) -> AsyncIterator[tuple[HttpServer, int]]:
    """A running server on a loopback port, with the router's error protocols."""
    server = HttpServer(app, protocol_of=protocol_of, **options)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, ("127.0.0.1", 0), trio.sleep_forever)
        yield server, port
        nursery.cancel_scope.cancel()


async def exchange(port: int, data: bytes, piece: int = 0) -> bytes:
    """Send `data` (in pieces of `piece` bytes, one read each, when given), never
    half-close, and read until the server closes: what it answered."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    received = b""
    with trio.fail_after(20):
        if piece:
            for i in range(0, len(data), piece):
                await stream.send_all(data[i : i + piece])
                await trio.sleep(0.005)  # pacing, so the server reads each piece alone
        else:
            await stream.send_all(data)
        try:
            while chunk := await stream.receive_some(65536):
                received += chunk
        except trio.BrokenResourceError:  # a reset after the answer
            pass
    await stream.aclose()
    return received


def refusal(answer: bytes, status: int, code: str, protocol: str = "openai") -> dict:
    """The only answer on the connection: `status`, a close, and the error body."""
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1, answer
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"\r\nconnection: close" in head.lower(), head
    assert b"\r\ncontent-length: %d" % len(body) in head.lower(), answer
    payload = json.loads(body)
    if protocol == "anthropic":
        assert payload["type"] == "error", payload
    else:
        assert "type" not in payload, payload
    assert payload["error"]["code"] == code, payload
    return payload


BOTH = [(b"/v1/chat/completions", "openai"), (b"/v1/messages", "anthropic")]
SECOND = b"GET /second HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
CHUNKED = b"5\r\nhello\r\n0\r\n\r\n"


async def test_content_length_with_chunked_is_refused_and_the_connection_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Request smuggling (RFC 9112 §6.1): a proxy that frames by Content-Length sees
    one request; the server must never run the bytes after the chunks as a second."""
    caplog.set_level(logging.INFO, "http")
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" % (len(CHUNKED) + len(SECOND))
    )
    async with serving(echo) as (_, port):
        answer = await exchange(port, head + CHUNKED + SECOND)
    message = refusal(answer, 400, "request_invalid")["error"]["message"]
    assert "Content-Length" in message and "Transfer-Encoding" in message, message
    assert "http_refused status=400 code=request_invalid" in caplog.text, caplog.text
    assert "path=/v1/chat/completions" in caplog.text


RID = "0b4c5f1e-8d2a-4c3b-9e7f-123456789abc"


@pytest.mark.parametrize("given", [None, RID, "not-a-uuid"])
async def test_a_refusal_carries_a_request_id_and_logs_it(
    caplog: pytest.LogCaptureFixture, given: str | None
) -> None:
    """INTERFACE.md: the request ID is returned on the response and written as `req=`.
    A refusal of a head that could not be read gets a new one; one of a body keeps the
    client's when it is a valid UUID, as the app's answers do."""
    caplog.set_level(logging.INFO, "http")
    async with serving(echo) as (_, port):
        bad_head = await exchange(port, b"GET / HTTP/1.1\r\nHost: t\r\nBad Name: x\r\n\r\n")
        rid = b"X-Request-ID: %s\r\n" % given.encode() if given else b""
        bad_body = await exchange(
            port,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n%s"
            b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" % rid,
        )
    ids = []
    for answer in (bad_head, bad_body):
        head = answer.split(b"\r\n\r\n", 1)[0].decode().lower()
        assert head.startswith("http/1.1 400"), head
        ids.append(head.split("x-request-id: ", 1)[1].split("\r\n", 1)[0])
    for rid_seen in ids:
        assert is_request_id(rid_seen), ids
        assert f"req={rid_seen} http_refused status=400" in caplog.text, caplog.text
    assert (ids[1] == RID.lower()) is (given == RID)
    assert ids[0] != ids[1]


@pytest.mark.parametrize(
    ("coding", "path", "protocol"),
    [
        (b"Transfer-Encoding: gzip", b"/v1/chat/completions", "openai"),
        (b"Transfer-Encoding: gzip, chunked", b"/v1/messages", "anthropic"),
        (b"Transfer-Encoding: chunked, chunked", b"/v1/embeddings", "openai"),
        (b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked", b"/v1/messages", "anthropic"),
        (b"Transfer-Encoding: identity", b"/health", "openai"),
    ],
)
async def test_a_transfer_encoding_other_than_chunked_is_refused_and_closes(
    coding: bytes, path: bytes, protocol: str
) -> None:
    request = b"POST %s HTTP/1.1\r\nHost: t\r\n%s\r\n\r\n%s" % (path, coding, CHUNKED + SECOND)
    async with serving(echo) as (_, port):
        answer = await exchange(port, request)
    refusal(answer, 400, "request_invalid", protocol)


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\nhello\r\n0\r\n\r\n",  # not a hex size
        b"-1\r\nhello\r\n0\r\n\r\n",  # a negative size
        b"1" * 21 + b"\r\nhello\r\n0\r\n\r\n",  # 21 hex digits
        b"5\r\nhel\r\n0\r\n\r\n",  # a chunk shorter than its size
        b"5\r\nhello0\r\n\r\n",  # no CRLF after the chunk
    ],
    ids=["zz", "negative", "21-digits", "short-chunk", "missing-crlf"],
)
@pytest.mark.parametrize(
    ("path", "protocol"), [(b"/v1/chat/completions", "openai"), (b"/v1/messages", "anthropic")]
)
async def test_a_malformed_chunked_body_gets_400_and_a_close(
    body: bytes, path: bytes, protocol: str
) -> None:
    seen: list[str] = []

    async def reads(scope: dict, receive: Receive, send: Send) -> None:
        while (message := await receive()).get("more_body"):
            pass
        seen.append(message)
        # An app that answers anyway: the server has answered for it, this goes nowhere.
        await echo(scope, receive, send)

    request = b"POST %s HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" % path
    async with serving(reads) as (_, port):
        answer = await exchange(port, request + body + SECOND)
    refusal(answer, 400, "request_invalid", protocol)
    # Not a client that left: the app is told what the client got.
    assert seen == [{"type": "http.disconnect", "status": 400}]


async def test_the_router_logs_and_audits_a_refused_body_as_400(fleet: Fleet) -> None:
    audit = fleet.dir / "audit.jsonl"
    router = fleet.router("--audit-log", str(audit))
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
        b"x-request-id: 0b5e4c4e-7a43-4d5b-9d7e-2f8a9f1c1a11\r\n\r\nzz\r\n"
    )
    answer = await exchange(router.http_port, request)
    refusal(answer, 400, "request_invalid")
    line = router.wait_log(r"req=0b5e4c4e-7a43-4d5b-9d7e-2f8a9f1c1a11 method=POST [^\n]*")
    assert " status=400 " in line.group(0), line.group(0)
    record = wait_until(lambda: audit.exists() and json.loads(audit.read_text().splitlines()[-1]))
    assert (record["status"], record["code"]) == (400, "request_invalid")


def head_of(size: int) -> bytes:
    """A request head of exactly `size` bytes (request line to the blank line)."""
    start = b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Pad: "
    pad = size - len(start) - len(b"\r\n\r\n")
    return start + b"p" * pad + b"\r\n\r\n"


@pytest.mark.parametrize("piece", [0, 1000], ids=["one-write", "dribbled"])
async def test_the_head_limit_holds_however_the_head_arrives(piece: int) -> None:
    async with serving(echo) as (_, port):
        under = await exchange(port, head_of(MAX_HEAD_BYTES - 100) + SECOND, piece)
        over = await exchange(port, head_of(MAX_HEAD_BYTES + 100) + SECOND, piece)
        far_over = await exchange(port, head_of(39 * 1024), piece)
    assert under.count(b"HTTP/1.1 200 ") == 2, under[:300]
    refusal(over, 431, "request_invalid")
    refusal(far_over, 431, "request_invalid")


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (200, [(b"x-evil", b"a\r\nset-cookie: b")]),
        (200, [(b"x-evil", b"a\nb")]),
        (200, [(b"x-evil", b"a\x00b")]),
        (200, [(b"bad name", b"v")]),
        (200, [(b"", b"v")]),
        (200, [(b"x-evil", b"a\r\nb"), (b"content-length", b"2")]),
        (101, []),
        (100, []),
        (199, []),
        (600, []),
        (999, []),
    ],
)
@pytest.mark.parametrize(
    ("path", "protocol"), [(b"/v1/chat/completions", "openai"), (b"/v1/messages", "anthropic")]
)
async def test_a_response_head_that_cannot_be_sent_is_a_502_and_send_raises(
    status: int, headers: list, path: bytes, protocol: str
) -> None:
    raised: list[BaseException] = []

    async def bad_head(scope: dict, receive: Receive, send: Send) -> None:
        await receive()
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
        except Exception as exc:
            raised.append(exc)
            return
        await send({"type": "http.response.body", "body": b"ok"})

    async with serving(bad_head) as (_, port):
        answer = await exchange(port, b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n%s" % (path, SECOND))
    refusal(answer, 502, "backend_error", protocol)
    assert len(raised) == 1 and isinstance(raised[0], UnsendableHead), raised


# --- clients that stop reading ---------------------------------------------------------------


async def test_a_client_that_never_reads_is_closed_after_the_write_timeout() -> None:
    """The keep-alive deadline does not apply while the server writes; the write
    timeout does. The app, which streams without end, learns it as the client leaving
    (so the router's client API frees the agent's slot as for any client that left)."""
    seen: list[str] = []
    ended = trio.Event()

    async def streams_forever(scope: dict, receive: Receive, send: Send) -> None:
        try:
            await receive()
            async with trio.open_nursery() as nursery:

                async def watch() -> None:  # as router/http/client.py `_watch` does
                    seen.append((await receive())["type"])
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                await send({"type": "http.response.start", "status": 200, "headers": []})
                while True:
                    await send(
                        {"type": "http.response.body", "body": b"x" * 65536, "more_body": True}
                    )
        finally:
            ended.set()

    async with serving(streams_forever, write_timeout=0.5) as (server, port):
        stuck = trio.socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await stuck.connect(("127.0.0.1", port))
        await stuck.send(b"GET /v1/chat/completions HTTP/1.1\r\nHost: t\r\n\r\n")
        with trio.fail_after(30):
            await ended.wait()
        assert seen == ["http.disconnect"]
        await trio.testing.wait_all_tasks_blocked()
        assert not server.connections
        # The socket was closed under the blocked write: the client reads to its end.
        with trio.fail_after(30):
            try:
                while await stuck.recv(1 << 20):
                    pass
            except ConnectionResetError:
                pass
        stuck.close()


async def through_a_small_window(
    port: int, request: bytes, piece: int = 8192, pause: float = 0.0
) -> bytes:
    """Send `request` from a client with a 4 KB receive buffer, then read `piece` bytes
    at a time (`pause` seconds apart) until the server closes: what it answered."""
    client = trio.socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    received = b""
    try:
        await client.connect(("127.0.0.1", port))
        view = memoryview(request)
        while view:
            view = view[await client.send(view) :]
        with trio.fail_after(60):
            while data := await client.recv(piece):
                received += data
                await trio.sleep(pause)
    finally:
        client.close()
    return received


LARGE_AND_SMALL = [b"%d:" % i + (b"z" * 150_000 if i % 10 == 3 else b"e" * 40) for i in range(60)]


async def arrives_whole(app: Callable, parts: list[bytes]) -> None:
    """`app`'s streamed answer reaches a client with a small receive buffer as
    `parts`, whole and in order."""
    async with serving(app) as (_, port):
        received = await through_a_small_window(
            port, b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        )
    body = received.split(b"\r\n\r\n", 1)[1]
    assert body == b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def test_a_stream_over_tcp_arrives_whole_and_in_order_past_a_full_socket() -> None:
    """Over a real socket each part is written straight to the stdlib socket; what the
    kernel cannot take at once (a reader with a small buffer) goes on through
    trio, after what went before and before what follows."""
    parts = LARGE_AND_SMALL

    async def stream(scope: dict, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    await arrives_whole(stream, parts)


async def test_parts_from_the_part_writer_arrive_whole_and_in_order_past_a_full_socket() -> None:
    """ANSWER_SCOPE's part writer (what the link's reader writes a stream's parts
    with): what the kernel does not take at once waits for the app's next write, which
    goes before what that write brings, and the stream arrives whole and in order."""
    parts = LARGE_AND_SMALL
    kept: list[int] = []

    async def stream(scope: dict, receive: Receive, send: Send) -> None:
        await receive()
        connection = scope["extensions"][ANSWER_SCOPE]
        assert connection.part_writer() is None  # no head out yet
        await send({"type": "http.response.start", "status": 200, "headers": []})
        write_part = connection.part_writer()
        for i, part in enumerate(parts):
            if i % 3 == 0:  # the app's own write
                await send({"type": "http.response.body", "body": part, "more_body": True})
            elif not write_part(part):
                kept.append(i)
                await send({"type": "http.response.body", "body": b"", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        assert write_part(b"late") is True  # the answer is over: dropped

    await arrives_whole(stream, parts)
    assert kept  # the kernel's room ran out under the writer too


@pytest.mark.parametrize("hold", [False, True], ids=["head-at-once", "head-held"])
async def test_a_streamed_head_waits_for_the_first_part_only_when_held(hold: bool) -> None:
    """HOLD_HEAD: the head and the first part leave in one write; without it the head
    goes at once (an event stream that waits for its first event, as the registration
    stream does, must still answer)."""

    async def stream(scope: dict, receive: Receive, send: Send) -> None:
        await receive()
        start = {"type": "http.response.start", "status": 200, "headers": []}
        await send({**start, HOLD_HEAD: True} if hold else start)
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    request = b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    writes, received = await writes_of(stream, request)
    head = received.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
    first = b"5\r\nfirst\r\n"
    assert writes == ([head + first] if hold else [head, first]) + [b"0\r\n\r\n"], writes
    assert received == head + first + b"0\r\n\r\n"


async def test_a_held_head_goes_with_the_part_writer_s_first_part() -> None:
    """The part writer is offered while the head is held, and its first part carries
    the head (the link's reader writes a stream's first event with it)."""
    parts = [b"one", b"two"]

    async def stream(scope: dict, receive: Receive, send: Send) -> None:
        await receive()
        connection = scope["extensions"][ANSWER_SCOPE]
        await send({"type": "http.response.start", "status": 200, "headers": [], HOLD_HEAD: True})
        write_part = connection.part_writer()
        assert write_part is not None
        assert connection.head is not None
        for part in parts:
            assert write_part(part) is True
            assert connection.head is None
        await send({"type": "http.response.body", "body": b""})

    async with serving(stream) as (_, port):
        received = await exchange(port, b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 200 "), received
    body = received.split(b"\r\n\r\n", 1)[1]
    assert body == b"3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n"


@pytest.mark.parametrize("kind", ["content-length", "http/1.0", "head", "memory stream"])
async def test_a_part_writer_is_offered_for_a_chunked_stream_over_tcp_only(kind: str) -> None:
    offered: list[bool] = []

    async def stream(scope: dict, receive: Receive, send: Send) -> None:
        await receive()
        headers = [(b"content-length", b"2")] if kind == "content-length" else []
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        offered.append(scope["extensions"][ANSWER_SCOPE].part_writer() is not None)
        await send({"type": "http.response.body", "body": b"ok"})

    version = b"1.0" if kind == "http/1.0" else b"1.1"
    method = b"HEAD" if kind == "head" else b"GET"
    request = b"%s / HTTP/%s\r\nHost: t\r\nConnection: close\r\n\r\n" % (method, version)
    if kind == "memory stream":
        await writes_of(stream, request)
    else:
        async with serving(stream) as (_, port):
            await exchange(port, request)
    assert offered == [False]


@pytest.mark.parametrize("told_by", ["write", "watch"])
async def test_a_part_for_a_client_that_left_is_dropped_and_the_app_told(told_by: str) -> None:
    """A reset client: the part writer's own failed send closes the connection
    (`write`: no callback yet for the server's watch to call), or the server's watch
    told the app first (`watch`); every later part is dropped, and the app is told."""
    told: list[str] = []
    results: list[bool] = []
    gone, closed = trio.Event(), trio.Event()

    async def stream(scope: dict, receive: Receive, send: Send) -> None:
        await receive()
        extensions = scope["extensions"]
        connection = extensions[ANSWER_SCOPE]
        if told_by == "watch":
            extensions[ON_DISCONNECT](lambda: told.append("left"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        write_part = connection.part_writer()
        await gone.wait()
        with trio.fail_after(5):
            while connection.state.name != "CLOSED":
                results.append(write_part(b"x" * 65536))
                await trio.sleep(0.01)
        extensions[ON_DISCONNECT](lambda: told.append("told at once"))
        results.append(write_part(b"after"))
        closed.set()

    async with serving(stream) as (_, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await client.receive_some(100)
        client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await client.aclose()  # a reset
        gone.set()
        with trio.fail_after(10):
            await closed.wait()
    assert all(results) and results
    assert told == (["left", "told at once"] if told_by == "watch" else ["told at once"])


async def test_a_large_answer_leaves_in_pieces_the_write_timeout_counts_on() -> None:
    body = b"y" * (WRITE_PIECE_BYTES * 2 + 1000)

    async def large(scope: dict, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    writes, received = await writes_of(
        large, b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    assert [len(w) for w in writes[:2]] == [WRITE_PIECE_BYTES] * 2
    assert len(writes) == 3 and received.endswith(body)


def test_the_write_timeout_is_a_router_flag_and_an_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HIVENET_ROUTER_ADMIN_API_KEYS", "k")
    monkeypatch.setenv("HIVENET_ROUTER_JWT_SECRET", "s" * 32)
    assert settings_from(build_parser().parse_args(["serve"])).http_write_timeout == 30
    monkeypatch.setenv("HIVENET_ROUTER_HTTP_WRITE_TIMEOUT", "1500ms")
    assert settings_from(build_parser().parse_args(["serve"])).http_write_timeout == 1.5
    args = build_parser().parse_args(["serve", "--http-write-timeout", "2m"])
    assert settings_from(args).http_write_timeout == 120
    with pytest.raises(ValueError, match="--http-write-timeout must be positive"):
        settings_from(build_parser().parse_args(["serve", "--http-write-timeout", "0s"]))


def long_stream(words: int, tokens: int, extra: bytes = b"") -> tuple[dict, bytes]:
    """A chat completion streaming `tokens` tokens of some 4 KB each from m1, and its
    HTTP request (`extra` header lines added)."""
    payload = {
        "model": "m1",
        "messages": [
            {"role": "user", "content": " ".join(f"{i}{'x' * 4000}" for i in range(words))}
        ],
        "stream": True,
        "max_tokens": tokens,
        "ignore_eos": True,
    }
    body = json.dumps(payload).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n%s" % extra
    length = b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    return payload, head + length + body


async def test_the_router_frees_the_slot_of_a_client_that_never_reads(fleet: Fleet) -> None:
    """End to end: with a request deadline far away, only the write timeout can end a
    stream whose client reads nothing; the agent's slot (held until the stream ends)
    comes back and the engine call is cancelled."""
    router = fleet.router(
        "--http-write-timeout", "1s", "--request-timeout", "600s", "--stream-slot-release", "end"
    )
    agent = fleet.agent(router, "m1", "--sim-token-latency", "2ms")
    # About 12 MB of answer, far more than the socket buffers hold.
    _, request = long_stream(10, 3000)

    def active() -> int:
        row = router.agent(agent.peer_id)
        return -1 if row is None else row["status"]["active_requests"]

    stuck = trio.socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        await stuck.connect(("127.0.0.1", router.http_port))
        view = memoryview(request)
        while view:
            view = view[await stuck.send(view) :]
        await trio.to_thread.run_sync(lambda: wait_until(lambda: active() == 1, 15, "slot held"))
        await trio.to_thread.run_sync(lambda: wait_until(lambda: active() == 0, 30, "slot freed"))
        await trio.to_thread.run_sync(
            lambda: wait_until(lambda: agent.sim_state()["in_flight"] == 0, 15, "engine idle")
        )
    finally:
        stuck.close()
    log = router.log()
    assert "http_write_timeout" in log and "client_disconnected" in log, log[-3000:]


async def test_a_client_that_reads_slowly_gets_the_whole_stream_through_the_router(
    fleet: Fleet,
) -> None:
    """End to end: the link's reader writes a stream's parts while its relay waits,
    the relay what the client's full socket could not take, in order; a client with a
    small receive buffer reading in small bites gets every event of some 1.2 MB."""
    router = fleet.router()
    agent = fleet.agent(router, "m1", "--sim-token-latency", "0ms")
    payload, request = long_stream(20, 300, b"connection: close\r\n")
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as fast:
        wanted = (await fast.post("/v1/chat/completions", json=payload)).content
    received = await through_a_small_window(router.http_port, request, 2048, 0.0005)
    head, chunked = received.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    events = b""
    while True:
        size_line, chunked = chunked.split(b"\r\n", 1)
        size = int(size_line, 16)
        events, chunked = events + chunked[:size], chunked[size + 2 :]
        if size == 0:
            break
    assert len(wanted) > 1_000_000
    # The same events as the fast client's, but for their ids and times.
    ids = re.compile(rb'"(id|created)":("[^"]*"|\d+)')
    assert ids.sub(b"", events) == ids.sub(b"", wanted)
    await trio.to_thread.run_sync(
        lambda: wait_until(
            lambda: router.agent(agent.peer_id)["status"]["active_requests"] == 0, 15, "slot"
        )
    )


# --- what llhttp does differently from h11, held to h11's behaviour -------------------------


async def headers_of(scope: dict, receive: Receive, send: Send) -> None:
    while (await receive()).get("more_body"):
        pass
    answer = json.dumps([[k.decode(), v.decode()] for k, v in scope["headers"]]).encode()
    headers = [(b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


async def streams_two(scope: dict, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"one", "more_body": True})
    await send({"type": "http.response.body", "body": b"two"})


async def test_an_http11_request_without_host_is_refused() -> None:
    async with serving(echo) as (_, port):
        answer = await exchange(port, b"GET /v1/models HTTP/1.1\r\n\r\n" + SECOND)
    assert "Host" in refusal(answer, 400, "request_invalid")["error"]["message"]


async def test_an_upgrade_with_a_body_is_refused_not_served_empty() -> None:
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nContent-Length: 2\r\n\r\n{}"
    )
    async with serving(echo) as (_, port):
        answer = await exchange(port, request)
    assert "Upgrade" in refusal(answer, 400, "request_invalid")["error"]["message"]


async def test_two_host_headers_are_refused() -> None:
    async with serving(echo) as (_, port):
        answer = await exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
    assert "Host" in refusal(answer, 400, "request_invalid")["error"]["message"]


async def test_an_http_version_other_than_1_0_and_1_1_is_505() -> None:
    async with serving(echo) as (_, port):
        answer = await exchange(port, b"GET /v1/models HTTP/2.0\r\nHost: t\r\n\r\n")
    assert "HTTP/1.1" in refusal(answer, 505, "request_invalid")["error"]["message"]


@pytest.mark.parametrize(
    ("target", "path"),
    [
        (b"http://router.example/v1/models?x=1", "/v1/models"),
        (b"HTTPS://router.example:8080/m", "/m"),
        (b"http://router.example", "/"),
        (b"http://router.example?x=1", "/"),
        (b"http://", "/"),
        (b"hTtP://a/b?c=/d", "/b"),
    ],
)
async def test_an_absolute_form_target_is_served_by_its_path(target: bytes, path: str) -> None:
    async def path_of(scope: dict, receive: Receive, send: Send) -> None:
        body = scope["path"].encode()
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    _, received = await writes_of(path_of, b"GET " + target + b" HTTP/1.1\r\nHost: t\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 200 ") and received.endswith(path.encode()), received


async def test_header_names_arrive_lowercased_and_values_without_surrounding_spaces() -> None:
    request = b"GET / HTTP/1.1\r\nHost: t\r\nX-Spaces:   padded   \r\nX-Tight:v\r\n\r\n"
    _, received = await writes_of(headers_of, request)
    headers = json.loads(received.partition(b"\r\n\r\n")[2])
    assert headers == [["host", "t"], ["x-spaces", "padded"], ["x-tight", "v"]]


async def test_trailer_fields_are_no_request_headers() -> None:
    """Fields after a chunked body would reach the engine as headers a proxy in front
    never saw (one that strips X-Forwarded-For, say)."""
    request = (
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\nX-Forwarded-For: 6.6.6.6\r\nX-Injected: yes\r\n\r\n"
    )
    _, received = await writes_of(headers_of, request)
    assert received.startswith(b"HTTP/1.1 200 "), received
    headers = json.loads(received.partition(b"\r\n\r\n")[2])
    assert headers == [["host", "t"], ["transfer-encoding", "chunked"]]


async def test_a_head_of_headers_without_spaces_is_measured_as_sent() -> None:
    """`name:value` lines are a byte shorter than `name: value`: 16 KiB of them pass."""
    start = b"GET /v1/models HTTP/1.1\r\nHost: t\r\n"
    line = b"x-h:v\r\n"
    count = (MAX_HEAD_BYTES - len(start) - 2) // len(line)
    head = start + line * count + b"\r\n"
    assert MAX_HEAD_BYTES - len(line) < len(head) <= MAX_HEAD_BYTES
    async with serving(echo) as (_, port):
        assert (await exchange(port, head + SECOND)).count(b"HTTP/1.1 200 ") == 2


@pytest.mark.parametrize("piece", [0, 1000], ids=["one-write", "dribbled"])
async def test_whitespace_around_a_value_counts_toward_the_head_limit(piece: int) -> None:
    """llhttp skips the whitespace before a value without a word to the reader: a head
    padded with it is counted as it came all the same."""
    start = b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Pad:"
    before = start + b" " * 120_000 + b"a\r\n\r\n"
    after = start + b" a" + b" " * 20_000 + b"\r\n\r\n"
    at_limit = start + b" " * (MAX_HEAD_BYTES - len(start) - 5) + b"a\r\n\r\n"
    async with serving(echo) as (_, port):
        refusal(await exchange(port, before, piece), 431, "request_invalid")
        refusal(await exchange(port, after, piece), 431, "request_invalid")
        assert (await exchange(port, at_limit + SECOND, piece)).count(b"HTTP/1.1 200 ") == 2


async def test_an_http10_client_gets_its_stream_up_to_the_close_and_no_keep_alive() -> None:
    # HTTP/1.0 has no chunks; as h11, its keep-alive is not kept (the server closes).
    request = b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" + SECOND
    _, received = await writes_of(streams_two, request)
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
    assert body == b"onetwo" and received.count(b"HTTP/1.1 200") == 1


async def test_a_head_request_gets_the_head_only() -> None:
    request = b"HEAD /h HTTP/1.1\r\nHost: t\r\n\r\n" + SECOND
    _, received = await writes_of(echo, request)
    first, _, rest = received.partition(b"\r\n\r\n")
    assert b"content-length: 8" in first.lower(), first  # "HEAD /h "
    assert rest.startswith(b"HTTP/1.1 200 "), rest  # the next answer follows the head at once


async def test_a_request_asking_for_an_upgrade_is_served_as_http_and_ends_the_connection() -> None:
    request = (
        b"GET /u HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        + b"\x81\x05hello"  # a WebSocket frame: not HTTP
    )
    _, received = await writes_of(echo, request)
    assert received.startswith(b"HTTP/1.1 200 ") and received.endswith(b"GET /u "), received
    assert received.count(b"HTTP/1.1 ") == 1 and b"connection: close" in received.lower()


async def test_a_malformed_request_behind_a_good_one_is_refused_after_its_answer() -> None:
    # llhttp parses the whole read at once; the refusal waits its turn in the queue.
    good = b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\nx"
    _, received = await writes_of(echo, good + b"NOT HTTP AT ALL\r\n\r\n" + SECOND)
    first, _, rest = received.partition(b"POST /a x")
    assert first.startswith(b"HTTP/1.1 200 "), received
    refusal(rest, 400, "request_invalid")


@pytest.mark.parametrize("body", [b"abc", b"a"], ids=["too-much", "too-little"])
async def test_a_body_that_breaks_its_content_length_is_a_502_and_send_raises(body: bytes) -> None:
    raised: list[BaseException] = []

    async def wrong_length(scope: dict, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            await send({"type": "http.response.body", "body": body})
        except UnsendableHead as exc:
            raised.append(exc)

    _, received = await writes_of(wrong_length, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n" + SECOND)
    refusal(received, 502, "backend_error")
    assert len(raised) == 1, raised


@pytest.mark.parametrize("leaving", ["close", "reset"])
async def test_a_client_leaving_mid_request_is_told_to_the_apps_callback(leaving: str) -> None:
    """hivenet.on_disconnect: the server tells the app, with no task of the app's in
    receive(), that the client closed or reset its connection while it answered."""
    told: list[str] = []
    registered, ended = trio.Event(), trio.Event()

    async def registers(scope: dict, receive: Receive, send: Send) -> None:
        await receive()  # the (empty) body
        with trio.CancelScope() as answering:
            scope["extensions"][ON_DISCONNECT](lambda: (told.append("left"), answering.cancel()))
            registered.set()
            await trio.sleep_forever()
        ended.set()

    async with serving(registers) as (server, port):
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
        with trio.fail_after(10):
            await registered.wait()
        if leaving == "reset":  # SO_LINGER 0: the close sends a reset, not a FIN
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        with trio.fail_after(10):
            await ended.wait()
        assert told == ["left"]
        await trio.testing.wait_all_tasks_blocked()
        assert not server.connections


async def test_a_client_gone_before_the_app_asks_is_told_at_once() -> None:
    """A client that sent its request and closed its side at once: the app hears of it
    as soon as it registers, as a receive() after the body would have."""
    told: list[str] = []
    done = trio.Event()

    async def registers_late(scope: dict, receive: Receive, send: Send) -> None:
        await receive()
        await trio.sleep(0.3)  # the FIN arrives and is seen before the app asks
        scope["extensions"][ON_DISCONNECT](lambda: told.append("left"))
        done.set()

    async with serving(registers_late) as (_, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
        await stream.send_eof()
        with trio.fail_after(10):
            await done.wait()
        await stream.aclose()
    assert told == ["left"]


async def test_a_pipelined_request_is_not_taken_for_the_client_leaving() -> None:
    """The epoll set watches for the peer's close only: bytes of the next request
    arriving while the first is answered wake nothing, and both are answered."""
    told: list[str] = []
    second_sent = trio.Event()

    async def registers(scope: dict, receive: Receive, send: Send) -> None:
        await receive()
        scope["extensions"][ON_DISCONNECT](lambda: told.append("left"))
        if scope["path"] == "/1":
            with trio.fail_after(10):
                await second_sent.wait()
            await trio.sleep(0.2)  # time for a wrongly woken watcher to run
        body = scope["path"].encode()
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async with serving(registers) as (_, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /1 HTTP/1.1\r\nHost: t\r\n\r\n")
        await trio.sleep(0.1)
        await stream.send_all(b"GET /2 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        second_sent.set()
        received = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                received += chunk
        await stream.aclose()
    assert received.count(b"HTTP/1.1 200") == 2
    assert received.endswith(b"/2"), received
    assert told == []


async def test_the_extension_is_offered_on_tcp_only() -> None:
    """Over a stream with no socket (run_connection on memory streams) the server
    cannot watch: the app finds no extension and waits in receive() instead."""
    seen: list[bool] = []

    async def looks(scope: dict, receive: Receive, send: Send) -> None:
        seen.append(ON_DISCONNECT in scope.get("extensions", {}))
        await echo(scope, receive, send)

    await writes_of(looks, b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    async with (
        serving(looks) as (_, port),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        assert (await client.get("/")).status_code == 200
    assert seen == [False, True]


@pytest.mark.parametrize("served", [True, False], ids=["watchdog", "connection-alone"])
async def test_an_answer_in_the_connection_s_scope_ends_at_its_deadline_and_closes_it(
    served: bool,
) -> None:
    """hivenet.answer_scope: an app's answer runs in the connection's own cancel scope.
    Its deadline (`limit`) ends it, through the watchdog while the server serves, or a
    deadline of the scope's own on a connection served alone; the app's shielded
    answer after it says `connection: close`, and the connection closes. An answer
    over in time (`lift`) leaves the next request on the connection untouched."""
    ended: list[str] = []

    async def answers(scope: dict, receive: Receive, send: Send) -> None:
        await receive()
        connection = scope["extensions"][ANSWER_SCOPE]
        wait = float(scope["path"].strip("/"))
        connection.limit(trio.current_time() + 0.5)
        try:
            await trio.sleep(wait)
        except trio.Cancelled:
            ended.append(scope["path"])
            with trio.CancelScope(shield=True):
                await send({"type": "http.response.start", "status": 504, "headers": []})
                await send({"type": "http.response.body", "body": b"late"})
            return
        finally:
            connection.lift()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"in time"})

    requests = b"".join(
        b"GET /%s HTTP/1.1\r\nHost: t\r\n\r\n" % wait for wait in (b"0.01", b"0.7", b"3")
    )
    if served:
        async with serving(answers, answer_timeout=0.5) as (_, port):
            started = trio.current_time()
            received = await exchange(port, requests)
    else:
        started = trio.current_time()
        _, received = await writes_of(answers, requests)
    elapsed = trio.current_time() - started
    # The first answered in time; the second's deadline came 0.5 s after it began (at
    # most a quarter of answer_timeout late); the third was never read.
    assert received.count(b"HTTP/1.1 ") == 2, received
    first, second = received.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200") and b"connection: close" not in first.lower()
    assert second.startswith(b"504") and b"connection: close\r\n" in second.lower()
    assert ended == ["/0.7"]
    assert 0.5 <= elapsed < 0.5 + 0.125 + 0.4, elapsed


async def test_an_answer_ended_by_the_app_closes_its_connection_after_it() -> None:
    """`end()` (the router calls it when its client leaves) cancels the answer at once;
    the connection serves nothing more."""
    calls: list[str] = []

    async def ends(scope: dict, receive: Receive, send: Send) -> None:
        await receive()
        connection = scope["extensions"][ANSWER_SCOPE]
        calls.append(scope["path"])
        try:
            connection.end()
            await trio.sleep(5)
        except trio.Cancelled:
            calls.append("cancelled")
            raise
        finally:
            connection.lift()

    async with serving(ends) as (_, port):
        received = await exchange(
            port, b"GET /1 HTTP/1.1\r\nHost: t\r\n\r\nGET /2 HTTP/1.1\r\nHost: t\r\n\r\n"
        )
    assert calls == ["/1", "cancelled"]
    assert received == b""


async def test_the_router_s_whole_answer_enters_no_cancel_scope_in_its_connection_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the real server on TCP, the router's answer runs in the connection's
    own scope (ANSWER_SCOPE): a scope entered and left per request cost a tenth of the
    router's CPU per whole answer at 64 clients."""
    from tests.test_fuzz import ScriptedAgent, build_app

    app, link, table, _ = build_app()
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]})
    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    entered: list[str] = []
    enter = trio.CancelScope.__enter__

    def counted(scope: trio.CancelScope) -> trio.CancelScope:
        if "run_connection" in trio.lowlevel.current_task().name:
            entered.append("scope")
        return enter(scope)

    async with serving(app) as (_, port), trio.open_nursery() as nursery:
        ScriptedAgent(link, nursery, [[("head", 200, {}), ("chunk", b"{}"), ("end",)]])
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        for counting in (False, True):
            if counting:
                monkeypatch.setattr(trio.CancelScope, "__enter__", counted)
            await stream.send_all(request)
            answer = b""
            with trio.fail_after(10):
                while not answer.endswith(b"{}"):
                    answer += await stream.receive_some(65536)
            monkeypatch.undo()
            assert answer.startswith(b"HTTP/1.1 200 "), answer
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert entered == []
    assert all(p.active == 0 for p in table.all())
