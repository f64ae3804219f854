"""The link's session objects in process: what they say about themselves, and an
agent whose own answer breaks the rules."""

from __future__ import annotations

import random
import re

import pytest
import trio
import trio.testing

import agent.forward as agent_forward
import agent.link as agent_link
from agent.capacity import SharedCapacity
from agent.engine_http import EnginePool, EngineTimeouts
from agent.link import RouterConnection, RouterSession, Status
from protocol import messages as m
from protocol.tokens import issue_token
from router.link import AgentLink, AgentResponse, AgentSession, LinkSettings, unsendable_head
from router.metrics import RouterMetrics
from router.peers import PeerTable
from router.session import Slot
from tests.fleet import SECRET
from tests.test_link import METADATA
from tests.test_link_fuzz import (
    PEER,
    CannedEngine,
    NoStream,
    RecordingStream,
    agent_session,
    canned_engine,
)


async def test_link_objects_show_their_state_and_live_counts() -> None:
    link = AgentLink(
        PeerTable(), RouterMetrics(), LinkSettings(SECRET.encode(), 5.0, 15.0, 30.0, "r")
    )
    session = AgentSession(link, RecordingStream(), PEER)  # type: ignore[arg-type]
    assert repr(session) == (
        f"<AgentSession peer={PEER} AWAITING_HELLO, 0 live requests, next id 1, open>"
    )
    session.on_message(m.hello(issue_token(SECRET.encode(), PEER, 60), METADATA))
    req_id, pending = session.open()
    assert repr(pending) == "<_Pending id=1 AWAITING_HEAD, 0 queued>"
    session.on_message(m.response_head(req_id, 200, {}))
    session.on_message(m.response_chunk(req_id, b"x"))
    assert repr(pending) == "<_Pending id=1 BODY, 2 queued>"
    peer = session.peer
    assert peer is not None
    peer.active += 1
    response = AgentResponse(session, req_id, pending, 200, {}, Slot(peer, lambda p: None))
    assert repr(response) == "<AgentResponse id=1 status=200 BODY, 2 queued, open>"
    assert "JOINED, 1 live requests, next id 2" in repr(session)
    assert repr(link) == (
        "<AgentLink 1 sessions, <Unjoined 0 sessions on 0 connections from 0 addresses>>"
    )
    response.close()
    assert "0 live requests" in repr(session)

    router_session = RouterSession(
        NoStream(),
        m.hello("t", {}),
        Status(),
        EnginePool("http://e", EngineTimeouts(5.0, 5.0), 1, canned_engine),
        5.0,
        5.0,
    )
    assert repr(router_session) == "<RouterSession AWAITING_HELLO, 0 live requests, open>"
    connection = RouterConnection(
        None, "/ip4/127.0.0.1/tcp/9/p2p/" + PEER_ID, lambda s: router_session
    )
    assert repr(connection).startswith("<RouterConnection /ip4/127.0.0.1/tcp/9/p2p/")
    assert "sessions_started=0 now=None" in repr(connection)


PEER_ID = "12D3KooWGQaEXi5zdK6sv4u1rjM8EQrfH3GnjJb8GrmyrXrU2yZ8"


def test_an_agent_answer_out_of_order_fails_that_request_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def broken_forward(
        engine: object,
        msg: dict,
        send: object,
        span: object,
        scope: object,
        whole: bool,
        missing: object = None,
    ) -> None:
        send(m.response_chunk(msg["id"], b"before the head"))  # type: ignore[operator]

    monkeypatch.setattr(agent_link, "forward", broken_forward)

    async def main() -> None:
        session, fs = agent_session()
        async with trio.open_nursery() as nursery:
            session._nursery = nursery
            session._on_message(m.welcome(5.0, "r", 30.0))
            session._on_message(m.request(3, "POST", "/v1/chat/completions", {}, b"{}", False))
            await session.wait_idle()
            nursery.cancel_scope.cancel()
        assert [(f["type"], f["id"]) for f in fs.sent] == [(m.ERROR, 3)]
        assert "can't handle response_chunk in state AWAITING_HEAD" in fs.sent[0]["message"]
        assert not session.requests

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


