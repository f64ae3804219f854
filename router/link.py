"""Agent sessions on the router: hello check, frame dispatch, liveness, forwarding.

Each agent holds one stream. Frames for a request land in that request's own
unbounded channel, so the session's single reader never waits on a slow client.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from protocol import messages as m
from protocol.conversation import (
    REQUEST_TRANSITIONS,
    SESSION_END,
    SESSION_TRANSITIONS,
    RequestState,
    Role,
    SessionState,
    next_request_state,
    next_session_state,
    request_error,
    session_error,
)
from protocol.errors import AGENT_CODES, ErrorCode, classify_backend_status, route_missing
from protocol.fields import ENGINE_FIELDS, HARDWARE_FIELDS
from protocol.frames import MAX_FRAME_BYTES
from protocol.logs import quote
from protocol.p2p import FramedStream, SessionClosed, before_reads
from protocol.paths import API_PATHS
from protocol.router_proof import MAX_CHALLENGE, router_proof
from protocol.tokens import TokenError, verify_with
from protocol.tracing import NULL_SPAN, Span
from protocol.usage import COMPLETION, PROMPT, valid_usage
from router.agent_detail import gpus_of, memory_of, preemptions_of, upstream_of
from router.capacity import report_elsewhere
from router.lifetime import LifetimeStore
from router.metrics import RouterMetrics
from router.peers import (
    CAPABILITIES,
    AgentMetadata,
    Peer,
    PeerTable,
)
from router.registrations import RegistrationFeed, registration
from router.remote_addr import format_endpoint, remote_endpoint
from router.session import ForwardFailure, RouteRequest, Slot
from router.unjoined import Unjoined, UnjoinedLimits, source_of

log = logging.getLogger("link")

HELLO_TIMEOUT = 10.0
MAX_ERROR_BODY = 1024 * 1024
# An agent sends a whole (not streamed) answer in one frame, having read at most that
# much of it from its engine (agent/forward.py): a larger one is no agent's, and
# without a bound it would grow in the router's memory until the request's deadline.
MAX_WHOLE_ANSWER = MAX_FRAME_BYTES
# An agent's error message is its own few words ("engine timed out: …"); the engine's
# own answer comes as a body. Cut to this many characters, as a body is for its message,
# before it reaches a log line or a client.
MAX_ERROR_MESSAGE = 2000
# The router's own liveness frame goes out after this many agent heartbeat periods of
# silence on a session.
LIVENESS_PERIODS = 6
# The liveness frames one pass sends at least (`AgentLink._liveness`).
LIVENESS_BURST = 64
# Gate 2 of each agent, read in C: `_count` runs over the table every second.
_ROUTABLE = operator.attrgetter("routable")


class StreamBroken(Exception):
    """The agent's answer stopped part way (agent gone, backend failed mid-stream)."""


@dataclass
class LinkSettings:
    secret: bytes
    heartbeat_interval: float
    unhealthy_after: float
    remove_after: float
    router_peer_id: str
    release_stream_slot_at_head: bool = True
    # --health-check-interval: the longest pause between passes over the table.
    health_check_interval: float = 1.0
    unjoined: UnjoinedLimits = field(default_factory=UnjoinedLimits)
    # `--workers`: the host's other router processes, named in the welcome.
    workers: list[dict] = field(default_factory=list)
    # --jwt-secret-previous-file: still accepted while agents move to `secret`.
    previous_secret: bytes = b""
    # --metrics-compat upstream: keep the engine's histograms a heartbeat carries
    # (`engine.upstream`); otherwise nothing reads them, so they are not checked.
    engine_upstream: bool = False

    @property
    def liveness_interval(self) -> float:
        """How long an idle session may go without a frame from the router.

        A frame sent costs the router about as much CPU as an agent heartbeat it
        receives, most of it the socket write, so on an idle session the router speaks
        once per six of the agent's periods instead of once per period (bench.fleet:
        17 to 8 percent of a core for 1,000 agents, with the lean yamux paths). An agent still
        notices a frozen router by its silence, and a dead host or network sooner, by
        TCP (agent/link.py).
        """
        return LIVENESS_PERIODS * self.heartbeat_interval


_AGENT = Role.AGENT
# The agent's moves, looked up on each frame without a call (a third of the cost of a
# chunk's dispatch went to the calls).
_SESSION_MOVES = SESSION_TRANSITIONS[_AGENT]
_ANSWER_MOVES = REQUEST_TRANSITIONS[_AGENT]
_NO_MOVES: dict[str, SessionState] = {}
_JOINED = SessionState.JOINED
_BODY = RequestState.BODY
_DONE = RequestState.DONE
_FAILED = RequestState.FAILED
# An empty body part: has a relay write what its sink could not.
_FLUSH: dict = {"type": m.RESPONSE_CHUNK, "data": b""}

# An answer frame and the request state it moved the request to; when that is FAILED,
# what the try failed with is the request's `failure`.
Answer = tuple[RequestState, dict]
_NO_FRAME: dict = {}

