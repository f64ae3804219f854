"""Hostile frames on the agent link, both ways (hypothesis).

Most examples drive the pure parts: the conversation's rules against a reference of
their own, and each daemon's session object fed decoded frames in-process (no libp2p,
a mock clock, the agent's engine canned answers in memory). Fewer drive the real daemons over real
libp2p: a hostile agent against a router process, a hostile router against an agent
process. Invariants: a daemon never dies, its memory stays bounded, every request ends
exactly once, and nothing of one request or session reaches another.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import msgpack
import psutil
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.capacity import SharedCapacity
from agent.engine_http import EnginePool, EngineTimeouts
from agent.link import RouterSession, Status
from protocol import messages as m
from protocol.conversation import (
    SESSION_END,
    ProtocolError,
    RequestState,
    Role,
    next_request_state,
    next_session_state,
    open_request,
)
from protocol.frames import HEADER, encode_frame
from protocol.p2p import FramedStream, SessionClosed
from protocol.tokens import issue_token
from router.link import AgentLink, AgentResponse, AgentSession, LinkSettings, StreamBroken
from router.metrics import RouterMetrics
from router.peers import PeerTable
from router.session import ForwardFailure, RouteRequest, Slot
from tests.fleet import SECRET, Agent, Fleet, Router, router_and_agent
from tests.link_peers import fake_router
from tests.test_link import METADATA, raw_session

SCALE = float(os.environ.get("HIVENET_FUZZ_SCALE", "1"))
PEER = "12D3KooWLinkFuzz"


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


# --- the rules against a reference ------------------------------------------------

ANSWERS = (m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END, m.RESPONSE, m.ERROR)
# One request's answer frames, written as a regular language: a head, chunks, then an
# end or an error; or a whole answer or an error at once.
ANSWER_ORDER = re.compile(r"HC*[EX]|W|X")
LETTER = {
    m.RESPONSE_HEAD: "H",
    m.RESPONSE_CHUNK: "C",
    m.RESPONSE_END: "E",
    m.RESPONSE: "W",
    m.ERROR: "X",
}


@fuzz(1000)
@given(st.lists(st.sampled_from(ANSWERS), max_size=8), st.integers(-1, 8))
def test_the_request_rules_accept_exactly_the_answer_order(
    kinds: list[str], cancel_at: int
) -> None:
    state = open_request(None)
    accepted: list[str] = []
    cancelled = False
    for i, kind in enumerate(kinds):
        if i == cancel_at:
            state = next_request_state(Role.ROUTER, state, m.CANCEL)
            cancelled = cancelled or state is RequestState.CANCELLED
        try:
            state = next_request_state(Role.AGENT, state, kind)
        except ProtocolError:
            # Refused exactly when no word of the language starts with what came so far.
            word = "".join(LETTER[k] for k in (*accepted, kind))
            assert not cancelled
            assert not any(ANSWER_ORDER.fullmatch(word + rest) for rest in ("", "E")), word
            return
        accepted.append(kind)
    word = "".join(LETTER[k] for k in accepted)
    if cancelled:
        assert state is RequestState.CANCELLED
    elif ANSWER_ORDER.fullmatch(word):
        assert state in (RequestState.DONE, RequestState.FAILED)
        assert next_request_state(Role.AGENT, state, SESSION_END) is state
    else:
        assert state in (RequestState.AWAITING_HEAD, RequestState.BODY)
        assert next_request_state(Role.AGENT, state, SESSION_END) is RequestState.FAILED


# --- frames the daemons may be sent -----------------------------------------------

# msgpack's integers: the 64-bit range, signed or not (a larger one cannot be sent).
msgpack_ints = st.integers(-(2**63), 2**64 - 1)
ids = st.integers(-2, 6) | msgpack_ints
header_maps = st.dictionaries(
    st.sampled_from(("content-type", "x-a", "bad name", "")), st.text(max_size=8), max_size=2
)
agent_frames = st.one_of(
    st.builds(m.response_head, ids, st.integers(0, 700), header_maps),
    st.builds(m.response_chunk, ids, st.binary(max_size=20)),
    st.builds(m.response_end, ids),
    st.builds(m.response, ids, st.integers(0, 700), header_maps, st.binary(max_size=20), st.none()),
    st.builds(m.error, ids, st.sampled_from(("backend_error", "nonsense")), st.text(max_size=10)),
    st.builds(m.heartbeat, st.floats(), st.booleans(), st.just({}), st.just({})),
    st.builds(m.drain),
    st.builds(m.hello, st.text(max_size=8), st.just(METADATA)),
    st.builds(m.cancel, ids),
    st.dictionaries(st.sampled_from(("type", "id", "data")), msgpack_ints | st.text(max_size=8)),
)
router_frames = st.one_of(
    st.builds(
        lambda i, s: m.request(i, "POST", "/v1/chat/completions", {}, b"{}", s),
        ids,
        st.booleans(),
    ),
    st.builds(m.cancel, ids),
    st.builds(m.heartbeat, st.floats()),
    st.builds(m.welcome, st.floats(), st.text(max_size=5), st.floats()),
    st.builds(m.refusal, st.text(max_size=8)),
    st.builds(m.response_chunk, ids, st.binary(max_size=8)),
    st.builds(m.drain),
    st.dictionaries(st.sampled_from(("type", "id")), msgpack_ints | st.text(max_size=8)),
)


def raw_bytes(frames: st.SearchStrategy[dict]) -> st.SearchStrategy[bytes]:
    """A frame, a frame cut short, valid msgpack of the wrong shape, garbage, or a
    length over every bound."""
    return st.one_of(
        frames.map(lambda f: encode_frame(f)),
        frames.map(lambda f: encode_frame(f)[:-1]),
        st.builds(
            lambda v: HEADER.pack(len(p := msgpack.packb(v))) + p,
            st.lists(msgpack_ints) | msgpack_ints | st.text(max_size=5),
        ),
        st.binary(max_size=40),
        st.integers(64 * 1024 + 1, 2**32 - 1).map(lambda n: struct.pack(">I", n)),
    )


# --- a router session, in process -------------------------------------------------


class RecordingStream:
    """The parts of FramedStream a router session uses."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.closed = trio.Event()
        self.close_reason = ""
        self.last_tx = 0.0

    def send_nowait(self, msg: dict) -> None:
        if self.closed.is_set():
            raise SessionClosed(self.close_reason)
        encode_frame(msg)
        m.validate(msg)
        self.sent.append(msg)

    async def send(self, msg: dict) -> None:
        self.send_nowait(msg)

    def allow_frames(self, max_frame_bytes: int) -> None:
        pass

    def close(self, reason: str) -> None:
        self.close_reason = self.close_reason or reason
        self.closed.set()

    async def flush_and_close(self, reason: str) -> None:
        self.close(reason)


