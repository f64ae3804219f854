"""The agent's side of the link: dial, hello, heartbeats, requests, reconnects."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from agent.capacity import SharedCapacity
from agent.dial_errors import describe
from agent.engine_http import EnginePool, ReadLimits
from agent.forward import forward, request_id
from agent.router_identity import RouterAddress, dial_addrs, learn_peer_id, parse_router
from protocol import messages as m
from protocol.conversation import (
    REQUEST_TRANSITIONS,
    RequestState,
    Role,
    SessionState,
    next_request_state,
    next_session_state,
    open_request,
    request_error,
)
from protocol.errors import ErrorCode
from protocol.logs import quote
from protocol.p2p import FramedStream, SessionClosed, limit_unacknowledged
from protocol.tokens import issue_token
from protocol.tracing import NO_TRACER, NULL_SPAN, Tracer

log = logging.getLogger("agent")

CONNECT_TIMEOUT = 10.0
WELCOME_TIMEOUT = 10.0
# The router is declared frozen after this many of its liveness intervals of silence.
SILENT_PERIODS = 3
BACKOFF_START = 0.2
BACKOFF_CAP = 5.0
# A joined session that ended sooner than this is no reason to redial at once: two
# agents started on one identity file replace each other's session at the router, and
# redialing after each at BACKOFF_START made them trade it several times a second.
STABLE_SESSION = 2 * BACKOFF_CAP
# What is left of the connection after a session gets this long to close.
HANG_UP_TIMEOUT = 1.0
TOKEN_TTL = 3600.0
UNBOUNDED = 1 << 31


class Refused(Exception):
    """The router refused the hello; the reason is the router's."""


@dataclass
class Status:
    """What heartbeats report, kept current by the daemon's samplers."""

    backend_healthy: bool = False
    engine: dict[str, float | None] | None = None
    engine_at: float = 0.0
    engine_interval: float = 0.5
    hardware: dict[str, float | None] | None = None
    hardware_at: float = 0.0
    hardware_interval: float = 2.0
    changed: trio.Event | None = None
    draining: bool = False

    def heartbeat(self, confirm_period: float) -> dict:
        """`confirm_period`: the agent re-sends unchanged values at least this often and
        reports a change or a failed sampler at once, so a router may trust the values
        for three such periods after a heartbeat, as it trusts the sample's own age."""
        now = trio.current_time()
        engine = dict(self.engine or {})
        if engine:
            engine["age"] = now - self.engine_at
            engine["interval"] = max(self.engine_interval, confirm_period)
        hardware = dict(self.hardware or {})
        if hardware:
            hardware["age"] = now - self.hardware_at
            hardware["interval"] = max(self.hardware_interval, confirm_period)
        return m.heartbeat(time.time(), self.backend_healthy, engine, hardware)


_SEND_MOVES = REQUEST_TRANSITIONS[Role.AGENT]
# How often the session looks for engine reads past their deadline: a timeout ends a
# request up to this much after it (the drain after a stream's end waits 1 s).
READ_WATCH_PERIOD = 0.25


class _Served:
    """One request this agent serves: its place in the conversation, and its engine
    read timeouts, which the session watches (`_watch_reads`), for the scope that a
    cancel cancels (`limits.scope`, its worker's)."""

    __slots__ = ("counted", "limits", "state")

    def __init__(self, state: RequestState, limits: ReadLimits) -> None:
        self.state = state
        self.limits = limits
        self.counted = True  # holds one of the agent's capacity slots


class _Worker:
    """A task that serves a session's requests one after another, in one cancel scope.

    A task spawned and a scope entered and left per request cost some 10 µs of the
    agent's CPU a request; a worker that waits for the next request instead costs a
    wake-up. A cancelled scope stays cancelled, so a worker whose request was
    cancelled (the router's cancel, an engine's timeout) ends with that request, and
    the next request starts another."""

    __slots__ = ("job", "scope", "task")

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.task: trio.lowlevel.Task | None = None
        self.job: tuple[dict, _Served] | None = None


