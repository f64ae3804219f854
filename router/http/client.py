"""The client API: inference endpoints forwarded through the dispatcher, and models."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import orjson
import trio

from protocol.errors import ErrorCode, RouterError, error_payload
from protocol.logs import quote
from protocol.paths import CHAT, GENERATIVE
from protocol.tracing import NULL_SPAN, Span, valid_traceparent
from protocol.usage import usage_of_body
from router.admission.control import Admission, AdmissionRefused, Admitted
from router.admission.limits import NO_ADMISSION_LIMITS
from router.continuation_relay import StreamContinuer, StreamRelay, broken_code, record_break
from router.dispatch import Dispatcher, ProviderServed
from router.http import count_tokens, request_fields
from router.http.asgi import (
    ANSWER_SCOPE,
    BODY_READY,
    ON_DISCONNECT,
    SPAN,
    AnswerScope,
    BodyTooLarge,
    ClientGone,
    OnDisconnect,
    Receive,
    Scope,
    Send,
    read_body,
    send_body,
    send_bytes,
    send_json,
    start_response,
)
from router.idempotency import DEFAULT_WINDOW, IdempotencyTable, request_key
from router.link import AgentResponse, StreamBroken
from router.metrics import RouterMetrics
from router.peers import PeerTable
from router.policy.schema import Policy
from router.session import BackendRejected, RouteRequest
from router.tenants.config import NO_LIMITS, ApiKey
from router.tenants.gate import Ticket

log = logging.getLogger("http")

# Where the app keeps a request's tenant ticket in its ASGI scope.
TICKET = "hivenet.ticket"
# ... and the record of the client key that matched (router.tenants.config.ApiKey).
API_KEY = "hivenet.api_key"
# ... and the request as routed (router.session.RouteRequest), once it is parsed.
ROUTE = "hivenet.route"
# endpoint -> (capability, error protocol)
ENDPOINTS: dict[str, tuple[str, str]] = {
    "/v1/chat/completions": ("llm", "openai"),
    "/v1/completions": ("llm", "openai"),
    "/v1/responses": ("llm", "openai"),
    "/v1/messages": ("llm", "anthropic"),
    "/v1/embeddings": ("embedding", "openai"),
    "/v1/rerank": ("reranker", "openai"),
    count_tokens.COUNT_TOKENS_PATH: ("llm", "anthropic"),
}
# The client's headers go to the engine, as upstream forwards them, but for these: the
# hop's own (HTTP/1.1 framing, the connection), the client's credentials for this router
# (an agent's host is not trusted with them, and an engine with its own key wants that),
# what the router sets itself, and content coding (the agent's hop is plain).
_NOT_FORWARDED = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "cookie",
        "accept-encoding",
        "content-encoding",
        "x-request-id",
        "traceparent",
        "idempotency-key",
    }
)
# The endpoints admission control gates (B1, B2, B4).
_GATED = GENERATIVE
_DROPPED_RESPONSE_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "date", "server", "keep-alive"}
)


@dataclass
class ClientSettings:
    max_request_bytes: int
    request_timeout: float
    idempotency_window: float = DEFAULT_WINDOW


def parse_json_object(body: bytes) -> tuple[dict | None, str]:
    """The body as a JSON object, or None and what is wrong with it."""
    try:
        # orjson takes 3 µs where json takes 15 on a 140-byte chat body (loaded host).
        # What orjson refuses and json takes (NaN, 1e999, lone surrogates, a BOM,
        # nesting past 1,024) goes to json, so the answer is json's as before; one
        # difference stays: an integer past 64 bits reads as a float.
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _parse_with_json(body)
    if not isinstance(payload, dict):
        return None, "body must be a JSON object"
    return payload, ""


def _parse_with_json(body: bytes) -> tuple[dict | None, str]:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"body is not JSON: {exc}"
    except RecursionError:
        return None, "body is not JSON the router accepts: nested too deeply"
    if not isinstance(payload, dict):
        return None, "body must be a JSON object"
    return payload, ""


async def send_error(
    send: Send,
    protocol: str,
    err: RouterError,
    headers: list[tuple[str, str]],
    ticket: Ticket | None,
) -> int:
    """Answer with `err`, and its Retry-After when it has one; its code goes on the
    request's ticket for the audit line."""
    if ticket is not None:
        ticket.answered_with(err.code)
    if err.retry_after is not None:
        headers = [*headers, *err.retry_headers()]
    await send_json(send, err.http_status, error_payload(protocol, err), headers)
    return err.http_status