class _Float(float):
    pass


@pytest.mark.parametrize(
    ("value", "number"),
    [
        (0.25, 0.25),
        (-1.5, -1.5),
        (3, 3.0),
        (-2, -2.0),
        (_Float(0.5), 0.5),
        (float("nan"), None),
        (float("inf"), None),
        (float("-inf"), None),
        (True, None),
        ("0.5", None),
        (None, None),
    ],
)
def test_a_heartbeat_value_is_a_finite_float_or_unknown(
    value: object, number: float | None
) -> None:
    link = AgentLink(
        PeerTable(), RouterMetrics(), LinkSettings(SECRET.encode(), 5.0, 15.0, 30.0, "r")
    )

    async def main() -> AgentSession:
        session = AgentSession(link, RecordingStream(), PEER)  # type: ignore[arg-type]
        session.on_message(m.hello(issue_token(SECRET.encode(), PEER, 60), METADATA))
        values = {"kv_cache_utilization": value, "gpu_util_percent": value}
        session.on_message(m.heartbeat(1.0, True, values, values))
        return session

    peer = trio.run(main).peer
    assert peer is not None
    for got in (peer.engine["kv_cache_utilization"], peer.hardware["gpu_util_percent"]):
        assert got == number
        assert type(got) is type(number)


def test_heartbeats_carry_the_elsewhere_count_and_a_drop_wakes_the_model() -> None:
    table = PeerTable()
    link = AgentLink(table, RouterMetrics(), LinkSettings(SECRET.encode(), 5.0, 15.0, 30.0, "r"))
    woken: list[str] = []

    async def main() -> list[tuple[int, int, int]]:
        session = AgentSession(link, RecordingStream(), PEER)  # type: ignore[arg-type]
        session.on_message(m.hello(issue_token(SECRET.encode(), PEER, 60), METADATA))
        peer = session.peer
        assert peer is not None
        peer.active = 1  # one request of this router's own
        table.on_change(woken.append)
        seen = []
        for elsewhere in (3, 3, 10**6, 2, None, 0, -5):
            msg = m.heartbeat(1.0, True, {}, {})
            if elsewhere is not None:
                msg["elsewhere"] = elsewhere
            session.on_message(msg)
            seen.append((peer.elsewhere, peer.active, len(woken)))
        return seen

    capacity = METADATA["capacity"]
    assert trio.run(main) == [
        (3, 4, 0),
        (3, 4, 0),
        (capacity, 1 + capacity, 0),  # bounded by the agent's capacity
        (2, 3, 1),  # room again: the model's waiters look
        (0, 1, 2),  # an agent that stops counting holds none elsewhere
        (0, 1, 2),
        (0, 1, 2),
    ]


def test_a_closed_session_leaves_no_load_of_the_other_routers_on_its_record() -> None:
    """No report will come to correct it: the dead agent's record would show that load
    until it is removed (--remove-after), to dashboards and to anything that sums it."""
    link = AgentLink(
        PeerTable(), RouterMetrics(), LinkSettings(SECRET.encode(), 5.0, 15.0, 30.0, "r")
    )

    async def main() -> tuple[int, int]:
        session = AgentSession(link, RecordingStream(), PEER)  # type: ignore[arg-type]
        session.on_message(m.hello(issue_token(SECRET.encode(), PEER, 60), METADATA))
        peer = session.peer
        assert peer is not None
        msg = m.heartbeat(1.0, True, {}, {})
        msg["elsewhere"] = 2
        session.on_message(msg)
        assert (peer.elsewhere, peer.active) == (2, 2)
        link._closed(session, "agent killed")
        return peer.elsewhere, peer.active

    assert trio.run(main) == (0, 0)