class RouterSession:
    """One session with one router over one stream.

    Messages out of order for the session (a request before the welcome, an answer
    frame from the router) end it. A request whose id is live already is refused with
    an error frame for that id, and the live request goes on untouched: the router
    that reused it broke the protocol, and whichever request it meant can only fail.
    """

    def __init__(
        self,
        stream: Any,
        hello: dict,
        status: Status,
        engine: EnginePool,
        heartbeat_interval: float,
        write_timeout: float,
        check_welcome: Callable[[dict], str | None] | None = None,
        tracer: Tracer = NO_TRACER,
        capacity: SharedCapacity | None = None,
        on_workers: Callable[[list[dict]], None] | None = None,
        serves: Callable[[str], bool] | None = None,
        missing: Callable[[str], None] | None = None,
    ) -> None:
        # `--stream-write-timeout 0` turns the limit off, as it does for the Go agent.
        self.fs = FramedStream(
            stream, write_timeout=write_timeout or math.inf, write_at_batch_end=True
        )
        # Why a welcome is not the router's (its secret proof), or None when it is.
        self.check_welcome = check_welcome
        self.tracer = tracer
        # The router speaks on an idle session only every few periods (its welcome
        # says how often); a dead router host or network is the kernel's to notice,
        # from this agent's own unacknowledged heartbeats.
        limit_unacknowledged(stream, SILENT_PERIODS * heartbeat_interval)
        self.hello = hello
        self.status = status
        self.engine = engine
        self.heartbeat_interval = heartbeat_interval
        self.welcomed = trio.Event()
        self.refusal: str | None = None
        # The run's clock, read without trio.current_time()'s two calls around it: it
        # is read for every frame and every read of a stream.
        self._clock = trio.lowlevel.current_clock().current_time
        self.last_rx = self._clock()
        self.router_interval = heartbeat_interval
        # The router's welcome `accepts` whole answers as one message (m.RESPONSE).
        self.whole_answers = False
        self.state = SessionState.AWAITING_HELLO
        self.requests: dict[int, _Served] = {}
        # A session on its own (tests, benches) counts only its own requests.
        self.capacity = capacity or SharedCapacity(UNBOUNDED)
        self.share = self.capacity.join(self._room)
        self.on_workers = on_workers
        # The engine adapter's capability check (agent/engines/endpoints.py), and what
        # learns a path the engine turns out to lack.
        self.serves = serves
        self.missing = missing
        self._nursery: trio.Nursery | None = None
        self._idle = trio.Event()
        # Workers waiting for a request, the most recently busy last.
        self._waiting: list[_Worker] = []
        self._watching = False  # `_watch_reads` runs
        self._handlers = {
            m.REQUEST: self._on_request,
            m.CANCEL: self._on_cancel,
            m.WELCOME: self._on_welcome,
            m.REFUSAL: self._on_refusal,
            m.HEARTBEAT: self._on_heartbeat,
        }

    def __repr__(self) -> str:
        return (
            f"<RouterSession {self.state.name}, {len(self.requests)} live requests, "
            f"{'closed' if self.fs.closed.is_set() else 'open'}>"
        )

    def send(self, msg: dict) -> None:
        # A closed session is ending; the router fails its requests itself. A `try`, not
        # contextlib.suppress: this runs for every frame, and the suppress object cost a
        # third more than the send it guards (0.64 of 1.8 µs).
        try:  # noqa: SIM105 - the reason is above
            self.fs.send_nowait(msg)
        except SessionClosed:
            pass

    async def run(self) -> str:
        self.state = next_session_state(Role.AGENT, self.state, m.HELLO)
        self.send(self.hello)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._keepalive)
                reason = await self.fs.run(self._on_message)
                nursery.cancel_scope.cancel()
        finally:
            self.capacity.leave(self.share)
        if self.refusal is not None:
            raise Refused(self.refusal)
        return reason

    def _on_message(self, msg: dict) -> None:
        self.last_rx = self._clock()
        kind = msg["type"]
        self.state = next_session_state(Role.ROUTER, self.state, kind)
        self._handlers[kind](msg)

    def _on_request(self, msg: dict) -> None:
        req_id = msg["id"]
        live = self.requests.get(req_id)
        try:
            state = open_request(live.state if live is not None else None)
        except m.ProtocolError as exc:
            log.warning(
                "req=%s router_out_of_step id=%d reason=%s",
                request_id(msg),
                req_id,
                quote(str(exc)),
            )
            self.send(m.error(req_id, ErrorCode.BACKEND_ERROR, f"agent refused: {exc}"))
            return
        if self.serves is not None and not self.serves(msg["path"]):
            # Before any work, like agent_full: the router tries an engine that serves it.
            engine = self.hello.get("metadata", {}).get("engine") or "unknown"
            why = f"engine {engine} does not serve {msg['path']}"
            self.send(m.error(req_id, ErrorCode.ENDPOINT_NOT_SUPPORTED, why, status=404))
            return
        if not self.capacity.try_take(self.share):
            # Before any work and with the id left free: the router selects again.
            self.send(
                m.error(
                    req_id,
                    ErrorCode.AGENT_FULL,
                    f"agent at capacity ({self.capacity.capacity} requests in flight)",
                    status=503,
                    elsewhere=self.capacity.elsewhere(self.share),
                )
            )
            return
        worker = self._waiting.pop() if self._waiting else _Worker()
        limits = ReadLimits(self.engine.timeouts.read, worker.scope, True, self._clock)
        served = self.requests[req_id] = _Served(state, limits)
        if worker.task is not None:  # one that waits for a request
            worker.job = (msg, served)
            trio.lowlevel.reschedule(worker.task)
        elif self._nursery is not None:
            if not self._watching:
                self._watching = True
                self._nursery.start_soon(self._watch_reads)
            self._nursery.start_soon(self._work, worker, msg, served)

    def _on_cancel(self, msg: dict) -> None:
        served = self.requests.get(msg["id"])
        if served is not None:
            served.state = next_request_state(Role.ROUTER, served.state, m.CANCEL)
            served.limits.scope.cancel()
            # The router counted the slot free when it cancelled, and its next request
            # may be in this same read: held until the cancelled task unwinds, the slot
            # made that one `agent_full`, and the router's queue went out of its order.
            self._give_back(served)

    def _on_welcome(self, msg: dict) -> None:
        why = self.check_welcome(msg) if self.check_welcome is not None else None
        if why is not None:
            self.refusal = why
            self.fs.close(f"refused: {why}")
            return
        interval = _positive(msg.get("liveness_interval")) or _positive(msg["heartbeat_interval"])
        self.router_interval = interval or self.heartbeat_interval
        self.whole_answers = m.RESPONSE in (msg.get("accepts") or ())
        workers = msg.get("workers")
        if workers and self.on_workers is not None:
            self.on_workers(workers)
        self.welcomed.set()
        log.info("router_joined router=%s", quote(str(msg.get("router_peer_id", ""))))

    def _on_refusal(self, msg: dict) -> None:
        # The router may not be the one this agent means to join (an address without
        # its peer ID): its words are logged, and only so many of them.
        self.refusal = msg["reason"][: m.MAX_REFUSAL]
        self.fs.close(f"refused: {self.refusal}")

    def _on_heartbeat(self, msg: dict) -> None:
        """The router's liveness frame: its arrival is all it says."""

    async def _work(self, worker: _Worker, msg: dict, served: _Served) -> None:
        scope = worker.scope
        with scope:
            while True:
                await self._serve(msg, served)
                if scope.cancel_called:
                    return
                msg, served = await self._next_job(worker)

    async def _watch_reads(self) -> None:
        """Cancel each request whose engine read is past its deadline (`ReadLimits`,
        watched), within READ_WATCH_PERIOD of it."""
        while True:
            await trio.sleep(READ_WATCH_PERIOD)
            now = trio.current_time()
            for served in list(self.requests.values()):
                if served.limits.deadline <= now:
                    served.limits.scope.cancel()

    async def _next_job(self, worker: _Worker) -> tuple[dict, _Served]:
        worker.task = trio.lowlevel.current_task()
        self._waiting.append(worker)

        def abort(_: object) -> trio.lowlevel.Abort:
            self._waiting.remove(worker)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        job, worker.job = worker.job, None
        assert job is not None
        return job

    async def _serve(self, msg: dict, served: _Served) -> None:
        req_id = msg["id"]

        def send(answer: dict) -> None:
            # What this agent sends obeys the same rules as what it receives; after a
            # cancel the router has stopped listening, so the rest is not sent. One
            # lookup per streamed chunk, no call.
            kind = answer["type"]
            state = _SEND_MOVES[served.state].get(kind)
            if state is None:
                raise request_error(served.state, kind)
            served.state = state
            if state is not RequestState.CANCELLED:
                if state is RequestState.DONE or state is RequestState.FAILED:
                    answer["elsewhere"] = self.capacity.elsewhere(self.share)
                self.send(answer)

        span = NULL_SPAN
        if self.tracer.enabled:
            rid = msg["headers"].get("x-request-id", "")
            attributes = {"hivenet.request_id": rid, "url.path": msg["path"]}
            span = self.tracer.root("agent.forward", msg.get("traceparent"), attributes)
        # Cancelled ends the worker's scope (agent/forward.py); the span ends first, as
        # it does for any answer forward reported.
        cancelled: trio.Cancelled | None = None
        with span:
            try:
                await forward(
                    self.engine, msg, send, span, served.limits, self.whole_answers, self.missing
                )
            except trio.Cancelled as exc:
                cancelled = exc
            except m.ProtocolError as exc:
                # This agent's own answer broke the rules: the request fails, the
                # session and its other requests go on.
                log.error(
                    "req=%s answer_out_of_order id=%d reason=%s",
                    request_id(msg),
                    req_id,
                    quote(str(exc)),
                )
                if served.state in (RequestState.AWAITING_HEAD, RequestState.BODY):
                    served.state = RequestState.FAILED
                    self.send(m.error(req_id, ErrorCode.BACKEND_ERROR, f"agent error: {exc}"))
            finally:
                self._give_back(served)
                if self.requests.get(req_id) is served:
                    del self.requests[req_id]
                if not self.requests:
                    self._idle.set()
        if cancelled is not None:
            raise cancelled

    def _give_back(self, served: _Served) -> None:
        if served.counted:
            served.counted = False
            self.capacity.give_back(self.share)

    async def _keepalive(self) -> None:
        with trio.move_on_after(WELCOME_TIMEOUT):
            await self.welcomed.wait()
        if not self.welcomed.is_set():
            self.fs.close("no welcome from the router")
            return
        # Every frame costs both daemons real CPU in py-libp2p, so the heartbeat is the
        # only liveness traffic: one per period, or sooner when the values change.
        silent_limit = SILENT_PERIODS * max(self.heartbeat_interval, self.router_interval)
        self._room()
        last_full = trio.current_time()
        changed = self.status.changed
        while True:
            with trio.move_on_after(self.heartbeat_interval):
                if changed is not None:
                    await changed.wait()
                else:
                    await trio.sleep_forever()
            now = trio.current_time()
            if now - self.last_rx > silent_limit:
                self.fs.close(f"router silent for more than {silent_limit:g}s")
                return
            if self.status.changed is not changed or now - last_full >= self.heartbeat_interval:
                changed = self.status.changed
                self._room()
                last_full = now

    def _room(self) -> None:
        """A heartbeat: the engine's values and the other routers' share of capacity."""
        msg = self.status.heartbeat(self.heartbeat_interval)
        msg["elsewhere"] = self.capacity.elsewhere(self.share)
        self.send(msg)

    def drain(self) -> None:
        self.send(m.drain())

    async def wait_idle(self) -> None:
        while self.requests:
            self._idle = trio.Event()
            await self._idle.wait()


