"""The HTTP port a `--workers` host shares (router/fleet/shared_port.py), against the
kernel: where new connections go, and what a worker's close leaves queued."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from functools import partial

import pytest
import trio

from router.fleet.shared_port import KERNEL_HASH, bind_shared, steer, steering_program
from router.fleet.workers import MAX_WORKERS
from router.http.server import HttpServer
from tests.test_http_server import echo


@pytest.fixture
def listeners() -> Iterator[list[socket.socket]]:
    socks = bind_shared(("127.0.0.1", 0), 3)
    for sock in socks:
        sock.setblocking(False)
    yield socks
    for sock in socks:
        sock.close()


def _spread(listeners: list[socket.socket], connections: int = 40) -> list[int]:
    """Open `connections` connections; how many each listener's queue got."""
    port = listeners[0].getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    counts = [0] * len(listeners)
    try:
        for i, sock in enumerate(listeners):
            while True:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                conn.close()
                counts[i] += 1
    finally:
        for client in clients:
            client.close()
    return counts


def test_the_sockets_share_one_port_even_when_asked_for_port_0(
    listeners: list[socket.socket],
) -> None:
    assert len({sock.getsockname() for sock in listeners}) == 1
    assert listeners[0].getsockname()[1] != 0


def test_new_connections_go_only_to_the_serving_workers_sockets(
    listeners: list[socket.socket],
) -> None:
    steer(listeners[0], [1])
    assert _spread(listeners) == [0, 40, 0]
    steer(listeners[2], [0, 2])  # any socket of the group replaces the program
    counts = _spread(listeners)
    assert counts[1] == 0 and counts[0] > 0 and counts[2] > 0, counts
    steer(listeners[0], [0, 1, 2])
    assert all(_spread(listeners, 60)), "every serving socket gets some"


def test_with_no_worker_serving_the_kernel_spreads_them_as_without_a_program(
    listeners: list[socket.socket],
) -> None:
    assert steering_program([]) == [(0x06, 0, 0, KERNEL_HASH)]
    steer(listeners[0], [])
    assert sum(_spread(listeners)) == 40


def test_a_connection_queued_when_a_worker_closes_waits_for_its_successor() -> None:
    """The worker's close drops its own reference: the supervisor's keeps the socket,
    and the connection that arrived too late for the worker is accepted by the next one,
    not reset."""
    (held,) = bind_shared(("127.0.0.1", 0), 1)
    with held:
        worker = socket.socket(fileno=os.dup(held.fileno()))
        client = socket.create_connection(held.getsockname())
        worker.close()  # the old worker's listener closes with the client queued
        successor = socket.socket(fileno=os.dup(held.fileno()))
        with successor, client:
            conn, _ = successor.accept()
            with conn:
                client.sendall(b"ping")
                assert conn.recv(4) == b"ping"
                conn.sendall(b"pong")
                assert client.recv(4) == b"pong"


def test_the_kernel_takes_the_program_for_the_most_workers_and_keeps_their_order() -> None:
    """64 workers (MAX_WORKERS): the kernel accepts the program for all of them (it
    checks every program it is given), and the index it returns names the socket
    bound in that place."""
    socks = bind_shared(("127.0.0.1", 0), MAX_WORKERS)
    try:
        for sock in socks:
            sock.setblocking(False)
        steer(socks[0], list(range(MAX_WORKERS)))
        steer(socks[0], [MAX_WORKERS - 1])
        assert _spread(socks, 10) == [0] * (MAX_WORKERS - 1) + [10]
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize("held_by_supervisor", [True, False], ids=["held", "own-socket"])
async def test_a_client_completed_just_before_a_workers_close_is_served_by_its_successor(
    monkeypatch: pytest.MonkeyPatch, held_by_supervisor: bool
) -> None:
    """The race a rolling restart used to lose: the kernel completes a client's
    connection after the worker's last accept and before its close. With the socket
    held by the supervisor, the successor answers it; a worker that owns its socket
    alone (the `own-socket` case, as before) resets it."""
    (held,) = bind_shared(("127.0.0.1", 0), 1)
    port = held.getsockname()[1]
    late: list[socket.socket] = []
    close = trio.SocketListener.aclose

    async def close_late(self: trio.SocketListener) -> None:
        late.append(socket.create_connection(("127.0.0.1", port)))
        await close(self)

    def share() -> int:
        fd = os.dup(held.fileno())
        if not held_by_supervisor:
            held.close()
        return fd

    monkeypatch.setattr(trio.SocketListener, "aclose", close_late)
    closing, stop = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        worker = HttpServer(echo, graceful_timeout=1)
        await nursery.start(
            partial(worker.serve, accept_until=closing.wait, listen_fd=share()),
            ("127.0.0.1", port),
            stop.wait,
        )
        closing.set()
        with trio.fail_after(5):
            while not late:  # noqa: ASYNC110 (the worker's own close)
                await trio.sleep(0.01)
        stop.set()
    monkeypatch.undo()
    (client,) = late

    def ask() -> bytes:
        client.settimeout(10)
        try:
            client.sendall(b"GET /late HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := client.recv(1000):
                answer += chunk
            return answer
        except OSError as exc:
            return repr(exc).encode()
        finally:
            client.close()

    if held_by_supervisor:
        async with trio.open_nursery() as nursery:
            successor = HttpServer(echo, graceful_timeout=1)
            await nursery.start(
                partial(successor.serve, listen_fd=share()),
                ("127.0.0.1", port),
                trio.sleep_forever,
            )
            answer = await trio.to_thread.run_sync(ask)
            nursery.cancel_scope.cancel()
        held.close()
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"GET /late "), answer
    else:
        answer = await trio.to_thread.run_sync(ask)
        assert b"HTTP/1.1" not in answer, answer  # reset, or closed unanswered
