"""The agent's read pump: one task reading the engine sockets of a session's streams.

First the pump alone over socket pairs, then an agent session streaming from a raw
engine on loopback, where the pump reads every stream once two are under way: each
answer whole and in order, a cancel and the engine's silence ending a stream it
reads with its slot given back and its connection closed.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable

import pytest
import trio

from agent.capacity import SharedCapacity
from agent.engine_http import EnginePool, EngineTimeouts
from agent.link import RouterSession, Status
from agent.read_pump import ReadPump
from protocol import messages as m
from protocol.conversation import Role, next_session_state
from tests.raw_engine import Conn, Engine, read_request
from tests.test_link_fuzz import NoStream, RecordingStream


@pytest.fixture
async def pump(nursery: trio.Nursery) -> AsyncIterator[ReadPump]:
    pump = ReadPump()
    nursery.start_soon(pump.run)
    yield pump
    nursery.cancel_scope.cancel()


def pair() -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    return ours, theirs


def reading(sock: socket.socket, got: list[bytes], until: bytes = b".") -> Callable[[], bool]:
    """A reader that keeps what each read brings and is done at `until`, or the end."""

    def reader() -> bool:
        data = sock.recv(4096)
        got.append(data)
        return not data or data.endswith(until)

    return reader


async def test_one_pass_reads_every_ready_socket_and_wakes_each_waiter_once_done(
    pump: ReadPump,
) -> None:
    socks = [pair() for _ in range(3)]
    got: list[list[bytes]] = [[] for _ in socks]
    readers_ran_in: set[trio.lowlevel.Task] = set()
    done: list[int] = []

    async def watch(index: int) -> None:
        ours, _ = socks[index]
        read = reading(ours, got[index])

        def reader() -> bool:
            readers_ran_in.add(trio.lowlevel.current_task())
            return read()

        await pump.until_done(ours.fileno(), reader)
        done.append(index)

    async with trio.open_nursery() as nursery:
        for index in range(3):
            nursery.start_soon(watch, index)
        await trio.sleep(0.05)
        for _, theirs in socks:
            theirs.send(b"half")
        await trio.sleep(0.05)
        assert done == []  # readable, read, not done: nobody woken
        for index, (_, theirs) in enumerate(socks):
            theirs.send(b"-%d." % index)
    assert sorted(done) == [0, 1, 2]
    assert [b"".join(parts) for parts in got] == [b"half-0.", b"half-1.", b"half-2."]
    assert len(readers_ran_in) == 1
    assert readers_ran_in.pop().name.endswith("ReadPump.run")
    assert repr(pump) == "<ReadPump, 0 sockets watched>"


async def test_what_a_reader_raises_is_raised_in_its_waiter_and_the_socket_watched_again(
    pump: ReadPump,
) -> None:
    ours, theirs = pair()

    def broken() -> bool:
        ours.recv(4096)
        raise ValueError("not an answer")

    theirs.send(b"junk")
    with pytest.raises(ValueError, match="not an answer"):
        await pump.until_done(ours.fileno(), broken)
    # Still in the pump's set from its last watch: a second watch works all the same.
    got: list[bytes] = []
    theirs.send(b"again.")
    await pump.until_done(ours.fileno(), reading(ours, got))
    assert got == [b"again."]


async def test_a_cancel_ends_the_watch_and_later_bytes_reach_no_reader(pump: ReadPump) -> None:
    ours, theirs = pair()
    calls: list[bytes] = []
    with trio.move_on_after(0.05) as scope:
        await pump.until_done(ours.fileno(), reading(ours, calls))
    assert scope.cancelled_caught
    assert repr(pump) == "<ReadPump, 0 sockets watched>"
    theirs.send(b"late.")  # the pump wakes, finds no watch and drops the socket
    await trio.sleep(0.05)
    assert calls == []
    assert ours.recv(4096) == b"late."  # left for whoever reads the connection next


async def test_a_descriptor_closed_and_reused_is_read_for_its_new_socket(pump: ReadPump) -> None:
    first, first_peer = pair()
    first_peer.send(b"one.")
    got: list[bytes] = []
    await pump.until_done(first.fileno(), reading(first, got))
    fd = first.fileno()
    first.close()
    first_peer.close()
    second, second_peer = pair()
    assert second.fileno() == fd  # the kernel dropped the old one from the pump's set
    second_peer.send(b"two.")
    with trio.fail_after(2):
        await pump.until_done(second.fileno(), reading(second, got))
    assert got == [b"one.", b"two."]


async def test_a_stream_alone_is_read_by_its_own_task_and_the_pump_joins_from_two(
    pump: ReadPump,
) -> None:
    """A pass of the pump costs an `epoll_wait` more than a task's own wait: a lone
    stream reads for itself, and a socket the pump cannot wait on (None) too."""
    ways: list[str] = []
    gate = trio.Event()

    async def one(sock: int | None, name: str) -> None:
        async def alone() -> None:
            ways.append(f"{name} alone")
            await gate.wait()

        def reader() -> bool:
            ways.append(f"{name} pumped")
            return True

        await pump.read(sock, reader, alone)

    ours, theirs = pair()
    theirs.send(b"x")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, None, "first")
        await trio.sleep(0.01)
        nursery.start_soon(one, None, "no socket")
        await trio.sleep(0.01)
        nursery.start_soon(one, ours.fileno(), "third")
        await trio.sleep(0.05)
        assert pump.readers == 2
        gate.set()
    assert ways == ["first alone", "no socket alone", "third pumped"]
    assert pump.readers == 0
    await pump.read(ours.fileno(), lambda: True, gate.wait)  # alone again
    assert pump.readers == 0


# --- an agent session's streams ---------------------------------------------------


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


def streaming(events: int, apart: float, stall: trio.Event | None = None) -> Callable:
    """An engine streaming `events` events `apart` seconds apart, then `[DONE]` and the
    body's end; with `stall`, silent after the first event until the agent hangs up,
    which sets it."""

    async def handler(conn: Conn) -> None:
        buf = bytearray()
        while await read_request(conn, buf):
            await conn.send_all(HEAD)
            for i in range(events):
                await conn.send_all(chunk(b'data: {"i": %d}\n\n' % i))
                if stall is not None:
                    await read_request(conn, buf)  # until the agent hangs up
                    stall.set()
                    return
                await trio.sleep(apart)
            await conn.send_all(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    return handler


def session_for(engine: Engine, read_timeout: float = 5.0) -> tuple[RouterSession, list]:
    """An agent session past its welcome, over `engine`; its frames are recorded with
    the task that sent each."""
    session = RouterSession(
        NoStream(),
        m.hello("t", {}),
        Status(),
        EnginePool(f"http://127.0.0.1:{engine.port}", EngineTimeouts(2.0, read_timeout), 16),
        5.0,
        5.0,
        capacity=SharedCapacity(16),
    )
    fs = session.fs = RecordingStream()  # type: ignore[assignment]
    session.state = next_session_state(Role.AGENT, session.state, m.HELLO)
    sent: list[tuple[dict, str]] = []
    record = fs.send_nowait

    def send_nowait(msg: dict) -> None:
        record(msg)
        sent.append((msg, trio.lowlevel.current_task().name))

    fs.send_nowait = send_nowait  # type: ignore[method-assign]
    return session, sent


def ask(session: RouterSession, req_id: int) -> None:
    body = b'{"model": "m1", "stream": true}'
    headers = {"content-type": "application/json"}
    session._on_message(m.request(req_id, "POST", "/v1/chat/completions", headers, body, True))


async def test_streams_under_way_together_are_read_by_the_pump_each_whole(
    serve: Callable, nursery: trio.Nursery
) -> None:
    engine = await serve(streaming(events=4, apart=0.02))
    session, sent = session_for(engine)
    session._nursery = nursery
    session._on_message(m.welcome(5.0, "r", 30.0))
    ids = list(range(1, 9))
    for req_id in ids:
        ask(session, req_id)
    with trio.fail_after(10):
        await session.wait_idle()
    for req_id in ids:
        mine = [msg for msg, _ in sent if msg.get("id") == req_id]
        assert mine[0]["type"] == m.RESPONSE_HEAD
        assert mine[-1]["type"] == m.RESPONSE_END, mine[-1]
        body = b"".join(f["data"] for f in mine if f["type"] == m.RESPONSE_CHUNK)
        assert body == b"".join(b'data: {"i": %d}\n\n' % i for i in range(4)) + (
            b"data: [DONE]\n\n"
        )
    by_pump = {msg["id"] for msg, task in sent if task.endswith("ReadPump.run")}
    assert len(by_pump) >= len(ids) - 1  # the first may have started alone
    assert session.capacity.in_flight == 0
    assert session.pump.readers == 0
    assert repr(session.pump) == "<ReadPump, 0 sockets watched>"


@pytest.mark.parametrize("ending", ["cancel", "engine silent"])
async def test_a_stream_the_pump_reads_ends_on_a_cancel_or_silence_with_its_slot_back(
    serve: Callable, nursery: trio.Nursery, ending: str
) -> None:
    stalled = trio.Event()
    steady = await serve(streaming(events=40, apart=0.02))
    stalling = await serve(streaming(events=1, apart=0.0, stall=stalled))
    session, sent = session_for(steady, read_timeout=0.3)
    session._nursery = nursery
    session._on_message(m.welcome(5.0, "r", 30.0))
    ask(session, 1)  # read alone while the other is under way
    await trio.sleep(0.05)
    session.engine = EnginePool(f"http://127.0.0.1:{stalling.port}", EngineTimeouts(2.0, 0.3), 16)
    ask(session, 2)
    await trio.sleep(0.1)
    assert repr(session.pump) == "<ReadPump, 1 sockets watched>"
    if ending == "cancel":
        session._on_message(m.cancel(2))
    with trio.fail_after(5):
        await stalled.wait()  # the engine saw its connection close
        await session.wait_idle()
    second = [msg for msg, _ in sent if msg.get("id") == 2]
    if ending == "cancel":
        assert [f["type"] for f in second] == [m.RESPONSE_HEAD, m.RESPONSE_CHUNK]
    else:
        assert second[-1]["type"] == m.ERROR
        assert second[-1]["message"] == "engine answer broke off: no answer data for 0.3 s"
    first = [msg for msg, _ in sent if msg.get("id") == 1]
    assert first[-1]["type"] == m.RESPONSE_END
    assert session.capacity.in_flight == 0
    assert repr(session.pump) == "<ReadPump, 0 sockets watched>"