class RouterConnection:
    """Keeps a session with one router alive, reconnecting with capped backoff."""

    def __init__(
        self,
        host: Any,
        address: str,
        make_session: Callable[[Any], RouterSession],
    ) -> None:
        self.host = host
        self.address = address
        self.router = parse_router_address(address)
        self.make_session = make_session
        self.session: RouterSession | None = None
        self.stopping = False
        self.sessions_started = 0

    def __repr__(self) -> str:
        return (
            f"<RouterConnection {self.address} sessions_started={self.sessions_started} "
            f"now={self.session!r}>"
        )

    async def run(self) -> None:
        backoff = BACKOFF_START
        while not self.stopping:
            stable = False
            peer_id = self.router.peer_id
            try:
                with trio.fail_after(CONNECT_TIMEOUT):
                    addrs = await dial_addrs(self.router.addr)
                    peer_id = peer_id or await learn_peer_id(self.host, addrs)
                    # py-libp2p refuses to redial a peer for 60 s after a failed dial.
                    self.host.get_network().unblock_peer(peer_id)
                    await self.host.connect(PeerInfo(peer_id, addrs))
                    stream = await self.host.new_stream(peer_id, [m.PROTOCOL_ID])
                if self.stopping:
                    # The agent began to drain during the dial: a session now would be
                    # one that no drain frame reaches, and its router would send it
                    # requests that the leaving agent then cuts off.
                    await stream.close()
                    return
                session = self.session = self.make_session(stream)
                self.sessions_started += 1
                began = trio.current_time()
                reason = await session.run()
                lasted = trio.current_time() - began
                stable = session.welcomed.is_set() and lasted >= STABLE_SESSION
                log.warning(
                    "router_session_ended router=%s reason=%s lasted_s=%.1f",
                    self.address,
                    quote(reason),
                    lasted,
                )
            except Refused as exc:
                log.error("router_refused router=%s reason=%s", self.address, quote(str(exc)))
                backoff = max(backoff, BACKOFF_CAP)
            except trio.TooSlowError:
                # Its own message is empty: say what did not happen in time.
                why = f"no stream to the router within {CONNECT_TIMEOUT:g} s"
                log.warning("router_dial_failed router=%s error=%s", self.address, quote(why))
            except Exception as exc:
                log.warning(
                    "router_dial_failed router=%s error=%s",
                    self.address,
                    quote(describe(exc)),
                )
            finally:
                self.session = None
            if self.stopping:
                return
            if peer_id is not None:
                await self._hang_up(peer_id)
            if stable:
                backoff = BACKOFF_START
            await trio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, BACKOFF_CAP)

    async def _hang_up(self, peer_id: ID) -> None:
        """Close the connection the last try used, so that the next one dials anew.

        libp2p hands a dial the connection it already has to that peer. A half-open one
        (a NAT that forgot it, a router host gone without a reset, a router frozen since)
        carried the next stream nowhere, and every redial after it: the agent never
        rejoined, over WebSocket even once the router was back."""
        with trio.move_on_after(HANG_UP_TIMEOUT), contextlib.suppress(Exception):
            await self.host.get_network().close_peer(peer_id)


def _positive(value: object) -> float | None:
    """A period from the router's welcome; None unless finite and above zero."""
    if isinstance(value, int | float) and math.isfinite(value) and value > 0:
        return float(value)
    return None


def parse_router_address(address: str) -> RouterAddress:
    """The router's address and, when pinned, its peer ID, from `--router`; ValueError
    says what is wrong with it."""
    return parse_router(address)


def hello_for(secret: bytes, peer_id: str, metadata: dict, challenge: str | None = None) -> dict:
    return m.hello(issue_token(secret, peer_id, TOKEN_TTL), metadata, challenge)