def route_request(stream: bool, rid: str = "r") -> RouteRequest:
    return RouteRequest(rid, "m1", "llm", "t", "POST", "/v1/chat/completions", {}, b"{}", stream)


@fuzz(400)
@given(
    st.lists(st.booleans(), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(0, 3), agent_frames), max_size=25),
)
def test_a_router_session_ends_every_request_once_whatever_the_agent_sends(
    streams: list[bool], script: list[tuple[int, dict]]
) -> None:
    """Frames are aimed at the live requests (by index) or at any id; chunk data names
    the id it was sent for, so an answer holding another request's bytes shows."""

    async def main() -> None:
        link = AgentLink(
            PeerTable(),
            RouterMetrics(),
            LinkSettings(SECRET.encode(), 5.0, 15.0, 30.0, "12D3KooWRouter"),
        )
        fs = RecordingStream()
        session = AgentSession(link, fs, PEER)  # type: ignore[arg-type]
        session.on_message(m.hello(issue_token(SECRET.encode(), PEER, 60), METADATA))
        session.on_message(m.heartbeat(time.time(), True, {}, {}))
        peer = session.peer
        assert peer is not None
        outcomes: dict[int, list[object]] = {}

        async def one(index: int, stream: bool) -> None:
            peer.active += 1
            slot = Slot(peer, lambda p: None)
            result = await link.forward(peer, route_request(stream, f"r{index}"), slot)
            record = outcomes.setdefault(index, [])
            if isinstance(result, ForwardFailure):
                slot.release()  # as the routing session does on a failed try
                record.append(result)
                return
            assert isinstance(result, AgentResponse)
            try:
                record.append(await result.read_all())
            except StreamBroken as exc:
                record.append(exc)

        async with trio.open_nursery() as nursery:
            for index, stream in enumerate(streams):
                nursery.start_soon(one, index, stream)
            await trio.sleep(0.01)
            live = [msg["id"] for msg in fs.sent if msg["type"] == m.REQUEST]
            # trio starts the tasks in any order: which id each request got.
            id_of = {int(p.rid[1:]): req_id for req_id, p in session.pending.items()}
            for target, frame in script:
                frame = dict(frame)
                if "id" in frame and target < len(live) and isinstance(frame.get("id"), int):
                    frame["id"] = live[target]
                if isinstance(frame.get("id"), int):
                    mine = f"<{frame['id']}>".encode()
                    if frame.get("type") == m.RESPONSE_CHUNK:
                        frame["data"] = mine
                    elif frame.get("type") == m.RESPONSE:
                        frame["body"] = mine
                try:
                    m.validate(frame)
                    session.on_message(frame)
                except ProtocolError:
                    break  # the reader ends the session here
                await trio.sleep(0.001)
            fs.close("fuzz over")
            link._closed(session, "fuzz over")
        assert sorted(outcomes) == list(range(len(streams)))
        for index, record in outcomes.items():
            assert len(record) == 1, record  # ended exactly once
            body = record[0]
            if isinstance(body, bytes):
                mine = f"<{id_of[index]}>".encode()
                assert body == mine * (len(body) // len(mine)), (index, body)
        assert not session.pending
        assert peer.active == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# --- an agent session, in process -------------------------------------------------


_ANSWER = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "model": "m1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    }
).encode()