def sse_error(protocol: str, err: RouterError) -> bytes:
    payload = json.dumps(error_payload(protocol, err), separators=(",", ":"))
    if protocol == "anthropic":
        return f"event: error\ndata: {payload}\n\n".encode()
    return f"data: {payload}\n\n".encode()


class ClientApi:
    def __init__(
        self,
        dispatcher: Dispatcher,
        table: PeerTable,
        metrics: RouterMetrics,
        settings: ClientSettings,
    ) -> None:
        self.dispatcher = dispatcher
        self.table = table
        self.metrics = metrics
        self.settings = settings
        self.continuer = StreamContinuer(dispatcher, table, metrics)
        self.idempotency = IdempotencyTable(settings.idempotency_window)
        # Admission control (router/admission); None: none (in-process tests).
        self.admission: Admission | None = None

    async def inference(
        self, scope: Scope, receive: Receive, send: Send, rid: str, tenant: str, priority: int = 0
    ) -> int:
        """Serve one inference request; returns the HTTP status sent."""
        path = scope["path"]
        capability, protocol = ENDPOINTS[path]
        received = trio.current_time()
        extra = [("x-request-id", rid)]

        async def fail(err: RouterError) -> int:
            return await send_error(send, protocol, err, extra, scope.get(TICKET))

        ready = scope.get("extensions", {}).get(BODY_READY)
        try:
            if ready is not None and ready():
                body = await read_body(scope, receive, self.settings.max_request_bytes)
            else:
                with trio.fail_at(received + self.settings.request_timeout):
                    body = await read_body(scope, receive, self.settings.max_request_bytes)
        except BodyTooLarge:
            limit = self.settings.max_request_bytes
            return await fail(
                RouterError(ErrorCode.PAYLOAD_TOO_LARGE, f"request body exceeds {limit} bytes")
            )
        except ClientGone as gone:
            if gone.status != 499 and (ticket := scope.get(TICKET)) is not None:
                ticket.answered_with(ErrorCode.REQUEST_INVALID)  # the server's refusal
            return gone.status
        except trio.TooSlowError:
            return await fail(
                RouterError(
                    ErrorCode.REQUEST_TIMEOUT,
                    f"request body not received within {self.settings.request_timeout:g}s",
                )
            )
        payload, problem = parse_json_object(body)
        if payload is None:
            return await fail(RouterError(ErrorCode.REQUEST_INVALID, problem))
        wrong = request_fields.problem(path, payload)
        if wrong is not None:
            return await fail(RouterError(ErrorCode.REQUEST_INVALID, wrong))
        model: str = payload["model"]
        ticket: Ticket | None = scope.get(TICKET)
        span: Span = scope.get(SPAN, NULL_SPAN)
        key: ApiKey | None = scope.get(API_KEY)
        gates = self.admission
        # One snapshot for the gates below and the routing after them: the tenant's
        # admission and the pool's room wait, and a reload meanwhile must not route
        # under other rules than the caps that admitted the request.
        policy = self.dispatcher.store.for_model(model)
        # Upstream's gates model KV-cache-bound generation: not embeddings, rerank or
        # token counting (the daily budget still charges embeddings and rerank). A
        # request no check reads skips the estimate (7 µs for a short chat).
        limits, own = NO_ADMISSION_LIMITS, NO_LIMITS
        if gates is not None and capability == "llm" and path in _GATED:
            limits = policy.admission
            own = key.limits_for(model) if key is not None else NO_LIMITS
        gated = gates is not None and (limits.active or own.any)
        estimate = None
        if gates is not None and (gated or (ticket is not None and ticket.counts_tokens)):
            estimate = gates.estimate(model, payload)
        if gated and estimate is not None and gates is not None:
            capped = gates.caps(model, limits, own, estimate)
            if capped is not None:
                return await fail(self._refused(rid, tenant, model, capped, ticket))
        if ticket is not None:
            need = estimate.footprint if estimate is not None else 0
            charge = estimate.tokens if estimate is not None else 0
            output = estimate.declared_output if estimate is not None else 0
            with span.child("admission", {"hivenet.tenant": tenant}) as admission:
                refused = await ticket.admit(model, len(body), need, charge, output)
                if refused is not None:
                    admission.fail(refused.code)
            if refused is not None:
                return await fail(refused)
        reserve: _Reserve | None = None
        if gated and estimate is not None and gates is not None:
            reserve = partial(gates.reserve, model, limits, key, estimate)
        return await self._forward(
            scope, receive, send, rid, tenant, priority, payload, body, received, reserve, policy
        )

    def _refused(
        self,
        rid: str,
        tenant: str,
        model: str,
        refused: AdmissionRefused,
        ticket: Ticket | None,
    ) -> AdmissionRefused:
        if ticket is not None:
            ticket.refused_by = refused.gate
        log.info(
            "req=%s admission_refused gate=%s code=%s model=%s tenant=%s",
            rid,
            refused.gate,
            refused.code,
            quote(model),
            quote(tenant),
        )
        return refused

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        rid: str,
        tenant: str,
        priority: int,
        payload: dict,
        body: bytes,
        received: float,
        reserve: _Reserve | None,
        policy: Policy,
    ) -> int:
        path = scope["path"]
        capability, protocol = ENDPOINTS[path]
        extra = [("x-request-id", rid)]
        model: str = payload["model"]
        ticket: Ticket | None = scope.get(TICKET)
        span: Span = scope.get(SPAN, NULL_SPAN)
        stream = payload.get("stream") is True
        headers = {}
        traceparent = None
        for key, value in scope["headers"]:
            name = key.decode("latin-1")
            if name not in _NOT_FORWARDED:
                text = value.decode("latin-1")
                # A repeated field is one list (RFC 9110, 5.3).
                headers[name] = f"{headers[name]}, {text}" if name in headers else text
            elif name == "traceparent":
                traceparent = value.decode("latin-1")
        # The body is known to be JSON: say so to engines that check.
        headers.setdefault("content-type", "application/json")
        headers["x-request-id"] = rid
        req = RouteRequest(
            request_id=rid,
            model=model,
            capability=capability,
            tenant=tenant,
            method="POST",
            path=path,
            headers=headers,
            body=body,
            stream=stream,
            payload=payload,
            received_at=received,
            priority=priority,
            span=span,
            # Tracing off, the client's trace context still reaches the engine.
            traceparent=valid_traceparent(traceparent),
            policy=policy,
        )
        req.report_usage = ticket is not None and ticket.wants_usage
        scope[ROUTE] = req  # what the console's recent requests read when it ends
        req.stream_tokens = stream and path == CHAT and self.continuer.enabled(req)
        if path == count_tokens.COUNT_TOKENS_PATH:
            try:
                count_tokens.to_tokenize(req, payload, self.table.for_model(model))
            except RouterError as err:
                return await send_error(send, protocol, err, extra, ticket)
        # router/http/server.py tells of the client leaving and lends the connection's
        # cancel scope; under another server a task waits in receive() for the client,
        # and the answer has a scope of its own.
        extensions = scope.get("extensions", {})
        leaving = (extensions.get(ON_DISCONNECT), receive, extensions.get(ANSWER_SCOPE))
        if self.idempotency.window <= 0 or request_key(scope) is None:
            return await self._admitted(reserve, req, protocol, leaving, send, extra, ticket)
        conflict = RouterError(
            ErrorCode.IDEMPOTENCY_CONFLICT,
            "this idempotency key was used with another request body; use a new key",
        )
        failed = RouterError(
            ErrorCode.BACKEND_ERROR, "the first request with this idempotency key failed"
        )
        return await self.idempotency.once(
            scope,
            tenant,
            body,
            send,
            rid,
            partial(send_error, send, protocol, conflict, extra, ticket),
            sse_error(protocol, failed),
            lambda recorded, record_part: self._admitted(
                reserve, req, protocol, leaving, recorded, extra, ticket, record_part
            ),
        )

    async def _admitted(
        self,
        reserve: _Reserve | None,
        req: RouteRequest,
        protocol: str,
        leaving: tuple[OnDisconnect | None, Receive, AnswerScope | None],
        send: Send,
        extra: list[tuple[str, str]],
        ticket: Ticket | None,
        record_part: Callable[[bytes], None] | None = None,
    ) -> int:
        """`_serve` within the pool's room (B2) and the key's limits (B4), held until
        the request ends. Taken past the idempotency table: a retry that joins or
        replays an answer generates nothing, so it must hold no room, or a full pool
        would refuse the very retry whose answer is running."""
        gates = self.admission
        if reserve is None or gates is None:
            return await self._serve(req, protocol, leaving, send, extra, ticket, None, record_part)
        outcome = await reserve()
        if isinstance(outcome, AdmissionRefused):
            refused = self._refused(req.request_id, req.tenant, req.model, outcome, ticket)
            return await send_error(send, protocol, refused, extra, ticket)
        admitted = outcome
        req.report_usage = True
        req.on_provider = partial(gates.left_local, admitted)
        try:
            return await self._serve(
                req, protocol, leaving, send, extra, ticket, admitted, record_part
            )
        finally:
            await gates.finish(admitted)

    async def _serve(
        self,
        req: RouteRequest,
        protocol: str,
        leaving: tuple[OnDisconnect | None, Receive, AnswerScope | None],
        send: Send,
        extra: list[tuple[str, str]],
        ticket: Ticket | None = None,
        admitted: Admitted | None = None,
        record_part: Callable[[bytes], None] | None = None,
    ) -> int:
        state = _Progress(ticket, admitted, leaving[2], record_part)

        async def tracked_send(message: dict) -> None:
            # Once the last body part is on its way, a disconnect is the client's
            # normal close, not an abandoned request.
            if message["type"] == "http.response.body" and not message.get("more_body"):
                state.done = True
            await send(message)

        # At the deadline the cancellation frees the agent's slot and cancels its engine
        # call (the relay's `finally`), whatever the relay is doing: a write blocked on a
        # client that stopped reading is cancelled with it.
        deadline = req.received_at + self.settings.request_timeout
        on_disconnect, receive, connection = leaving
        if on_disconnect is not None and connection is not None:
            timed_out = await self._answer_in(
                connection, on_disconnect, deadline, req, protocol, tracked_send, extra, state
            )
        else:
            answering = trio.CancelScope(deadline=deadline)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch, receive, _client_left(state, answering.cancel))
                with answering:
                    await self._answer(req, protocol, tracked_send, extra, state)
                nursery.cancel_scope.cancel()
            timed_out = answering.cancelled_caught
        if state.client_gone:
            log.info("req=%s client_disconnected tenant=%s", req.request_id, quote(req.tenant))
            return 499
        if timed_out:
            err = RouterError(
                ErrorCode.REQUEST_TIMEOUT,
                f"request not completed within {self.settings.request_timeout:g}s",
            )
            log.warning(
                "req=%s request_timeout model=%s tenant=%s",
                req.request_id,
                quote(req.model),
                quote(req.tenant),
            )
            if state.started:
                await _end_stream_with_error(send, protocol, err, state)
                return state.status
            # Shielded, for as long as a started stream's end: after the connection's
            # scope ended the answer, only a shielded write can go out.
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                state.status = await send_error(send, protocol, err, extra, state.ticket)
            return state.status
        return state.status

    async def _answer_in(
        self,
        connection: AnswerScope,
        on_disconnect: OnDisconnect,
        deadline: float,
        req: RouteRequest,
        protocol: str,
        send: Send,
        extra: list[tuple[str, str]],
        state: _Progress,
    ) -> bool:
        """`_answer` in the connection's own cancel scope (ANSWER_SCOPE), not one of its
        own; True when the deadline ended it. The connection closes after an answer
        its deadline or its client ended."""
        connection.limit(deadline)
        try:
            on_disconnect(_client_left(state, connection.end))
            await self._answer(req, protocol, send, extra, state)
        except trio.Cancelled:
            # The scope stays cancelled: what the request still awaits is shielded
            # (the 504 above, the admission's and the tenant's counts).
            if state.client_gone:
                return False
            if trio.current_time() >= deadline:
                connection.end()
                return True
            raise
        finally:
            connection.lift()
        return False

    async def _answer(
        self,
        req: RouteRequest,
        protocol: str,
        send: Send,
        extra: list[tuple[str, str]],
        state: _Progress,
    ) -> None:
        try:
            served = await self.dispatcher.dispatch(req)
        except BackendRejected as exc:
            # The status is the code's (INTERFACE.md): an engine's 422 is a 400.
            f = exc.failure
            err = RouterError(f.code, _backend_message(f.body) or f.message, "backend")
            state.status = await send_error(send, protocol, err, extra, state.ticket)
            return
        except RouterError as err:
            state.status = await send_error(send, protocol, err, extra, state.ticket)
            return
        if isinstance(served, ProviderServed):
            # A whole answer's usage, read once for the tenant and the key's buckets; a
            # stream's comes with its last event. The provider spent the output whether or
            # not the client stays to read it.
            usage = usage_of_body(served.body) if served.stream is None else None
            if state.ticket:
                state.ticket.provider_answer(served.engine, usage)
            if state.admitted is not None:
                state.admitted.usage = usage
            await self._send_provider(req, protocol, served, send, extra, state)
            return
        response = served.response
        assert isinstance(response, AgentResponse)
        if state.ticket:
            state.ticket.served_by(served.step_name, served.peer.peer_id)
        state.response = response
        own = req.sent_at - req.received_at - req.waited
        if req.path == count_tokens.TOKENIZE_PATH:
            self.metrics.overhead.labels(count_tokens.COUNT_TOKENS_PATH).observe(max(0.0, own))
            answer = await count_tokens.answer(req, response)
            state.started = True
            if isinstance(answer, RouterError):
                state.status = await send_error(send, protocol, answer, extra, state.ticket)
            else:
                state.status = 200
                await send_json(send, 200, answer, extra)
            return
        self.metrics.overhead.labels(req.path).observe(max(0.0, own))
        await self._relay(req, protocol, response, send, extra, state)

    async def _relay(
        self,
        req: RouteRequest,
        protocol: str,
        response: AgentResponse,
        send: Send,
        extra: list[tuple[str, str]],
        state: _Progress,
    ) -> None:
        headers = [
            (k, v)
            for k, v in response.headers.items()
            if k.lower() not in _DROPPED_RESPONSE_HEADERS
        ]
        headers += extra
        state.status = response.status
        relay: StreamRelay | None = None
        try:
            if not req.stream:
                body = await response.read_all()
                if state.ticket is not None and await self._discarded(
                    state, response.usage, body, protocol, send, extra
                ):
                    return
                headers.append(("content-length", str(len(body))))
                state.started = True
                await start_response(send, response.status, headers)
                await send_body(send, body)
                return
            state.started = True
            # Its first part is queued with the head, or the link's reader writes it
            # with the head as it comes.
            await start_response(send, response.status, headers, hold=True)
            admitted, gates = state.admitted, self.admission
            grow: Callable[[bytes], Awaitable[None]] | None = None
            if admitted is not None and gates is not None and admitted.grows:
                # No declared output limit: the footprint grows by what streams, one
                # token per delta event (OpenAI's `delta`, Anthropic's content_block_delta).
                grow = partial(_grow_by_deltas, gates, admitted)
            writer = state.part_writer()
            relay = StreamRelay(
                self.continuer, req, response, partial(setattr, state, "response"), grow, writer
            )
            await relay.run(send)
        except StreamBroken as exc:
            # The error event below is written shielded, for up to 5 s to a client that
            # may not read: the deadline could not free the agent's slot during it.
            if state.response is not None:
                state.response.close()
            err = RouterError(broken_code(exc), f"answer interrupted: {exc}")
            if relay is None:  # a stream's relay has counted and logged its breaks
                record_break(self.metrics, req, exc)
            if state.started and req.stream:
                await _end_stream_with_error(send, protocol, err, state)
            else:
                state.status = await send_error(send, protocol, err, extra, state.ticket)
        finally:
            (relay.response if relay else response).close()
            if state.ticket and not state.ticket.discarded:
                state.ticket.usage = relay.usage if relay else response.usage
            if state.admitted is not None:
                state.admitted.usage = relay.usage if relay else response.usage

    async def _send_provider(
        self,
        req: RouteRequest,
        protocol: str,
        served: ProviderServed,
        send: Send,
        extra: list[tuple[str, str]],
        state: _Progress,
    ) -> None:
        state.status = served.status
        state.started = True
        headers = [*served.headers.items(), *extra]
        stream = served.stream
        if stream is None:
            if state.ticket is not None and await self._discarded(
                state, state.ticket.usage, served.body, protocol, send, extra
            ):
                return
            await send_bytes(send, served.status, served.body, served.content_type, headers)
            return
        # The provider's stream: each event goes out as it arrives (router/providers).
        try:
            content_type = ("content-type", served.content_type)
            await start_response(send, served.status, [content_type, *headers])
            chunk: bytes | None = served.body
            while chunk is not None:
                await send_body(send, chunk, more=True)
                chunk = await stream.next()
            await send_body(send, b"")
        except RouterError as err:
            log.warning(
                "req=%s provider_stream_broken provider=%s reason=%s tenant=%s",
                req.request_id,
                served.engine,
                quote(err.message),
                quote(req.tenant),
            )
            await _end_stream_with_error(send, protocol, err, state)
        finally:
            await stream.aclose()
            if state.ticket is not None:
                state.ticket.usage = stream.usage
            if state.admitted is not None:
                state.admitted.usage = stream.usage

    async def _discarded(
        self,
        state: _Progress,
        usage: dict[str, int] | None,
        body: bytes,
        protocol: str,
        send: Send,
        extra: list[tuple[str, str]],
    ) -> bool:
        """Whether a whole answer was discarded for the daily token budget, as upstream
        does: then the client got 429 `token_limit_exceeded` instead of it."""
        ticket = state.ticket
        assert ticket is not None
        if ticket.record is None or not ticket.record.tokens_per_day:
            return False
        if usage is None:
            usage = usage_of_body(body)  # an agent that sent no count: the body's
        refused = await ticket.refuse_whole_answer(usage)
        if refused is None:
            return False
        state.status = await send_error(send, protocol, refused, extra, ticket)
        return True

    def models(self) -> list[dict]:
        return [self.model_card(model) for model in self.table.models()]

    def model_card(self, model: str) -> dict | None:
        peers = self.table.for_model(model)
        if not peers:
            return None
        created = int(time.time() - (trio.current_time() - min(p.connected_at for p in peers)))
        return {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "hivenet",
            "capability": peers[0].metadata.capability,
            "agents": {
                "total": len(peers),
                "healthy": sum(1 for p in peers if p.routable),
                "total_capacity": sum(p.metadata.capacity for p in peers),
                "engines": sorted({p.metadata.engine for p in peers if p.metadata.engine}),
                "regions": sorted({p.metadata.region for p in peers if p.metadata.region}),
            },
        }


