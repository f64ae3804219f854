"""A stream's parts written by the link's reader (`_Pending.sink`, router/link.py).

While a stream's relay waits for its next part with nothing queued, a part that
arrives is written to the client by the task that read it from the agent, through
the client connection's part writer (ANSWER_SCOPE's `part_writer`), and the relay is
not woken; the relay writes whatever arrives while it is busy, and an end. A part
the kernel took only some of has the relay write next. Real router sessions and
stream relays, no sockets: the part writer here records what it is given.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio
import trio.testing

from protocol import messages as m
from protocol.tokens import issue_token
from router.continuation_relay import StreamRelay
from router.link import AgentLink, AgentResponse, AgentSession, LinkSettings, _Pending
from router.metrics import RouterMetrics
from router.peers import PeerTable
from router.session import Slot
from tests.fleet import SECRET
from tests.test_link import METADATA
from tests.test_link_fuzz import PEER, RecordingStream


class _Continuer:
    """What a relay asks of its StreamContinuer before any break: whether to keep
    the transcript."""

    def enabled(self, req: object) -> bool:
        return True


class _Writer:
    """A client connection's part writer: records each part; `keeps` of them it
    takes only in part (returns False)."""

    def __init__(self, keeps: int = 0) -> None:
        self.parts: list[bytes] = []
        self.keeps = keeps

    def __call__(self, body: bytes) -> bool:
        self.parts.append(body)
        if self.keeps:
            self.keeps -= 1
            return False
        return True


def _answer() -> tuple[AgentSession, int, _Pending, AgentResponse]:
    link = AgentLink(
        PeerTable(), RouterMetrics(), LinkSettings(SECRET.encode(), 5.0, 15.0, 30.0, "r")
    )
    session = AgentSession(link, RecordingStream(), PEER)  # type: ignore[arg-type]
    session.on_message(m.hello(issue_token(SECRET.encode(), PEER, 60), METADATA))
    req_id, pending = session.open()
    session.on_message(m.response_head(req_id, 200, {}))
    assert pending.frames.popleft()[1]["type"] == m.RESPONSE_HEAD  # as forward takes it
    peer = session.peer
    assert peer is not None
    peer.active += 1
    response = AgentResponse(session, req_id, pending, 200, {}, Slot(peer, lambda p: None))
    return session, req_id, pending, response


class _Client:
    """The relay's `send`: records each body part; blocks while `hold` is set."""

    def __init__(self) -> None:
        self.bodies: list[tuple[bytes, bool]] = []
        self.hold: trio.Event | None = None

    async def __call__(self, message: dict) -> None:
        self.bodies.append((message["body"], message.get("more_body", False)))
        if self.hold is not None:
            await self.hold.wait()


@contextlib.asynccontextmanager
async def _relaying(
    response: AgentResponse,
    write_part: Callable[[bytes], bool] | None,
    client: _Client,
    grow: Callable[[bytes], Awaitable[None]] | None = None,
) -> AsyncIterator[StreamRelay]:
    """A stream relay running until the block's end, first waiting for a part."""
    relay = StreamRelay(_Continuer(), None, response, lambda r: None, grow, write_part)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run, client)
        await trio.testing.wait_all_tasks_blocked()
        yield relay


async def test_parts_that_arrive_while_the_relay_waits_are_written_without_it() -> None:
    session, req_id, pending, response = _answer()
    writer, client = _Writer(), _Client()
    async with _relaying(response, writer, client) as relay:
        for data in (b"a", b"bc", b"d"):
            session.on_message(m.response_chunk(req_id, data))
            assert not pending.frames
        await trio.testing.wait_all_tasks_blocked()
        assert client.bodies == []  # the relay never ran
        session.on_message(m.response_end(req_id))
    assert writer.parts == [b"a", b"bc", b"d"]
    assert client.bodies == [(b"", False)]  # the end, its one write
    # Written by the reader, kept all the same for a continuation.
    assert relay.transcript == [b"a", b"bc", b"d"]
    assert pending.sink is None and response.done


async def test_a_part_taken_in_part_has_the_relay_write_next_and_in_order() -> None:
    """What the kernel did not take goes out with the relay's next write: the part
    behind it waits in the queue, not written ahead by the reader."""
    session, req_id, _, response = _answer()
    writer, client = _Writer(keeps=1), _Client()
    async with _relaying(response, writer, client) as relay:
        session.on_message(m.response_chunk(req_id, b"first"))
        session.on_message(m.response_chunk(req_id, b"second"))
        await trio.testing.wait_all_tasks_blocked()
        session.on_message(m.response_chunk(req_id, b"third"))
        session.on_message(m.response_end(req_id))
    assert writer.parts == [b"first", b"third"]
    assert client.bodies == [(b"second", True), (b"", False)]
    assert relay.transcript == [b"first", b"second", b"third"]


async def test_parts_that_arrive_while_the_relay_writes_are_its_own() -> None:
    session, req_id, pending, response = _answer()
    writer, client = _Writer(), _Client()
    client.hold = trio.Event()
    session.on_message(m.response_chunk(req_id, b"queued"))
    async with _relaying(response, writer, client):
        assert client.bodies == [(b"queued", True)]  # and blocked in its write
        session.on_message(m.response_chunk(req_id, b"x"))
        session.on_message(m.response_chunk(req_id, b"y"))
        assert len(pending.frames) == 2
        client.hold.set()
        client.hold = None
        await trio.testing.wait_all_tasks_blocked()
        session.on_message(m.response_chunk(req_id, b"z"))
        session.on_message(m.response_end(req_id))
    assert writer.parts == [b"z"]
    assert client.bodies == [(b"queued", True), (b"xy", True), (b"", False)]


