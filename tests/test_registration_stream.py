"""`GET /admin/registration-stream`: agents joining and leaving a live router, and a
follower that stops reading, which must cost only itself."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import trio
import trio.lowlevel
import trio.testing

from router.http.asgi import Receive, Scope, Send
from router.http.registration_stream import registration_stream
from router.http.server import HttpServer
from router.registrations import KEEPALIVE_SECONDS, Registration, RegistrationFeed
from tests.fleet import ADMIN_KEY, Fleet

AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _events(lines: Iterator[str]) -> Iterator[dict]:
    for line in lines:
        if line.startswith("data: "):
            yield json.loads(line[len("data: ") :])


def test_agents_joining_and_leaving_are_announced(fleet: Fleet) -> None:
    router = fleet.router()
    url = router.url + "/admin/registration-stream"
    with httpx.stream("GET", url, headers=AUTH, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        events = _events(response.iter_lines())
        agent = fleet.agent(
            router, "m1", "--deployment-id", "deploy-42", "--replica-id", "replica-3"
        )
        joined = next(events)
        assert joined["event_type"] == "registered"
        assert joined["agent_id"] == agent.peer_id
        assert joined["model"] == "m1"
        assert (joined["deployment_id"], joined["replica_id"]) == ("deploy-42", "replica-3")
        assert joined["timestamp"].endswith("Z")
        agent.stop()
        left = next(events)
        assert left["event_type"] == "unregistered"
        assert (left["agent_id"], left["replica_id"]) == (agent.peer_id, "replica-3")


def test_the_stream_needs_the_admin_key_and_a_get(fleet: Fleet) -> None:
    router = fleet.router()
    url = router.url + "/admin/registration-stream"
    assert httpx.get(url, timeout=10).status_code == 401
    refused = httpx.post(url, headers=AUTH, timeout=10)
    assert refused.status_code == 405
    assert refused.headers["allow"] == "GET"


# --- a follower that stops reading ----------------------------------------------------------

BUFFER = 8


def _event(n: int) -> Registration:
    at = "2026-01-01T00:00:00Z"
    return Registration("registered", f"12D3KooW{n:08d}", "m1", "d", f"r{n}", at)


async def _open(port: int, rcvbuf: int | None = None) -> trio.SocketStream:
    sock = trio.socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    await stream.send_all(b"GET /admin/registration-stream HTTP/1.1\r\nhost: x\r\n\r\n")
    # The head goes out once the follower is subscribed.
    await _read_until(stream, b"\r\n\r\n", bytearray())
    return stream


async def _read_until(stream: trio.SocketStream, marker: bytes, into: bytearray) -> None:
    while marker not in into:
        chunk = await stream.receive_some(65536)
        assert chunk, "the stream ended early"
        into += chunk


async def test_a_follower_that_stops_reading_is_dropped_and_told_so() -> None:
    feed = RegistrationFeed(buffer=BUFFER)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await registration_stream(feed, receive, send, [])

    server = HttpServer(app, keep_alive_timeout=5)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, ("127.0.0.1", 0), trio.sleep_forever)
        stalled = await _open(port, rcvbuf=4096)
        following = await _open(port)
        fast = bytearray()
        published = 0
        # The stalled follower's socket buffers fill, then its BUFFER events: it is
        # dropped while the one that reads keeps getting every event.
        while feed.subscribers == 2:
            published += 1
            feed.publish(_event(published))
            await trio.lowlevel.checkpoint()
            with trio.move_on_after(0):
                fast += await following.receive_some(65536)
            assert published < 1_000_000, "the stalled follower was never dropped"
        assert feed.subscribers == 1
        feed.publish(_event(published + 1))
        await _read_until(following, f'r{published + 1}"'.encode(), fast)
        got = [json.loads(line[6:]) for line in fast.split(b"\n") if line.startswith(b"data: ")]
        assert [e["replica_id"] for e in got] == [f"r{n}" for n in range(1, published + 2)]

        slow = bytearray()
        await _read_until(stalled, b"\r\n0\r\n\r\n", slow)
        lines = [line for line in slow.split(b"\n") if line.startswith(b"data: ")]
        last = json.loads(lines[-1][6:])
        assert last["event_type"] == "subscriber_dropped"
        assert len(lines) - 1 < published  # it missed events: it was not waited for
        nursery.cancel_scope.cancel()


async def test_the_number_of_followers_is_bounded() -> None:
    feed = RegistrationFeed(limit=1)
    feed.subscribe()
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    assert await registration_stream(feed, receive, send, []) == 503
    assert sent[0]["status"] == 503


async def test_an_event_written_as_the_keepalive_falls_due_is_sent_whole(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A follower slow to take a write (5 s, under WRITE_TIMEOUT) as the keepalive's 25 s
    run out still gets the event, and no keepalive inside it."""
    feed = RegistrationFeed()
    bodies: list[bytes] = []
    gone = trio.Event()

    async def send(message: dict) -> None:
        body = message.get("body", b"")
        if body.startswith(b"data: "):
            await trio.sleep(5)  # a client that reads slowly
        bodies.append(body)

    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    async with trio.open_nursery() as nursery:
        nursery.start_soon(registration_stream, feed, receive, send, [])
        await trio.sleep(KEEPALIVE_SECONDS - 1)
        feed.publish(_event(1))
        await trio.sleep(KEEPALIVE_SECONDS + 10)
        gone.set()
    events = [b for b in bodies if b.startswith(b"data: ")]
    assert events == [_event(1).sse()]
    assert bodies[-1] == b": keepalive\n\n"