class CannedEngine:
    """One engine connection in memory: each request written gets the same answer."""

    def __init__(self) -> None:
        self.unread = b""

    async def send_all(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.unread = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(_ANSWER), _ANSWER)
        )

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self.unread:
            await trio.sleep_forever()
        data, self.unread = self.unread, b""
        return data

    def close(self) -> None:
        self.unread = b""


async def canned_engine() -> CannedEngine:
    return CannedEngine()


def agent_session(
    engines: Callable[[], Awaitable[CannedEngine]] = canned_engine,
    capacity: SharedCapacity | None = None,
) -> tuple[RouterSession, RecordingStream]:
    """An agent's session past its hello, its frames recorded, over in-memory engines."""
    session = RouterSession(
        NoStream(),
        m.hello("t", {}),
        Status(),
        EnginePool("http://engine", EngineTimeouts(5.0, 5.0), 4, engines),
        5.0,
        5.0,
        capacity=capacity,
    )
    fs = session.fs = RecordingStream()  # type: ignore[assignment]
    session.state = next_session_state(Role.AGENT, session.state, m.HELLO)
    return session, fs


class NoStream:
    """A stream that has no socket under it; the session's sends are recorded instead."""


@fuzz(300)
@given(st.lists(router_frames, max_size=20), st.booleans())
def test_an_agent_session_answers_every_request_once_whatever_the_router_sends(
    script: list[dict], whole: bool
) -> None:
    async def main() -> None:
        session, fs = agent_session()
        accepted: list[int] = []
        refused: list[int] = []
        async with trio.open_nursery() as nursery:
            session._nursery = nursery
            welcome = m.welcome(5.0, "r", 30.0, accepts=(m.RESPONSE,) if whole else ())
            for frame in [welcome, *script]:
                try:
                    m.validate(frame)
                except ProtocolError:
                    break
                live = frame.get("id") in session.requests
                try:
                    session._on_message(frame)
                except ProtocolError:
                    break
                if frame["type"] == m.REQUEST:
                    (refused if live else accepted).append(frame["id"])
                await trio.sleep(0.001)
            await session.wait_idle()
            nursery.cancel_scope.cancel()
        ends = [f["id"] for f in fs.sent if f["type"] in (m.RESPONSE_END, m.RESPONSE, m.ERROR)]
        heads = [f["id"] for f in fs.sent if f["type"] in (m.RESPONSE_HEAD, m.RESPONSE)]
        # A whole answer is one frame to a router that takes it, three to one that does not.
        assert whole or not any(f["type"] == m.RESPONSE for f in fs.sent)
        # One head and one end per accepted request (a cancelled one may stop short),
        # and one error per refused reuse; nothing for ids never asked for.
        for req_id in set(accepted):
            assert heads.count(req_id) <= accepted.count(req_id)
        assert len(ends) <= len(accepted) + len(refused)
        assert set(ends) <= set(accepted) | set(refused)
        assert not session.requests

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# --- the real daemons over real libp2p --------------------------------------------


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Router, Agent]]:
    with router_and_agent(Path(tmp_path_factory.mktemp("link-fuzz"))) as fleet:
        yield fleet