async def test_no_part_writer_or_a_growing_footprint_keeps_every_part_in_the_relay() -> None:
    async def grow(chunk: bytes) -> None:
        pass

    for write_part, grows in ((None, None), (_Writer(), grow)):
        session, req_id, pending, response = _answer()
        client = _Client()
        async with _relaying(response, write_part, client, grows):
            assert pending.sink is None
            session.on_message(m.response_chunk(req_id, b"a"))
            await trio.testing.wait_all_tasks_blocked()
            session.on_message(m.response_end(req_id))
        assert client.bodies == [(b"a", True), (b"", False)]
        assert write_part is None or write_part.parts == []


async def test_a_relay_cancelled_while_it_waits_writes_nothing_more() -> None:
    session, req_id, pending, response = _answer()
    writer, client = _Writer(), _Client()
    with trio.CancelScope() as scope:
        async with _relaying(response, writer, client):
            session.on_message(m.response_chunk(req_id, b"before"))
            scope.cancel()
            # Cancelled but not yet unwound: the part is the relay's, not written.
            session.on_message(m.response_chunk(req_id, b"during"))
    response.close()  # as the router's relay does in its `finally`
    session.on_message(m.response_chunk(req_id, b"after"))
    assert writer.parts == [b"before"]
    assert pending.sink is None
    assert session.fs.sent[-1] == m.cancel(req_id)  # type: ignore[attr-defined]


def _batched() -> tuple[AgentSession, int, _Pending, AgentResponse]:
    """A session whose link reader calls `write_held` before each socket read."""
    session, req_id, pending, response = _answer()
    session.batched = True
    session.fs.direct = True  # type: ignore[attr-defined]  # frames from the muxer
    return session, req_id, pending, response


async def test_parts_that_one_read_brought_leave_joined_once_it_is_read() -> None:
    session, req_id, pending, response = _batched()
    writer, client = _Writer(keeps=1), _Client()
    async with _relaying(response, writer, client) as relay:
        for data in (b"a", b"bc", b"d"):
            session.on_message(m.response_chunk(req_id, data))
        assert writer.parts == [] and len(pending.frames) == 3
        session.write_held()  # the read is over: one write, kept in part by the kernel
        assert writer.parts == [b"abcd"] and pending.frames[0][1]["data"] == b""
        await trio.testing.wait_all_tasks_blocked()
        assert client.bodies == [(b"", True)]  # the relay wrote next, what was kept
        session.on_message(m.response_chunk(req_id, b"e"))
        session.write_held()
        session.write_held()  # a read that brought nothing for it
        await trio.testing.wait_all_tasks_blocked()
        session.on_message(m.response_end(req_id))
    assert writer.parts == [b"abcd", b"e"]
    assert client.bodies == [(b"", True), (b"", False)]
    assert relay.transcript == [b"abcd", b"", b"e"]


async def test_an_end_in_the_same_read_leaves_with_the_held_parts_from_the_relay() -> None:
    session, req_id, _, response = _batched()
    writer, client = _Writer(), _Client()
    async with _relaying(response, writer, client):
        session.on_message(m.response_chunk(req_id, b"a"))
        session.on_message(m.response_chunk(req_id, b"b"))
        session.on_message(m.response_end(req_id))
        session.write_held()  # before the relay runs, as the reader's next read
    assert writer.parts == []
    assert client.bodies == [(b"ab", False)]  # the parts and the end in one write


async def test_held_parts_of_a_relay_cancelled_in_the_read_are_not_written() -> None:
    session, req_id, _, response = _batched()
    writer, client = _Writer(), _Client()
    with trio.CancelScope() as scope:
        async with _relaying(response, writer, client):
            session.on_message(m.response_chunk(req_id, b"held"))
            scope.cancel()
            session.write_held()
    response.close()
    assert writer.parts == [] and client.bodies == []


async def test_parts_leave_as_they_come_while_the_session_still_reads_for_itself() -> None:
    """Before the muxer's task delivers a session's frames (`fs.direct`), its own
    reader does, after the muxer's read: holding parts for that read's end would hold
    them until the next one."""
    session, req_id, _, response = _batched()
    session.fs.direct = False  # type: ignore[attr-defined]
    writer, client = _Writer(), _Client()
    async with _relaying(response, writer, client):
        session.on_message(m.response_chunk(req_id, b"a"))
        assert writer.parts == [b"a"] and session.held == []
        session.on_message(m.response_end(req_id))
    assert client.bodies == [(b"", False)]


async def test_a_part_writer_that_fails_leaves_the_part_to_its_relay_and_the_link_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The link's reader writes the parts: an exception there would end the agent's
    session with every request on it. The failing writer is dropped, the part goes to
    the relay, whose own write then fails that request alone (here it writes)."""

    def broken(body: bytes) -> bool:
        raise RuntimeError("a bug in a part writer")

    for batched in (False, True):
        session, req_id, pending, response = _batched() if batched else _answer()
        client = _Client()
        async with _relaying(response, broken, client):
            session.on_message(m.response_chunk(req_id, b"a"))
            session.write_held()
            await trio.testing.wait_all_tasks_blocked()
            assert pending.sink is None
            session.on_message(m.response_chunk(req_id, b"b"))
            await trio.testing.wait_all_tasks_blocked()
            session.on_message(m.response_end(req_id))
        assert client.bodies == [(b"a", True), (b"b", True), (b"", False)]
        assert not session.fs.closed.is_set()
    assert caplog.text.count("relay_sink_failed") == 2