# RFC 9110 field names and values this router's HTTP server can send (it refuses the
# rest when it writes the head, after the try was counted a success): a token, and
# visible characters or obs-text with single spaces or tabs between them.
_FIELD_NAME = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"(?:[^\x00-\x20\x7f]+(?:[ \t]+[^\x00-\x20\x7f]+)*)?")


# Every value at once, joined by line feeds (which no good value holds): one regular
# expression a head instead of one a header.
_FIELD_VALUES = re.compile(rf"{_FIELD_VALUE.pattern}(?:\n{_FIELD_VALUE.pattern})*")
# Header names seen good, per link, at most this many (engines send a handful).
MAX_KNOWN_NAMES = 256


def unsendable_head(
    status: int, headers: dict[str, str], known: set[str] | None = None
) -> str | None:
    """Why a response head from an agent cannot go to an HTTP client, or None.
    `known`: names already found good, kept (bounded) for the next heads."""
    if not 200 <= status <= 599:
        return f"status {status} is not a final status (200-599)"
    joined = "\n".join(headers.values())
    if (
        joined.count("\n") == len(headers) - 1
        and _FIELD_VALUES.fullmatch(joined) is not None
        and ((known is not None and known.issuperset(headers)) or _good_names(headers, known))
    ):
        return None
    for name, value in headers.items():  # the first fault, in the head's order
        if _FIELD_NAME.fullmatch(name) is None:
            return f"header name {name[:80]!r} is not a token"
        if _FIELD_VALUE.fullmatch(value) is None:
            return f"header {name!r} has a value with control characters: {value[:80]!r}"
    return None


def _good_names(headers: dict[str, str], known: set[str] | None) -> bool:
    """Every name a token; those found good are kept in `known`, within its bound."""
    for name in headers:
        if _FIELD_NAME.fullmatch(name) is None:
            return False
        if known is not None and len(known) < MAX_KNOWN_NAMES:
            known.add(name)
    return True


class _Pending:
    """One request's answer frames in arrival order, for its one consuming task.

    A memory channel per request cost the router 4% of its CPU at 64 clients; this is
    a queue and the waiting task, no more. `state` is the request's place in the
    conversation (protocol/conversation.py), moved by the session's reader.
    """

    __slots__ = ("_task", "failure", "frames", "req_id", "rid", "sink", "state")

    def __init__(self, req_id: int, rid: str = "-") -> None:
        self.req_id = req_id
        self.rid = rid  # the request's X-Request-ID, for the log lines about it
        self.state = RequestState.AWAITING_HEAD
        self.failure: ForwardFailure | None = None
        self.frames: deque[Answer] = deque()
        self._task: trio.lowlevel.Task | None = None
        # Set by the consuming task while it relays a stream's body: writes the body
        # parts that arrive while that task waits for one, so that they need not wake
        # it (AgentSession.write_held). False: taken, but the task must write next.
        self.sink: Callable[[bytes], bool] | None = None

    def __repr__(self) -> str:
        waiting = ", a task waiting" if self._task is not None else ""
        return f"<_Pending id={self.req_id} {self.state.name}, {len(self.frames)} queued{waiting}>"

    def put(self, item: Answer) -> None:
        self.frames.append(item)
        task, self._task = self._task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    def fail(self, failure: ForwardFailure) -> None:
        """The request ends with `failure`, after the frames queued before it."""
        if self.failure is None:
            self.failure = failure
            self.state = _FAILED
            self.put((_FAILED, _NO_FRAME))

    async def get(self) -> Answer:
        if not self.frames:
            self._task = trio.lowlevel.current_task()

            def abort(_: Any) -> trio.lowlevel.Abort:
                self._task = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        return self.frames.popleft()


