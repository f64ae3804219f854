"""The HTTP call from the agent to its engine, streamed back frame by frame."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from functools import partial

import trio

from agent import chat_template, engine_http
from agent.answers import MalformedAnswer, SSEChecker, check_json_answer, is_event_stream
from agent.engine_http import (
    EngineBrokeOff,
    EnginePool,
    EngineResponse,
    EngineUnavailable,
    ReadLimits,
)
from agent.usage import UsageTap, wanted
from protocol import messages as m
from protocol.errors import ErrorCode, route_missing
from protocol.frames import MAX_FRAME_BYTES
from protocol.logs import quote
from protocol.paths import API_PATHS
from protocol.tracing import NULL_SPAN, Span

log = logging.getLogger("agent")

# A whole answer leaves in one frame; its headers and the frame's fields fit in the rest.
MAX_ANSWER_BYTES = MAX_FRAME_BYTES - 64 * 1024
# A body up to this size goes in one `response` frame with its head (64 KiB at most)
# and its end; a larger one in its own chunk frame, where the frame limit holds it.
MAX_WHOLE_BYTES = 1024 * 1024

_HOP_BY_HOP = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}
)


def request_id(msg: dict) -> str:
    """A request message's X-Request-ID (the router sets it), for `req=` in log lines;
    the link's own number when it has none."""
    return str(msg["headers"].get("x-request-id") or msg["id"])


async def forward(
    engine: EnginePool,
    msg: dict,
    send: Callable[[dict], None],
    span: Span = NULL_SPAN,
    limits: ReadLimits | None = None,
    whole: bool = False,
    missing: Callable[[str], None] | None = None,
) -> None:
    """Run one request against the engine; every outcome is reported with `send`.
    `whole`: the router takes a whole answer as one `response` message. `missing`
    learns an API path the engine answered "no such route" for; the router then gets
    `endpoint_not_supported` instead of the engine's 404.

    `limits`, when given, holds the engine's read timeouts for the request's scope,
    which the caller (the session's worker) has entered: the router's cancel (or the
    session's end) cancels it, and so does a timeout. Its Cancelled then leaves this
    call, after a timeout's failure is reported. Without them the request has a scope
    of its own. A cancellation closes the engine connection, which is how engines
    notice an abandoned request.
    """
    if limits is None:
        with trio.CancelScope() as own:
            limits = ReadLimits(engine.timeouts.read, own)
            await _forward(engine, msg, send, span, limits, whole, missing)
        return
    await _forward(engine, msg, send, span, limits, whole, missing)


async def _forward(
    engine: EnginePool,
    msg: dict,
    send: Callable[[dict], None],
    span: Span,
    limits: ReadLimits,
    whole: bool,
    missing: Callable[[str], None] | None,
) -> None:
    req_id: int = msg["id"]
    tap = UsageTap(msg, engine.kind) if wanted(msg, engine.kind) else None
    headers = msg["headers"]
    # The engine joins the trace: this agent's span when tracing, else the router's.
    traceparent = span.traceparent() or msg.get("traceparent")
    if traceparent:
        headers = {**headers, "traceparent": traceparent}
    response: EngineResponse | None = None
    cancelled: trio.Cancelled | None = None
    try:
        try:
            body = tap.body if tap else msg["body"]
            if chat_template.wanted(msg, engine.kind):
                body = await chat_template.templated(engine, body, limits)
            response = await engine.send(msg["method"], msg["path"], headers, body, limits)
            span.set("http.response.status_code", response.status)
            await _relay(engine, response, msg, tap, send, limits, whole, missing)
        except trio.Cancelled as exc:
            expired = limits.expired()
            if expired is None:
                raise
            cancelled = exc  # raised again once the timeout is reported
            raise expired from None
    except EngineUnavailable as exc:
        what = "timed out" if exc.timed_out else "unreachable"
        send(m.error(req_id, ErrorCode.BACKEND_UNAVAILABLE, f"engine {what}: {exc}"))
    except MalformedAnswer as exc:
        log.warning(
            "req=%s malformed_answer path=%s reason=%s",
            request_id(msg),
            msg["path"],
            quote(str(exc)),
        )
        send(m.error(req_id, ErrorCode.BACKEND_ERROR, f"malformed engine answer: {exc}"))
    except EngineBrokeOff as exc:
        send(m.error(req_id, ErrorCode.BACKEND_ERROR, f"engine answer broke off: {exc}"))
    finally:
        if response is not None:
            response.close()
    if cancelled is not None:
        raise cancelled


