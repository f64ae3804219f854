"""The HTTP call from the agent to its engine, streamed back frame by frame."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack

import httpx
import trio

from agent.answers import MalformedAnswer, SSEChecker, check_json_answer, is_event_stream
from agent.usage import UsageTap
from protocol import messages as m
from protocol.errors import ErrorCode
from protocol.logs import quote
from protocol.tracing import NULL_SPAN, Span

log = logging.getLogger("agent")

# After an answer's last event, at most this much more is read from the engine (only
# the end of its chunked body is expected) before its connection is dropped instead.
DRAIN_BYTES = 64 * 1024
DRAIN_SECONDS = 1.0

_HOP_BY_HOP = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}
)


class BackendClients:
    """Several small httpx pools instead of one large one.

    httpcore scans every connection of its pool on each request, polling each socket
    (`has_expired`), so one pool serving 64 concurrent requests spent most of the agent's
    CPU there. Requests are spread over pools of about `PER_POOL` connections each.
    """

    PER_POOL = 8

    def __init__(self, concurrency: int, timeout: httpx.Timeout) -> None:
        count = max(1, math.ceil(concurrency / self.PER_POOL))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=self.PER_POOL * 2)
        # HTTP(S)_PROXY name the agent's way out to its routers (agent/http_proxy.py);
        # the engine beside it must never be asked through that proxy.
        self.clients = [
            httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) for _ in range(count)
        ]

    def for_request(self, req_id: int) -> httpx.AsyncClient:
        return self.clients[req_id % len(self.clients)]

    async def __aenter__(self) -> BackendClients:
        self._stack = AsyncExitStack()
        for client in self.clients:
            await self._stack.enter_async_context(client)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()


async def forward(
    client: httpx.AsyncClient,
    backend_url: str,
    msg: dict,
    send: Callable[[dict], None],
    span: Span = NULL_SPAN,
) -> None:
    """Run one request against the engine; every outcome is reported with `send`.

    Cancellation (the router's cancel frame, or the session ending) closes the engine
    connection, which is how engines notice an abandoned request.
    """
    req_id: int = msg["id"]
    url = backend_url.rstrip("/") + msg["path"]
    tap = UsageTap(msg) if msg.get("report_usage") else None
    headers = msg["headers"]
    # The engine joins the trace: this agent's span when tracing, else the router's.
    traceparent = span.traceparent() or msg.get("traceparent")
    if traceparent:
        headers = {**headers, "traceparent": traceparent}
    try:
        request = client.build_request(
            msg["method"], url, headers=headers, content=tap.body if tap else msg["body"]
        )
        response = await client.send(request, stream=True)
        span.set("http.response.status_code", response.status_code)
    except httpx.TimeoutException as exc:
        send(m.error(req_id, ErrorCode.BACKEND_UNAVAILABLE, f"engine timed out: {exc!r}"))
        return
    except httpx.HTTPError as exc:
        send(m.error(req_id, ErrorCode.BACKEND_UNAVAILABLE, f"engine unreachable: {exc!r}"))
        return
    try:
        headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_BY_HOP}
        # A success is checked before any of it leaves (agent/answers.py); errors are the
        # router's to classify.
        ok = 200 <= response.status_code < 300
        encoding = response.headers.get("content-encoding", "")
        if not msg["stream"] or (
            ok and not is_event_stream(response.headers.get("content-type", ""))
        ):
            # Head, body and end queued together leave in one write and one frame read.
            # Raw bytes: the engine's content-encoding header travels with them.
            body = b"".join([chunk async for chunk in response.aiter_raw()])
            answer = check_json_answer(body, encoding) if ok else None
            send(m.response_head(req_id, response.status_code, headers))
            send(m.response_chunk(req_id, body))
            if tap:
                tap.of_answer(answer, body)
            send(m.response_end(req_id, tap.usage if tap else None))
            return
        # The head waits for the first checked event: until it leaves, the router may
        # still try another agent.
        # Usage is read by the check's parse, so not from an unchecked stream (usage.py).
        checker = (
            SSEChecker(tap.of_event if tap else None)
            if ok and encoding in ("", "identity")
            else None
        )
        head: dict | None = m.response_head(req_id, response.status_code, headers)
        if checker is None:
            send(head)
            head = None
        engine_chunks = response.aiter_raw()
        async for chunk in engine_chunks:
            if checker is not None:
                chunk = checker.feed(chunk)
                if not chunk:
                    continue
                if head is not None:
                    send(head)
                    head = None
            if chunk:
                send(m.response_chunk(req_id, chunk))
            if checker is not None and checker.finished:
                # The last event and the end leave in one write: an SDK leaves at
                # `[DONE]`, and the router must have the end (and the usage) by then.
                break
        if checker is not None:
            checker.close()
        send(m.response_end(req_id, tap.usage if tap else None))
        if checker is not None and checker.finished:
            await _drain(engine_chunks)
    except MalformedAnswer as exc:
        log.warning(
            "req=%s malformed_answer path=%s reason=%s",
            msg["headers"].get("x-request-id", req_id),
            msg["path"],
            quote(str(exc)),
        )
        send(m.error(req_id, ErrorCode.BACKEND_ERROR, f"malformed engine answer: {exc}"))
    except httpx.HTTPError as exc:
        send(m.error(req_id, ErrorCode.BACKEND_ERROR, f"engine answer broke off: {exc!r}"))
    finally:
        await response.aclose()


async def _drain(engine_chunks: AsyncIterator[bytes]) -> None:
    """Read what an engine sends after its last event (the end of the chunked body) so
    its connection goes back to the pool; the answer is already complete."""
    left = DRAIN_BYTES
    with contextlib.suppress(httpx.HTTPError), trio.move_on_after(DRAIN_SECONDS):
        async for chunk in engine_chunks:
            left -= len(chunk)
            if left < 0:
                return