class AgentSession:
    """One agent's stream: its place in the conversation and its live requests.

    Out-of-order session messages (anything before the hello, a second hello) end the
    session. An answer frame out of order for its request (a second head, a chunk
    before the head) fails that request as backend_error and cancels it on the agent;
    the session and its other requests go on. Frames for an id that is not live are
    the tail of a request this router already finished or cancelled, and are dropped.
    """

    def __init__(
        self,
        link: AgentLink,
        fs: FramedStream,
        remote_peer: str,
        unjoined: tuple[int, str] | None = None,
    ) -> None:
        self.link = link
        self.fs = fs
        self.remote_peer = remote_peer
        # (connection, source address) while counted among the unjoined sessions.
        self.unjoined = unjoined
        self.peer: Peer | None = None
        self.state = SessionState.AWAITING_HELLO
        self._moves = _SESSION_MOVES[self.state]
        self.pending: dict[int, _Pending] = {}
        self.next_id = 1
        # The run's clock, read without trio.current_time()'s two calls around it: it
        # is read for every frame.
        self._clock = trio.lowlevel.current_clock().current_time
        self.last_rx = self._clock()
        # Set when the link's reader calls `write_held` before each socket read: a
        # waiting relay's parts are then held until all that one read brought is in,
        # and leave joined. Otherwise, and while this session's frames still come from
        # its own reading task (`fs.direct`: not yet from the muxer's, which makes the
        # call), each is written as it comes.
        self.batched = False
        self.held: list[_Pending] = []
        self.hello_seen = trio.Event()
        self.refused: str | None = None
        self.remote_addr = ""
        # The JWT secret the hello's token was signed with: retired, the session ends.
        self.secret = b""
        self._handlers = {
            m.HELLO: self._on_hello,
            m.HEARTBEAT: self._on_heartbeat,
            m.DRAIN: self._on_drain,
            m.RESPONSE_HEAD: self._on_answer,
            m.RESPONSE_CHUNK: self._on_answer,
            m.RESPONSE_END: self._on_answer,
            m.RESPONSE: self._on_answer,
            m.ERROR: self._on_answer,
        }

    def __repr__(self) -> str:
        return (
            f"<AgentSession peer={self.remote_peer} {self.state.name}, "
            f"{len(self.pending)} live requests, next id {self.next_id}, "
            f"{'closed' if self.fs.closed.is_set() else 'open'}>"
        )

    def on_message(self, msg: dict) -> None:
        self.last_rx = self._clock()
        kind = msg["type"]
        state = self._moves.get(kind)
        if state is None:
            raise session_error(_AGENT, self.state, kind)
        if state is not self.state:
            self._enter(state)
        self._handlers[kind](msg)

    def _enter(self, state: SessionState) -> None:
        self.state = state
        self._moves = _SESSION_MOVES.get(state, _NO_MOVES)

    def _on_hello(self, msg: dict) -> None:
        self.link.admit(self, msg)

    def write_held(self) -> None:
        """Write the parts held for relays that still wait (`batched`), each relay's
        joined in one write. A relay woken since (its end came, or a failure, or a
        cancel) finds its held parts first in its queue."""
        held = self.held
        if not held:
            return
        self.held = []
        for pending in held:
            frames = pending.frames
            if pending._task is None or pending.sink is None or not frames:
                continue
            if len(frames) == 1:
                data = frames[0][1]["data"]
            else:
                data = b"".join([frame["data"] for _, frame in frames])
            frames.clear()
            self._hand_over(pending, data)

    def _hand_over(self, pending: _Pending, data: bytes) -> None:
        """`data` to `pending`'s sink, the relay woken when it must write next. This
        runs in the link's reader, where an exception would end the agent's session
        and every request on it: a sink that fails is dropped and the part goes to
        the relay, whose own write then fails its request alone."""
        try:
            if pending.sink(data):  # type: ignore[misc]  # set: the callers checked
                return
            frame = _FLUSH
        except Exception:
            log.exception("req=%s relay_sink_failed peer=%s", pending.rid, self.remote_peer)
            pending.sink = None
            frame = {"type": m.RESPONSE_CHUNK, "data": data}
        pending.put((_BODY, frame))

    def _on_heartbeat(self, msg: dict) -> None:
        peer = self.peer
        if peer is not None and "backend_healthy" in msg:
            self.link.heartbeat(peer, msg, self.last_rx)
            # An agent that does not count across routers says nothing: none elsewhere.
            # The count as it stands, what nearly every heartbeat says, changes nothing
            # (it is within report_elsewhere's bounds already).
            reported = msg.get("elsewhere", 0)
            if type(reported) is not int or reported != peer.elsewhere:
                self._elsewhere(reported, False)

    def _on_drain(self, msg: dict) -> None:
        peer = self.peer
        # Draining lasts until the session ends: a drain repeated changes nothing, and
        # logs nothing (an agent could send thousands a second).
        if peer is not None and not peer.draining:
            peer.draining = True
            log.info("agent_draining peer=%s", peer.peer_id)
            self.link.table.changed(peer.metadata.model)

    def _on_answer(self, msg: dict) -> None:
        req_id = msg["id"]
        pending = self.pending.get(req_id)
        if pending is None:
            return
        kind = msg["type"]
        state = _ANSWER_MOVES[pending.state].get(kind)
        if state is None:
            exc = request_error(pending.state, kind)
            log.warning(
                "req=%s agent_out_of_step peer=%s id=%d reason=%s",
                pending.rid,
                self.remote_peer,
                req_id,
                quote(str(exc)),
            )
            pending.fail(ForwardFailure(ErrorCode.BACKEND_ERROR, f"agent out of step: {exc}"))
            self.finish(req_id, cancel=True)
            return
        if state is _FAILED:
            code = _code(msg["code"])
            if code is None:
                log.warning(
                    "req=%s agent_bad_code peer=%s id=%d code=%s",
                    pending.rid,
                    self.remote_peer,
                    req_id,
                    quote(msg["code"][:80]),
                )
                code = ErrorCode.BACKEND_ERROR
            full = code is ErrorCode.AGENT_FULL
            if full or "elsewhere" in msg:
                self._elsewhere(msg.get("elsewhere"), full)
            message = msg["message"][:MAX_ERROR_MESSAGE]
            pending.fail(ForwardFailure(code, message, status=msg.get("status")))
        else:
            pending.state = state
            if state is _BODY and pending.sink is not None and pending._task is not None:
                # A waiting relay's part goes out without a pass of its task: held for
                # the end of this read, as its task would have joined it, or now.
                if self.batched and self.fs.direct:
                    if not pending.frames:
                        self.held.append(pending)
                    pending.frames.append((state, msg))
                    return
                if not pending.frames:
                    self._hand_over(pending, msg["data"])
                    return
            elif state is _DONE and "elsewhere" in msg:
                self._elsewhere(msg["elsewhere"], False)
            pending.put((state, msg))

    def _elsewhere(self, value: object, full: bool) -> None:
        peer = self.peer
        if peer is not None and report_elsewhere(peer, value, full):
            self.link.table.changed(peer.metadata.model)

    def admitted(self) -> None:
        """The router sent its welcome: the agent may send frames of any size now."""
        self._enter(next_session_state(Role.ROUTER, self.state, m.WELCOME))
        self.fs.allow_frames(MAX_FRAME_BYTES)
        self.link.release_unjoined(self)

    def refuse(self) -> None:
        self._enter(next_session_state(Role.ROUTER, self.state, m.REFUSAL))

    def open(self, rid: str = "-") -> tuple[int, _Pending]:
        req_id = self.next_id
        self.next_id += 1
        pending = self.pending[req_id] = _Pending(req_id, rid)
        return req_id, pending

    def finish(self, req_id: int, cancel: bool) -> None:
        if self.pending.pop(req_id, None) is not None and cancel and not self.fs.closed.is_set():
            with contextlib.suppress(SessionClosed):
                self.fs.send_nowait(m.cancel(req_id))

    def fail_all(self, reason: str) -> None:
        failure = ForwardFailure(
            ErrorCode.AGENT_DISCONNECTED,
            f"agent session closed: {reason}",
            connection_level=True,
        )
        for pending in self.pending.values():
            if next_request_state(_AGENT, pending.state, SESSION_END) is _FAILED:
                pending.fail(failure)
        self.pending.clear()