async def _relay(
    engine: EnginePool,
    response: EngineResponse,
    msg: dict,
    tap: UsageTap | None,
    send: Callable[[dict], None],
    limits: ReadLimits,
    whole: bool,
    missing: Callable[[str], None] | None = None,
) -> None:
    req_id: int = msg["id"]
    status = response.status
    headers = {k: v for k, v in response.headers.items() if k not in _HOP_BY_HOP}
    if status == 404 and missing is not None and msg["path"] in API_PATHS:
        body = await response.read_all(MAX_ANSWER_BYTES, limits)
        if route_missing(status, body):
            # The engine lacks the endpoint (an older build, a custom server): the
            # router sends the request to another agent and charges this one nothing.
            missing(msg["path"])
            text = body[:200].decode("utf-8", "replace")
            log.warning(
                "req=%s engine_route_missing path=%s body=%s",
                request_id(msg),
                msg["path"],
                quote(text),
            )
            why = f"engine does not serve {msg['path']} (it answered 404: {text})"
            send(m.error(req_id, ErrorCode.ENDPOINT_NOT_SUPPORTED, why, status=404))
            return
        # The engine's own judgement (a model it lacks): the router's to classify.
        send(m.response_head(req_id, status, headers))
        send(m.response_chunk(req_id, body))
        send(m.response_end(req_id, None))
        return
    # A success is checked before any of it leaves (agent/answers.py); errors are the
    # router's to classify.
    ok = 200 <= status < 300
    encoding = response.headers.get("content-encoding", "")
    if not msg["stream"] or (ok and not is_event_stream(response.headers.get("content-type", ""))):
        # Raw bytes: the engine's content-encoding header travels with them.
        body = await response.read_all(MAX_ANSWER_BYTES, limits)
        answer = check_json_answer(body, encoding) if ok else None
        if tap:
            tap.of_answer(answer, body)
        usage = tap.usage if tap else None
        if whole and len(body) <= MAX_WHOLE_BYTES:
            send(m.response(req_id, status, headers, body, usage))
            return
        # Head, body and end queued together leave in one write and one frame read.
        send(m.response_head(req_id, status, headers))
        send(m.response_chunk(req_id, body))
        send(m.response_end(req_id, usage))
        return
    # The head waits for the first checked event: until it leaves, the router may
    # still try another agent.
    # Usage is read by the check's parse, so not from an unchecked stream (usage.py).
    checker = None
    if ok and encoding in ("", "identity"):
        checker = SSEChecker(tap.of_event, tap.of_data) if tap else SSEChecker()
    relay = _Pieces(req_id, send, limits, checker, tap, m.response_head(req_id, status, headers))
    if checker is None:
        relay.send_head()
    # Each piece is all that one socket read brought, however many chunks and events it
    # held, so events that arrive together leave in one frame.
    limits.stream()
    pump = engine.pump
    if pump is None:
        await relay.read(response)
    else:
        pump.streams += 1
        try:
            raw = response.raw_socket() if pump.takes() else None
            if raw is None:
                await relay.read(response)
            elif not relay.step(response, None):
                # What came with the head went first; then the pump's reads, each
                # handed on as it comes, the end included, and this task woken once,
                # after it.
                await pump.wait(raw, partial(relay.step, response, raw))
        finally:
            pump.streams -= 1
    if checker is not None and checker.finished and not response.finish_later():
        await _drain(response, limits)


class _Pieces:
    """Relays a streamed body piece by piece, checked when `checker` is given, and its
    end, with the usage `tap` read."""

    __slots__ = ("checker", "head", "limits", "req_id", "send", "tap")

    def __init__(
        self,
        req_id: int,
        send: Callable[[dict], None],
        limits: ReadLimits,
        checker: SSEChecker | None,
        tap: UsageTap | None,
        head: dict,
    ) -> None:
        self.req_id = req_id
        self.send = send
        self.limits = limits
        self.checker = checker
        self.tap = tap
        # The head waits for the first checked event: until it leaves, the router may
        # still try another agent.
        self.head: dict | None = head

    def send_head(self) -> None:
        if self.head is not None:
            self.send(self.head)
            self.head = None

    def take(self, piece: bytes) -> bool:
        """Relay one piece; True at the answer's last event, whose frame the end
        follows in the same write: an SDK leaves at `[DONE]`, and the router must have
        the end (and the usage) by then."""
        self.limits.arrived()
        checker = self.checker
        if checker is None:
            self.send(m.response_chunk(self.req_id, piece))
            return False
        piece = checker.feed(piece)
        if not piece:
            return False
        if self.head is not None:
            self.send_head()
        self.send(m.response_chunk(self.req_id, piece))
        return checker.finished

    def finish(self) -> None:
        """The body ended, or its last event left: the check's verdict on the whole
        stream, then the end (in the same write as the last event)."""
        if self.checker is not None:
            self.checker.close()
        tap = self.tap
        self.send(m.response_end(self.req_id, tap.usage if tap else None))

    async def read(self, response: EngineResponse) -> None:
        """Read and relay the body, and its end, in this task."""
        while piece := await response.receive():
            if self.take(piece):
                break
        self.finish()

    def step(self, response: EngineResponse, raw: socket.socket | None) -> bool:
        """One read of `response` (none with `raw` None: what it holds), relayed (a
        `ReadPump` step); True once the end has been sent."""
        piece = response.read_now(raw)
        while piece:
            if self.take(piece):
                break
            piece = response.read_now(None)
        if piece is None:
            return False
        self.finish()
        return True


async def _drain(response: EngineResponse, limits: ReadLimits) -> None:
    """Read what an engine sends after its last event (the end of the chunked body) so
    its connection goes back to the pool; the answer is already complete."""
    if response.read_whole:
        return  # the body's end came with the last event
    # The pool's bounds on the same end, when it reads it later (`finish_later`).
    limits.drain(engine_http.FINISH_SECONDS)
    left = engine_http.FINISH_BYTES
    try:
        while piece := await response.receive():
            left -= len(piece)
            if left < 0:
                return
    except EngineBrokeOff:
        return