# Takes a request's room in its pool and its key's limits (Admission.reserve).
_Reserve = Callable[[], Awaitable[Admitted | AdmissionRefused]]


@dataclass
class _Progress:
    ticket: Ticket | None = None
    admitted: Admitted | None = None
    connection: AnswerScope | None = None  # the server's, when it offers one
    # The idempotency table's, for the parts of an answer it records (router/idempotency.py).
    record_part: Callable[[bytes], None] | None = None
    started: bool = False
    status: int = 200
    client_gone: bool = False
    done: bool = False
    response: AgentResponse | None = None

    def part_writer(self) -> Callable[[bytes], bool] | None:
        """What writes a stream's parts past `send` (ANSWER_SCOPE's), recording them
        as `send` would."""
        writer = self.connection.part_writer() if self.connection is not None else None
        record = self.record_part
        if writer is None or record is None:
            return writer

        def recorded(body: bytes) -> bool:
            record(body)
            return writer(body)

        return recorded


def _client_left(state: _Progress, cancel: Callable[[], None]) -> Callable[[], None]:
    """What the client leaving does: cancel the answer, unless its last body part is
    already on its way (then it is the client's normal close)."""

    def left() -> None:
        if not state.done:
            state.client_gone = True
            cancel()

    return left


async def _watch(receive: Receive, client_left: Callable[[], None]) -> None:
    """Under an ASGI server without ON_DISCONNECT: wait in receive() for the client."""
    while (await receive())["type"] != "http.disconnect":
        pass
    client_left()


async def _grow_by_deltas(gates: Admission, admitted: Admitted, chunk: bytes) -> None:
    await gates.grow(admitted, chunk.count(b'"delta"'))


async def _end_stream_with_error(
    send: Send, protocol: str, err: RouterError, state: _Progress
) -> None:
    """A stream already started: end it with an error event the SDKs understand."""
    if state.ticket is not None:
        state.ticket.answered_with(err.code)
    with trio.CancelScope(shield=True), trio.move_on_after(5):
        try:
            await send(
                {"type": "http.response.body", "body": sse_error(protocol, err), "more_body": True}
            )
            await send({"type": "http.response.body", "body": b""})
        except Exception:  # the client may be gone too; nothing left to tell it
            state.client_gone = True


def _backend_message(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(data, dict):
        if isinstance(data.get("message"), str):
            return data["message"]
        inner = data.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
    return None