class AgentResponse:
    """A successful answer from an agent: head now, body as it arrives."""

    def __init__(
        self,
        session: AgentSession,
        req_id: int,
        pending: _Pending,
        status: int,
        headers: dict[str, str],
        slot: Slot,
    ) -> None:
        self.session = session
        self.req_id = req_id
        self.pending = pending
        self.status = status
        self.headers = headers
        self.slot = slot
        self.done = False
        # The engine's token count, when the agent was asked for it (response_end).
        self.usage: dict[str, int] | None = None

    def __repr__(self) -> str:
        return (
            f"<AgentResponse id={self.req_id} status={self.status} "
            f"{self.pending.state.name}, {len(self.pending.frames)} queued, "
            f"{'done' if self.done else 'open'}>"
        )

    async def parts(self) -> AsyncIterator[tuple[bytes, bool]]:
        """The body as it arrives, and whether its end has arrived too (`last`).

        Chunks that arrive together leave together: the body frames already queued
        behind the one awaited (one socket read from the agent often brings several)
        are joined into one part, so the client's socket takes one write for them, and
        `last` lets the caller end its answer in that same write.
        """
        try:
            frames = self.pending.frames
            while (data := await self._next_part()) is not None:
                yield data, bool(frames) and frames[0][0] is _DONE
        finally:
            self.close()

    async def read_all(self) -> bytes:
        """The whole body; StreamBroken past MAX_WHOLE_ANSWER. Not through `parts`: an
        async generator costs trio's hooks a weak reference set entry per answer."""
        try:
            body = []
            size = 0
            while (data := await self._next_part()) is not None:
                size += len(data)
                if size > MAX_WHOLE_ANSWER:
                    raise StreamBroken(
                        f"{ErrorCode.BACKEND_ERROR}: a whole answer over {MAX_WHOLE_ANSWER} bytes"
                    )
                body.append(data)
            return b"".join(body)
        finally:
            self.close()

    async def _next_part(self) -> bytes | None:
        """The next body bytes, the queued ones joined; None at the end."""
        state, frame = await self.pending.get()
        if state is _BODY:
            data = frame["data"]
            frames = self.pending.frames
            if frames and frames[0][0] is _BODY:
                joined = [data]
                while frames and frames[0][0] is _BODY:
                    joined.append(frames.popleft()[1]["data"])
                data = b"".join(joined)
            return data
        self.done = True
        if state is _DONE:
            self._ended(frame)
            return None
        failure = self.pending.failure
        assert failure is not None  # FAILED is queued by `fail` only
        raise StreamBroken(f"{failure.code}: {failure.message}")

    def _ended(self, frame: dict) -> None:
        raw = frame.get("usage")
        self.usage = usage = valid_usage(raw)
        peer = self.session.peer
        if usage is None and raw is not None:
            # Charged to nobody: a count out of shape or range is the agent's fault.
            log.warning(
                "req=%s agent_bad_usage peer=%s id=%d usage=%s",
                self.pending.rid,
                self.session.remote_peer,
                self.req_id,
                quote(repr(raw)[:200]),
            )
        elif usage is not None and peer is not None:
            peer.stats.record_tokens(usage[PROMPT], usage[COMPLETION])

    def close(self) -> None:
        """Release the slot and, if the answer is unfinished, tell the agent to stop."""
        if not self.done:
            # A client may leave as soon as it has the last event (the SDKs stop at
            # `[DONE]`): an end that already arrived still brings the engine's usage.
            for state, frame in self.pending.frames:
                if state is _DONE:
                    self.done = True
                    self._ended(frame)
        self.pending.sink = None
        self.slot.release()
        self.session.finish(self.req_id, cancel=not self.done)
        self.done = True