def chat(router: Router) -> httpx.Response:
    return httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "ok"}]},
        timeout=20,
    )


@settings(max_examples=max(1, int(SCALE)), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(st.lists(raw_bytes(agent_frames), min_size=1, max_size=6), min_size=12, max_size=12)
)
def test_a_router_process_outlives_hostile_agents(
    daemons: tuple[Fleet, Router, Agent], sessions: list[list[bytes]]
) -> None:
    _, router, healthy = daemons
    proc = psutil.Process(router.popen.pid)
    before = proc.memory_info().rss

    async def attack(pieces: list[bytes], joined: bool) -> None:
        async with raw_session(router) as (stream, peer_id):
            token = issue_token(SECRET.encode(), peer_id, 60)
            # The router resets a session whose bytes break the rules: that is the point.
            with trio.move_on_after(0.3), contextlib.suppress(Exception):
                if joined:
                    await stream.write(encode_frame(m.hello(token, METADATA)))
                for piece in pieces:
                    await stream.write(piece)
                await stream.read(65536)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i, pieces in enumerate(sessions):
                nursery.start_soon(attack, pieces, i % 2 == 0)

    trio.run(main)
    assert router.alive()
    assert chat(router).status_code == 200
    assert router.agent(healthy.peer_id)["status"]["healthy"]
    table = httpx.get(
        router.url + "/admin/routing-table",
        headers={"authorization": "Bearer test-admin-key"},
        timeout=10,
    )
    json.loads(table.text, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert proc.memory_info().rss - before < 64 * 1024 * 1024


@settings(max_examples=max(1, int(SCALE)), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.lists(raw_bytes(router_frames), min_size=1, max_size=6), min_size=6, max_size=6))
def test_an_agent_process_outlives_a_hostile_router(
    daemons: tuple[Fleet, Router, Agent], sessions: list[list[bytes]]
) -> None:
    fleet = daemons[0]

    async def main() -> None:
        async with fake_router() as router:
            agent = fleet.agent(router, "m1", wait=False)  # type: ignore[arg-type]
            for pieces in sessions:
                count = len(router.sessions)
                with trio.fail_after(30):
                    await router.wait_for(
                        lambda count=count: len(router.sessions) > count and router.joined.is_set()
                    )
                fs: FramedStream = router.sessions[-1]
                # The agent resets a session whose bytes break the rules: that is the
                # point, and the writes after it fail.
                with trio.move_on_after(1), contextlib.suppress(Exception):
                    for piece in pieces:
                        await fs.stream.write(piece)
                await trio.sleep(0.1)
                fs.close("next example")
                router.joined = trio.Event()
            assert agent.alive()
            agent.stop()

    trio.run(main)