class _StalledEngine(CannedEngine):
    """An engine connection that takes the request and never answers it."""

    async def send_all(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()


def test_a_cancelled_request_s_slot_is_free_for_the_next_request_in_the_same_read() -> None:
    """The router counts a slot free once it has cancelled, and its next request may come
    in the same read as the cancel. An agent at its capacity refused that one
    `agent_full` while the cancelled task was still unwinding, and the router's queue
    then served its waiters out of priority order (tests/test_priority_e2e.py)."""
    opened = 0

    async def engines() -> CannedEngine:
        nonlocal opened
        opened += 1
        return _StalledEngine() if opened == 1 else CannedEngine()

    async def main() -> None:
        session, fs = agent_session(engines, SharedCapacity(1))
        chat = ("POST", "/v1/chat/completions", {}, b"{}", False)
        async with trio.open_nursery() as nursery:
            session._nursery = nursery
            session._on_message(m.welcome(5.0, "r", 30.0))
            session._on_message(m.request(1, *chat))
            await trio.testing.wait_all_tasks_blocked()  # request 1 waits on its engine
            session._on_message(m.cancel(1))
            session._on_message(m.request(2, *chat))  # no scheduler pass in between
            await session.wait_idle()
            nursery.cancel_scope.cancel()
        assert [(f["type"], f["id"]) for f in fs.sent if "id" in f] == [
            (m.RESPONSE_HEAD, 2),
            (m.RESPONSE_CHUNK, 2),
            (m.RESPONSE_END, 2),
        ]
        assert session.capacity.in_flight == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_requests_one_after_another_are_served_by_one_worker_that_enters_no_scope(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session's worker serves request after request in its one cancel scope: no
    task is spawned, no scope entered and no deadline moved per request. A request
    that is cancelled, or whose engine times out, ends its worker with it (a cancelled
    scope stays cancelled); the timeout is still reported, and the next request gets a
    new worker."""
    stalled = False

    async def engines() -> CannedEngine:
        return _StalledEngine() if stalled else CannedEngine()

    spawned: list[str] = []
    entered: list[str] = []
    moved: list[float] = []
    start_soon = trio.Nursery.start_soon
    enter = trio.CancelScope.__enter__
    deadline = trio.CancelScope.deadline

    def move(scope: trio.CancelScope, value: float) -> None:
        moved.append(value)
        deadline.__set__(scope, value)

    def counted_start(nursery: trio.Nursery, fn: object, *args: object, **kw: object) -> None:
        spawned.append(getattr(fn, "__name__", "?"))
        start_soon(nursery, fn, *args, **kw)  # type: ignore[arg-type]

    def counted_enter(scope: trio.CancelScope) -> trio.CancelScope:
        if "_work" in trio.lowlevel.current_task().name:
            entered.append("scope")
        return enter(scope)

    async def main() -> None:
        nonlocal stalled
        session, fs = agent_session(engines)
        session.engine.timeouts = EngineTimeouts(5.0, 2.0)
        chat = ("POST", "/v1/chat/completions", {}, b"{}", False)
        async with trio.open_nursery() as nursery:
            session._nursery = nursery
            session._on_message(m.welcome(5.0, "r", 30.0))
            session._on_message(m.request(1, *chat))
            await session.wait_idle()
            monkeypatch.setattr(trio.Nursery, "start_soon", counted_start)
            monkeypatch.setattr(trio.CancelScope, "__enter__", counted_enter)
            monkeypatch.setattr(trio.CancelScope, "deadline", property(deadline.__get__, move))
            session._on_message(m.request(2, *chat))
            await session.wait_idle()
            monkeypatch.undo()
            # Nor a deadline moved: the session's watchdog keeps the read timeouts.
            assert spawned == [] and entered == [] and moved == [], (spawned, entered, moved)
            # Request 3's engine never answers and the router cancels it; request 4's
            # never answers and its read timeout (2 s) ends it.
            session.engine.close()  # the pooled connection answers: new ones do not
            stalled = True
            session._on_message(m.request(3, *chat))
            await trio.testing.wait_all_tasks_blocked()
            session._on_message(m.cancel(3))
            session._on_message(m.request(4, *chat))
            began = trio.current_time()
            await session.wait_idle()
            assert 2.0 <= trio.current_time() - began < 2.5
            stalled = False
            session._on_message(m.request(5, *chat))
            await session.wait_idle()
            nursery.cancel_scope.cancel()
        frames = [(f["type"], f["id"]) for f in fs.sent if "id" in f]
        assert frames == [
            *[(kind, 1) for kind in (m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END)],
            *[(kind, 2) for kind in (m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END)],
            (m.ERROR, 4),
            *[(kind, 5) for kind in (m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END)],
        ]
        timeout = next(f for f in fs.sent if f.get("id") == 4)
        assert timeout["code"] == "backend_unavailable" and "timed out" in timeout["message"]
        assert session.capacity.in_flight == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_agents_head_is_judged_as_header_by_header() -> None:
    """`unsendable_head` checks every value in one pass and remembers good names; its
    verdict, and the first fault it names, are those of a check of each header in
    turn, for heads made of tokens, spaces, tabs, line breaks and control bytes."""
    token = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
    visible = re.compile(r"(?:[^\x00-\x20\x7f]+(?:[ \t]+[^\x00-\x20\x7f]+)*)?")

    def header_by_header(headers: dict[str, str]) -> str | None:
        for name, value in headers.items():
            if token.fullmatch(name) is None:
                return f"header name {name[:80]!r} is not a token"
            if visible.fullmatch(value) is None:
                return f"header {name!r} has a value with control characters: {value[:80]!r}"
        return None

    rng = random.Random(26)
    alphabet = ["a", "b", "-", ":", " ", "\t", "\n", "\r", "\x00", "\x1f", "\x7f", "é"]
    known: set[str] = set()
    for _ in range(20_000):
        head = {
            "".join(rng.choices(alphabet, k=rng.randrange(4))): "".join(
                rng.choices(alphabet, k=rng.randrange(6))
            )
            for _ in range(rng.randrange(4))
        }
        want = header_by_header(head)
        assert unsendable_head(200, head) == want, head
        assert unsendable_head(200, head, known) == want, head
    assert known and all(token.fullmatch(name) for name in known)
    # Long hostile values, each failing only at its end: the same verdict (the one
    # pass over every value stays linear: these would hang a backtracking pattern).
    for value in ("a " * 50_000 + "\x00", "a \t" * 30_000 + " ", "b" * 100_000 + "\x7f"):
        head = {"x-one": "fine", "x-two": value}
        assert unsendable_head(200, head, known) == header_by_header(head)
    assert unsendable_head(199, {}) == "status 199 is not a final status (200-599)"


class _EngineWithUsage(CannedEngine):
    """The canned answer with the engine's token count in it."""

    async def send_all(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        body = b'{"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}'
        self.unread = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )


async def _engine_with_usage() -> CannedEngine:
    return _EngineWithUsage()


@pytest.mark.parametrize(
    ("accepts", "largest"), [((m.RESPONSE,), None), ((), None), ((m.RESPONSE,), 10)]
)
def test_a_whole_answer_is_one_frame_to_a_router_that_takes_it(
    accepts: tuple[str, ...], largest: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if largest is not None:
        # A body past the one-frame size goes in its own chunk frame, as to a router
        # that takes only the base set: a head of up to 64 KiB cannot push it past
        # the frame limit.
        monkeypatch.setattr(agent_forward, "MAX_WHOLE_BYTES", largest)

    async def main() -> list[dict]:
        session, fs = agent_session(_engine_with_usage)
        async with trio.open_nursery() as nursery:
            session._nursery = nursery
            session._on_message(m.welcome(5.0, "r", 30.0, accepts=accepts))
            body = b'{"model": "m1", "messages": []}'
            session._on_message(m.request(3, "POST", "/v1/chat/completions", {}, body, False, True))
            await session.wait_idle()
            nursery.cancel_scope.cancel()
        return fs.sent

    sent = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    usage = {"prompt_tokens": 7, "completion_tokens": 3}
    if accepts and largest is None:
        [whole] = sent
        assert whole["type"] == m.RESPONSE
        assert (whole["id"], whole["status"], whole["usage"]) == (3, 200, usage)
        assert whole["headers"]["content-type"] == "application/json"
        assert b'"completion_tokens": 3' in whole["body"]
        assert whole["elsewhere"] == 0  # the answer's end says what an end says
    else:
        # A router that names nothing gets the base set: head, body, end.
        assert [f["type"] for f in sent] == [m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END]
        assert sent[2]["usage"] == usage
        assert b'"completion_tokens": 3' in sent[1]["data"]


class _DrainDuringDial:
    """A libp2p host whose dial completes after the agent began to drain."""

    def __init__(self) -> None:
        self.connection: RouterConnection | None = None
        self.closed: list[object] = []

    def get_network(self) -> _DrainDuringDial:
        return self

    def unblock_peer(self, peer_id: object) -> None:
        pass

    async def connect(self, info: object) -> None:
        assert self.connection is not None
        self.connection.stopping = True  # SIGTERM: agent/app.py `_drain`

    async def new_stream(self, peer_id: object, protocols: list[str]) -> _DrainDuringDial:
        return self

    async def close(self) -> None:
        self.closed.append(self)


def test_a_dial_that_completes_after_the_drain_began_starts_no_session() -> None:
    host = _DrainDuringDial()
    made: list[object] = []
    connection = RouterConnection(host, "/ip4/127.0.0.1/tcp/9/p2p/" + PEER_ID, made.append)
    host.connection = connection
    trio.run(connection.run, clock=trio.testing.MockClock(autojump_threshold=0))
    assert made == [] and host.closed == [host]
    assert connection.sessions_started == 0


async def test_sessions_due_together_hear_the_routers_liveness_spread_over_passes() -> None:
    # 1,000 agents joined together (a router restarted) fall due for the router's
    # liveness frame in the same pass: it sends its share, twice over, and the rest in
    # the next passes, well within the three intervals an agent waits.
    link = AgentLink(
        PeerTable(), RouterMetrics(), LinkSettings(SECRET.encode(), 5.0, 15.0, 30.0, "r")
    )
    sessions = []
    for i in range(1000):
        peer = f"{PEER[:-6]}{i:06d}"
        session = AgentSession(link, RecordingStream(), peer)  # type: ignore[arg-type]
        session.on_message(m.hello(issue_token(SECRET.encode(), peer, 60), METADATA))
        sessions.append(session)
    interval = link.settings.liveness_interval
    sent_per_pass = []
    now = trio.current_time() + interval
    while len(sent_per_pass) < 30:
        for session in sessions:
            session.last_rx = now  # heartbeats keep coming
        before = [len(s.fs.sent) for s in sessions]
        link._liveness(now, 1.0)
        sent = 0
        for session, n in zip(sessions, before, strict=True):
            if len(session.fs.sent) > n:
                assert session.fs.sent[-1]["type"] == m.HEARTBEAT
                session.fs.last_tx = now  # the frame left
                sent += 1
        sent_per_pass.append(sent)
        now += 1.0
    assert not any(s.fs.closed.is_set() for s in sessions)
    # Every session heard from the router within 16 passes of falling due; no pass
    # sent more than 67 (2 x 1,000 sessions x 1 s / 30 s).
    assert max(sent_per_pass) == 67, sent_per_pass
    assert sum(sent_per_pass[:16]) == 1000, sent_per_pass
    assert sum(sent_per_pass[16:30]) == 0, sent_per_pass