class AgentLink:
    def __init__(
        self,
        table: PeerTable,
        metrics: RouterMetrics,
        settings: LinkSettings,
        registrations: RegistrationFeed | None = None,
        lifetime: LifetimeStore | None = None,
    ) -> None:
        self.table = table
        self.metrics = metrics
        self.settings = settings
        self.registrations = registrations or RegistrationFeed()
        self.lifetime = lifetime
        self.sessions: dict[Peer, AgentSession] = {}
        self.unjoined = Unjoined(settings.unjoined)
        self.header_names: set[str] = set()  # names of agents' heads found good

    def __repr__(self) -> str:
        return f"<AgentLink {len(self.sessions)} sessions, {self.unjoined!r}>"

    # --- sessions -------------------------------------------------------------------

    async def handle_stream(self, stream: Any) -> None:
        """libp2p stream handler. Never lets an exception escape (it would wedge the
        connection in py-libp2p 0.8.1)."""
        try:
            await self._serve(stream)
        except Exception:
            log.exception("session_error")

    async def _serve(self, stream: Any) -> None:
        conn = stream.muxed_conn
        remote = str(conn.peer_id)
        endpoint = remote_endpoint(stream)
        source = source_of(endpoint)
        refusal = self.unjoined.enter(id(conn), source)
        if refusal is not None:
            log.warning(
                "session_refused_before_hello peer=%s source=%s reason=%s",
                remote,
                source,
                quote(refusal),
            )
            self.metrics.sessions_refused.labels("unjoined limit").inc()
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(1),
                contextlib.suppress(Exception),
            ):
                await stream.reset()
            return
        # Requests queued during a batch of trio's scheduler leave when it ends, one write
        # per agent, without a wake of the session's writer task per batch: router CPU
        # per whole answer 0.146 against 0.153 ms at 64 clients (`bench.stream_relay
        # --whole --against`, 4 rounds, load average 6.8; with the span and clock cuts
        # of the commit before). The loop watch's instrument already has trio call its
        # hooks each turn, so the batch's end adds one call a turn.
        fs = FramedStream(
            stream, max_frame_bytes=self.settings.unjoined.frame_bytes, write_at_batch_end=True
        )
        session = AgentSession(self, fs, remote, (id(conn), source))
        session.remote_addr = format_endpoint(endpoint)
        reason = "cancelled"
        unhook = before_reads(stream, session.write_held)
        session.batched = unhook is not None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keepalive, session)
                reason = await fs.run(session.on_message)
                nursery.cancel_scope.cancel()
        finally:
            if unhook is not None:
                unhook()
            self.release_unjoined(session)
            self._closed(session, reason)

    def release_unjoined(self, session: AgentSession) -> None:
        """The session no longer counts among the unjoined (welcomed, or gone)."""
        if session.unjoined is not None:
            self.unjoined.leave(*session.unjoined)
            session.unjoined = None

    async def _keepalive(self, session: AgentSession) -> None:
        fs = session.fs
        with trio.move_on_after(HELLO_TIMEOUT):
            await session.hello_seen.wait()
        if session.refused is not None:
            await fs.flush_and_close(f"refused: {session.refused}")
            return
        if session.peer is None and not fs.closed.is_set():
            fs.close("no hello within 10s")
        # Past the hello, liveness is `sweep`'s: one task for all sessions.

    def admit(self, session: AgentSession, msg: dict) -> None:
        """Check a hello; refuse with the reason, or put the agent in the table."""
        try:
            secrets = (self.settings.secret, self.settings.previous_secret)
            session.secret = verify_with(secrets, msg["token"], session.remote_peer)
            meta = parse_metadata(msg["metadata"])
            challenge = msg.get("challenge")
            if challenge is not None and len(challenge) > MAX_CHALLENGE:
                raise ValueError(f"challenge longer than {MAX_CHALLENGE} characters")
        except (TokenError, ValueError) as exc:
            # Both are partly the peer's own text (a token's header, a model's name).
            reason = str(exc)[: m.MAX_REFUSAL]
            log.warning("agent_refused peer=%s reason=%s", session.remote_peer, quote(reason))
            # A fixed label: a peer needs no secret to choose its refusal's text.
            label = exc.kind if isinstance(exc, TokenError) else "metadata"
            self.metrics.sessions_refused.labels(label).inc()
            session.refuse()
            session.fs.send_nowait(m.refusal(reason))
            session.refused = reason
            session.hello_seen.set()
            return
        now = trio.current_time()
        peer = Peer(
            peer_id=session.remote_peer,
            metadata=meta,
            send=session.fs.send,
            connected_at=now,
            last_seen=now,
            remote_addr=session.remote_addr,
        )
        old = self.table.get(peer.peer_id)
        restored = self.lifetime.restore(peer.peer_id) if self.lifetime else None
        if restored is not None:
            peer.stats = restored
        if old is not None:
            peer.stats = old.stats
            stale = self.sessions.pop(old, None)
            if stale is not None:
                stale.fs.close("replaced by a new session of the same agent")
        session.peer = peer
        self.sessions[peer] = session
        self.table.add(peer)
        session.admitted()
        welcome = m.welcome(
            self.settings.heartbeat_interval,
            self.settings.router_peer_id,
            self.settings.liveness_interval,
            self.settings.workers,
            (m.RESPONSE,),
        )
        if challenge is not None:
            welcome["proof"] = router_proof(
                session.secret, self.settings.router_peer_id, session.remote_peer, challenge
            )
        session.fs.send_nowait(welcome)
        session.hello_seen.set()
        self._count()
        self.registrations.publish(registration("registered", peer))
        log.info(
            "agent_joined peer=%s model=%s capability=%s engine=%s capacity=%d",
            peer.peer_id,
            quote(meta.model),
            meta.capability,
            quote(meta.engine),
            meta.capacity,
        )

    def _closed(self, session: AgentSession, reason: str) -> None:
        session.fail_all(reason)
        peer = session.peer
        if peer is None:
            log.warning(
                "session_closed_before_join peer=%s reason=%s", session.remote_peer, quote(reason)
            )
            return
        if self.sessions.get(peer) is session:
            del self.sessions[peer]
            peer.stats.disconnections += 1
            # A session replaced by the same agent's newer one is no unregistration.
            self.registrations.publish(registration("unregistered", peer))
        peer.connected = False
        peer.healthy = False
        # What the agent said the other routers hold dies with its session: no report
        # will correct it, and the record would show that load until it is removed.
        report_elsewhere(peer, 0)
        self.table.changed(peer.metadata.model)
        self._count()
        log.info("agent_disconnected peer=%s reason=%s", peer.peer_id, quote(reason))

    def heartbeat(self, peer: Peer, msg: dict, now: float | None = None) -> None:
        """`now`: when the session read the frame, if it read the clock already."""
        if now is None:
            now = trio.current_time()
        peer.last_seen = now
        was = peer.routable
        peer.healthy = True
        backend_healthy = bool(msg["backend_healthy"])
        if peer.backend_healthy != backend_healthy:
            # Gate 2 drops or takes back the agent on its engine's word alone: say so on
            # the router, where the routing decisions are read.
            if backend_healthy:
                log.info(
                    "agent_backend_healthy peer=%s model=%s",
                    peer.peer_id,
                    quote(peer.metadata.model),
                )
            else:
                peer.stats.backend_failures += 1
                log.warning(
                    "agent_backend_unhealthy peer=%s model=%s",
                    peer.peer_id,
                    quote(peer.metadata.model),
                )
        peer.backend_healthy = backend_healthy
        engine = msg.get("engine")
        if engine:
            peer.engine = _floats(engine, ENGINE_FIELDS)
            peer.engine_at = now - _age(engine)
            peer.engine_interval = _interval(engine, peer.engine_interval)
            peer.preemptions = preemptions_of(engine)
            if self.settings.engine_upstream and "upstream" in engine:
                peer.engine_upstream = upstream_of(engine)
        hardware = msg.get("hardware")
        if hardware:
            peer.hardware = _floats(hardware, HARDWARE_FIELDS)
            peer.hardware_at = now - _age(hardware)
            peer.hardware_interval = _interval(hardware, peer.hardware_interval)
            peer.gpus = gpus_of(hardware)
            peer.memory = memory_of(hardware)
        if peer.routable != was:
            self.table.changed(peer.metadata.model)
            self._count()

    async def sweep(self) -> None:
        """Keep sessions alive and mark silent agents unhealthy, then forget them."""
        s = self.settings
        # Heartbeats leave within a quarter period of falling due.
        table_period = min(s.health_check_interval, s.unhealthy_after / 3)
        period = min(table_period, s.heartbeat_interval / 4)
        last_table_sweep = trio.current_time()
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            self._liveness(now, period)
            if now - last_table_sweep >= table_period:
                last_table_sweep = now
                self._sweep_table(now)

    def _liveness(self, now: float, period: float = 1.0) -> None:
        """A frozen agent (or a black-holed network, which libp2p never notices) ends
        its session after --unhealthy-after; the agent hears from the router at least
        once per liveness interval, or a few passes (`period` apart) later when more
        fell due at once than a pass sends."""
        interval = self.settings.liveness_interval
        limit = self.settings.unhealthy_after
        # Sessions that joined together (a router restarted) fall due together, every
        # interval: 1,000 frames, and as many writers woken, in one turn of the loop
        # (bench.fleet). A pass sends twice its share of the interval's frames, and the
        # rest go in the next passes: spread so, they stay spread. An agent waits
        # SILENT_PERIODS (3) intervals before it gives the router up.
        budget = max(LIVENESS_BURST, math.ceil(2 * len(self.sessions) * period / interval))
        for session in list(self.sessions.values()):
            fs = session.fs
            silent = now - session.last_rx > limit
            # Most sessions, every second, need nothing: two comparisons, no call.
            if not silent and now - fs.last_tx < interval:
                continue
            if fs.closed.is_set():
                continue
            if silent:
                fs.close(f"link heartbeat timeout: silent for more than {limit:g}s")
            elif budget > 0:
                budget -= 1
                # Requests that went out already told the agent the router is alive.
                with contextlib.suppress(SessionClosed):
                    fs.send_nowait(m.heartbeat(time.time()))

    def _sweep_table(self, now: float) -> None:
        s = self.settings
        remove_after, unhealthy_after = s.remove_after, s.unhealthy_after
        quiet = min(remove_after, unhealthy_after)
        for peer in self.table.all():
            silent = now - peer.last_seen
            if silent <= quiet:  # heard from lately, as nearly every agent is
                continue
            if silent > remove_after:
                self.table.remove(peer)
                if self.lifetime is not None:
                    self.lifetime.retire(peer)
                session = self.sessions.pop(peer, None)
                if session is not None:
                    session.fs.close(f"no heartbeat for {silent:.0f}s")
                    self.registrations.publish(registration("unregistered", peer))
                log.info("agent_removed peer=%s silent_s=%.1f", peer.peer_id, silent)
            elif silent > unhealthy_after and peer.healthy:
                peer.healthy = False
                peer.stats.agent_failures += 1
                log.warning("agent_unhealthy peer=%s silent_s=%.1f", peer.peer_id, silent)
        self._count()

    def _count(self) -> None:
        self.metrics.agents_connected.set(len(self.sessions))
        self.metrics.agents_healthy.set(sum(map(_ROUTABLE, self.table.all())))

    def retire_secrets(self) -> int:
        """End the sessions whose token was signed by a secret no longer accepted (a
        rotation's last step); their agents reconnect and are refused until re-keyed."""
        accepted = {self.settings.secret, self.settings.previous_secret} - {b""}
        retired = [s for s in self.sessions.values() if s.secret not in accepted]
        for session in retired:
            session.fs.close("JWT secret retired: restart the agent with the new secret")
        return len(retired)

    def close_all(self, reason: str) -> None:
        for session in list(self.sessions.values()):
            session.fs.close(reason)

    # --- forwarding -----------------------------------------------------------------

    async def forward(
        self, peer: Peer, req: RouteRequest, slot: Slot
    ) -> AgentResponse | ForwardFailure:
        session = self.sessions.get(peer)
        if session is None or session.fs.closed.is_set():
            return ForwardFailure(
                ErrorCode.AGENT_DISCONNECTED, "agent session is gone", connection_level=True
            )
        if req.span is NULL_SPAN:  # untraced: no span to open, nor its attributes
            return await self._forward(session, peer, req, slot, NULL_SPAN)
        with req.span.child("forward", {"hivenet.peer_id": peer.peer_id}) as span:
            result = await self._forward(session, peer, req, slot, span)
            if isinstance(result, ForwardFailure):
                span.fail(str(result.code))
            else:
                span.set("http.response.status_code", result.status)
            return result

    async def _forward(
        self, session: AgentSession, peer: Peer, req: RouteRequest, slot: Slot, span: Span
    ) -> AgentResponse | ForwardFailure:
        req_id, pending = session.open(req.request_id)
        try:
            session.fs.send_nowait(
                m.request(
                    req_id,
                    req.method,
                    req.path,
                    req.headers,
                    req.body,
                    req.stream,
                    req.report_usage,
                    span.traceparent() or req.traceparent,
                    req.stream_tokens,
                )
            )
        except SessionClosed as exc:
            session.finish(req_id, cancel=False)
            return ForwardFailure(ErrorCode.AGENT_DISCONNECTED, str(exc), connection_level=True)
        # The round trip counts from the frame's queueing, as the overhead metric ends.
        clock = session._clock  # the run's clock, without trio.current_time()'s two calls
        req.sent_at = started = clock()
        try:
            state, head = await pending.get()
            if state is _FAILED:
                session.finish(req_id, cancel=False)
                failure = pending.failure
                assert failure is not None  # FAILED is queued by `fail` only
                return failure
            peer.stats.record_rtt((clock() - started) * 1000.0)
            status, headers = head["status"], head["headers"]
            problem = unsendable_head(status, headers, self.header_names)
            if problem is not None:
                # Sent on, the client would get no answer at all and the try would
                # count as a success: this agent's try fails instead.
                session.finish(req_id, cancel=True)
                log.warning(
                    "req=%s agent_bad_head peer=%s id=%d reason=%s",
                    req.request_id,
                    peer.peer_id,
                    req_id,
                    quote(problem),
                )
                return ForwardFailure(
                    ErrorCode.BACKEND_ERROR,
                    f"agent sent a response head the router cannot send: {problem}",
                )
            if state is _DONE:
                # A `response`, the whole answer at once: its body and end are queued
                # as a head's would be, for the one path that reads answers.
                pending.frames.appendleft((_DONE, head))
                pending.frames.appendleft((_BODY, {"data": head["body"]}))
            if status >= 400:
                return await self._failed_answer(
                    session, req_id, pending, status, headers, req.path
                )
        except BaseException:
            session.finish(req_id, cancel=True)
            raise
        response = AgentResponse(session, req_id, pending, status, headers, slot)
        if req.stream and self.settings.release_stream_slot_at_head:
            slot.release()
        return response

    async def _failed_answer(
        self,
        session: AgentSession,
        req_id: int,
        pending: _Pending,
        status: int,
        headers: dict[str, str],
        path: str,
    ) -> ForwardFailure:
        body = bytearray()
        state = _BODY
        while state is _BODY and len(body) <= MAX_ERROR_BODY:
            state, frame = await pending.get()
            if state is _BODY:
                body += frame["data"]
        # Past MAX_ERROR_BODY the rest is not read, and the agent is told to stop unless
        # its end is already here (a whole answer's comes in the same frame).
        frames = pending.frames
        ended = state is not _BODY or (bool(frames) and frames[0][0] is not _BODY)
        session.finish(req_id, cancel=not ended)
        code = classify_backend_status(status, bytes(body)) or ErrorCode.BACKEND_ERROR
        text = bytes(body[:MAX_ERROR_MESSAGE]).decode("utf-8", "replace")
        if path in API_PATHS and route_missing(status, bytes(body)):
            # The engine's own 404 for the route, relayed by an agent that does not
            # say `endpoint_not_supported` itself (an older build): the same verdict.
            return ForwardFailure(
                ErrorCode.ENDPOINT_NOT_SUPPORTED,
                f"engine does not serve {path} (it answered 404: {text})",
                status=status,
            )
        return ForwardFailure(
            code,
            f"backend answered {status}: {text}",
            status=status,
            body=bytes(body),
            headers=headers,
        )


def _code(value: str) -> ErrorCode | None:
    """The code of an agent's error frame, when an agent may send it."""
    return ErrorCode(value) if value in AGENT_CODES else None


_INF = math.inf


def _floats(values: dict, fields: tuple[str, ...]) -> dict[str, float | None]:
    # This runs for twelve fields on every agent heartbeat: msgpack's floats, nearly
    # every value, are tested in place (NaN fails both comparisons), the rest by
    # _finite.
    out: dict[str, float | None] = {}
    for name in fields:
        v = values.get(name)
        if type(v) is float:
            out[name] = v if -_INF < v < _INF else None
        elif v is None:  # a field this agent's engine does not report
            out[name] = None
        else:
            out[name] = _finite(v)
    return out


def _finite(value: object) -> float | None:
    """A number from a heartbeat; NaN and the infinities are unknown, as a missing
    value is (msgpack carries them; JSON, where the routing table shows them, cannot)."""
    # A tuple, not `int | float`, which builds a union on every call (a third slower).
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number):
            return number
    return None


def _age(values: dict) -> float:
    age = values.get("age")
    if type(age) is float:  # as the agent sends it, tested in place
        return age if 0.0 <= age < _INF else 0.0
    age = _finite(age)
    return age if age is not None and age >= 0 else 0.0


def _interval(values: dict, default: float) -> float:
    iv = values.get("interval")
    if type(iv) is float:
        return iv if 0.0 < iv < _INF else default
    iv = _finite(iv)
    return iv if iv is not None and iv > 0 else default


def parse_metadata(raw: dict) -> AgentMetadata:
    """Validate the hello's metadata; ValueError names the bad field."""

    def text(name: str, required: bool = False) -> str:
        v = raw.get(name, "")
        if v is None:
            v = ""
        if not isinstance(v, str):
            raise ValueError(f"metadata.{name} must be a string")
        if required and not v:
            raise ValueError(f"metadata.{name} is required")
        return v

    capacity = raw.get("capacity")
    if not isinstance(capacity, int) or isinstance(capacity, bool):
        raise ValueError("metadata.capacity must be an integer")
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    capability = text("capability", required=True)
    if capability not in CAPABILITIES:
        raise ValueError(f"metadata.capability {capability!r} is not one of {CAPABILITIES}")
    tags = raw.get("tags") or []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError("metadata.tags must be a list of strings")
    return AgentMetadata(
        model=text("model", required=True),
        capability=capability,
        engine=text("engine"),
        capacity=capacity,
        region=text("region"),
        organization=text("organization"),
        machine=text("machine"),
        gpu_model=text("gpu_model"),
        tags=tuple(tags),
        version=text("version"),
        deployment_id=text("deployment_id"),
        replica_id=text("replica_id"),
        hide_llm=raw.get("hide_llm") is True,
        llm_pretty_name=text("llm_pretty_name"),
        llm_info=text("llm_info"),
    )
