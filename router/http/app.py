"""The router's ASGI application: routes requests to the client and admin handlers."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import trio

from protocol.errors import ErrorCode, RouterError, error_payload
from protocol.logs import quote
from protocol.tracing import NO_TRACER, NULL_SPAN, Span, Tracer
from router.capacity import WaitQueue
from router.documents import etag
from router.fleet.view import FleetView
from router.http import admin, cors, models
from router.http.admin_auth import admin_auth
from router.http.admin_keys import PREFIX as KEYS_PREFIX
from router.http.admin_keys import admin_api_keys
from router.http.admin_policy import PREFIX, admin_policy_models
from router.http.asgi import (
    SPAN,
    Receive,
    RequestIds,
    Scope,
    Send,
    header,
    request_id,
    send_bytes,
    send_json,
    with_headers,
)
from router.http.auth import AdminKeys, presented_keys
from router.http.client import API_KEY, ENDPOINTS, TICKET, ClientApi, send_error
from router.http.client_ip import TrustedProxies
from router.http.console import PAGE_PREFIX, Console
from router.http.quota_headers import with_quota_headers
from router.http.registration_stream import registration_stream
from router.lifetime import HistoryUnwritable, LifetimeStore
from router.metrics import RouterMetrics
from router.peers import PeerTable
from router.policy.store import PolicyStore
from router.registrations import RegistrationFeed
from router.tenants.audit import AdminRecord
from router.tenants.gate import TenantGate, Ticket
from router.tenants.keys import ClientKeys

if TYPE_CHECKING:
    from router.upstream_metrics import Activity

log = logging.getLogger("http")


class RouterApp:
    def __init__(
        self,
        client: ClientApi,
        table: PeerTable,
        queue: WaitQueue,
        store: PolicyStore,
        metrics: RouterMetrics,
        admin_keys: AdminKeys,
        client_keys: ClientKeys,
        tenants: TenantGate | None = None,
        registrations: RegistrationFeed | None = None,
        lifetime: LifetimeStore | None = None,
        tracer: Tracer = NO_TRACER,
        fleet: FleetView | None = None,
        proxies: TrustedProxies | None = None,
    ) -> None:
        self.client = client
        # --trusted-proxies: whose forwarding headers name the client (audit lines).
        self.proxies = proxies or TrustedProxies()
        # --metrics-compat upstream: each tenant's latest request (router/upstream_metrics.py).
        self.activity: Activity | None = None
        # `?scope=fleet`: every router's agents (router/fleet/view.py).
        self.fleet = fleet
        self.table = table
        self.queue = queue
        self.store = store
        self.metrics = metrics
        self.admin_keys = admin_keys
        self.client_keys = client_keys
        self.tenants = tenants
        self.registrations = registrations or RegistrationFeed()
        self.lifetime = lifetime
        self.tracer = tracer
        self.draining = False
        # `--health-min-agents`: /health fails while fewer agents than this are routable,
        # so a balancer sends nothing to a router that has just started (or lost its
        # agents) and could only answer 404/503; 0: /health says only that it runs.
        self.health_min_agents = 0
        self.inflight = 0
        self.idle = trio.Event()
        self.ids = RequestIds()
        # The operator console's page and endpoints (router/http/console.py); its
        # recent-requests ring is None with --no-ui.
        self.console: Console | None = None
        if not admin_keys.keys and admin_keys.insecure:
            log.warning(
                "admin_api_insecure reason=%s",
                quote("no HIVENET_ROUTER_ADMIN_API_KEYS: /admin/* answers without a key"),
            )

    def _too_few_agents(self) -> bool:
        routable = 0
        for peer in self.table.all():
            routable += peer.routable
            if routable >= self.health_min_agents:
                return False
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        rid = request_id(scope, self.ids)
        if cors.is_preflight(scope):
            await cors.preflight(scope, send, rid)
            return
        send = cors.with_cors(scope, send)
        started = trio.current_time()
        path: str = scope["path"]
        method: str = scope["method"]
        console = self.console
        kept = console.begin(rid, path) if console is not None else None
        tenant = "-"
        protocol = protocol_of(path)
        if protocol == "anthropic":
            send = _with_anthropic_request_id(send, rid)
        span = NULL_SPAN
        if self.tracer.enabled and path in ENDPOINTS:
            span = scope[SPAN] = self.tracer.root(
                f"{method} {path}",
                header(scope, b"traceparent"),
                {"http.request.method": method, "url.path": path, "hivenet.request_id": rid},
            )
            send = _with_traceparent(send, span)
        try:
            if path.startswith("/v1/"):
                status, tenant = await self._client(scope, receive, send, rid)
            elif path.startswith("/admin/"):
                status = await self._admin(scope, receive, send, rid)
            elif console is not None and console.ui and path.startswith(PAGE_PREFIX):
                status = await console.page(scope, send, rid)
            elif path == "/health" and method in _READ_METHODS:
                # A draining router tells load balancers to send new clients elsewhere;
                # it serves what still reaches it (router/app.py: the drain delay).
                status, state = (503, "draining") if self.draining else (200, "ok")
                if status == 200 and self.health_min_agents and self._too_few_agents():
                    status, state = 503, "no_agents"
                extra_health = self.tenants.health() if self.tenants else {}
                await send_json(
                    send, status, {"status": state, **extra_health}, [("x-request-id", rid)]
                )
            else:
                status = await _not_found(send, rid, protocol)
        except Exception:
            # A bug must cost one request, never the daemon.
            if path.startswith("/v1/"):
                tenant = self.client_keys.tenant(presented_keys(scope, allow_x_api_key=True)) or "-"
            log.exception("req=%s handler_error path=%s tenant=%s", rid, quote(path), quote(tenant))
            status = 500
            err = RouterError(ErrorCode.INTERNAL_ERROR, "internal router error")
            # The response may have started; then the client sees a cut stream.
            with contextlib.suppress(Exception):
                await send_error(send, protocol, err, [("x-request-id", rid)], scope.get(TICKET))
        except BaseException:
            # Cut by the server (the answer deadline, a drain's end): no access line, but
            # the ring's open entry goes (its open requests are capped at MAX_OPEN, and
            # one left there would hold a place for good), shown as cut (499).
            if kept is not None and console is not None:
                ticket = scope.get(TICKET)
                who = ticket.tenant if ticket is not None else tenant
                console.end(kept, scope, 499, who, trio.current_time() - started)
            raise
        elapsed = trio.current_time() - started
        trace_id = span.trace_id
        if path.startswith("/admin/"):
            self._audit_admin(scope, rid, status, elapsed)
        elif path.startswith("/v1/") and path not in ENDPOINTS and self.tenants is not None:
            # Model discovery and unknown /v1/ paths: a line as upstream writes one.
            self._audit_v1(scope, rid, tenant, status, elapsed)
        if path in ENDPOINTS:
            metrics = self.metrics
            metrics.requests.labels(path, str(status), tenant).inc()
            if self.activity is not None:
                self.activity.saw(tenant)
            metrics.duration.labels(path, tenant).observe(elapsed)
            if self.tenants:
                self.tenants.audit(
                    scope.get(TICKET), path, rid, tenant, status, elapsed, trace_id or None
                )
            if trace_id:
                span.set("http.response.status_code", status)
                span.set("hivenet.tenant", tenant)
                if status >= 500:
                    span.fail(f"answered {status}")
                span.__exit__(None, None, None)
        if log.isEnabledFor(logging.INFO):  # quote() costs more than the call it feeds
            log.info(
                "req=%s method=%s path=%s status=%d tenant=%s duration_ms=%.1f%s",
                rid,
                quote(method),
                quote(path),
                status,
                quote(tenant),
                elapsed * 1000,
                f" trace_id={trace_id}" if trace_id else "",
            )
        if kept is not None and console is not None:
            console.end(kept, scope, status, tenant, elapsed)

    async def _client(
        self, scope: Scope, receive: Receive, send: Send, rid: str
    ) -> tuple[int, str]:
        path, method = scope["path"], scope["method"]
        protocol = protocol_of(path)
        extra = [("x-request-id", rid)]
        keys = presented_keys(scope, allow_x_api_key=True)
        key = None
        if self.tenants:
            tenant, key = self.tenants.identify_key(keys)
        else:
            tenant = self.client_keys.tenant(keys)
        scope[API_KEY] = key
        ticket = None
        if path in ENDPOINTS and self.tenants:
            # Refused requests have a ticket too: it holds the code their audit line shows.
            ticket = scope[TICKET] = self.tenants.open(rid, tenant or "-", key)
            if ticket is not None:
                # Only a ticket has what the quota headers say: no wrapper without one.
                send = with_quota_headers(scope, send)
                ticket.key_id = key.id if key is not None else None
                ticket.source_ip = self.proxies.client_ip(scope)
        if tenant is None:
            why = "missing or invalid API key (send Authorization: Bearer <key> or x-api-key)"
            if self.tenants and self.tenants.expired(keys):
                why = "API key expired (its expires_at in the auth file has passed)"
            err = RouterError(ErrorCode.UNAUTHORIZED, why)
            return await send_error(send, protocol, err, [*extra, _CHALLENGE], ticket), "-"
        if path in ENDPOINTS and method != "POST":
            return await _not_allowed(send, rid, protocol, "POST", ticket), tenant
        if path in ENDPOINTS:
            if not self.inflight:
                self.idle = trio.Event()
            self.inflight += 1
            try:
                record = ticket.record if ticket is not None else None
                priority = record.priority if record is not None else 0
                status = await self.client.inference(scope, receive, send, rid, tenant, priority)
                return status, tenant
            finally:
                if ticket is not None:
                    await ticket.close()
                self.inflight -= 1
                if not self.inflight:
                    self.idle.set()
        if (path == "/v1/models" or path.startswith("/v1/models/")) and method not in _READ_METHODS:
            return await _not_allowed(send, rid, protocol, "GET, HEAD"), tenant
        record = self.tenants.tenant(tenant, key) if self.tenants else None
        if path == "/v1/models":
            if self.fleet is not None and _fleet_scope(scope):
                cards = await self.fleet.models()
                await send_json(
                    send, 200, {"object": "list", "scope": "fleet", "data": cards}, extra
                )
                return 200, tenant
            peers = {m: self.table.for_model(m) for m in self.table.models()}
            cards = models.listed(self.client.models(), peers, record)
            await send_json(send, 200, {"object": "list", "data": cards}, extra)
            return 200, tenant
        if path.startswith("/v1/models/"):
            # ASGI paths arrive percent-decoded: `org/model` names need no unquoting.
            model = path[len("/v1/models/") :]
            card = self.client.model_card(model)
            if card is not None and models.allowed(card, record):
                card = models.detail(card, self.table.for_model(model))
            else:
                # A model the key may not use is not there, as upstream: 404, not 403.
                card = None
            if card is None:
                err = RouterError(ErrorCode.MODEL_NOT_FOUND, "no agent serves this model")
                await send_json(send, 404, error_payload(protocol, err), extra)
                return 404, tenant
            await send_json(send, 200, card, extra)
            return 200, tenant
        return await _not_found(send, rid, protocol), tenant

    async def _admin(self, scope: Scope, receive: Receive, send: Send, rid: str) -> int:
        extra = [("x-request-id", rid)]
        if not self.admin_keys.allows(scope):
            err = RouterError(
                ErrorCode.UNAUTHORIZED, "admin API key required (Authorization: Bearer <key>)"
            )
            await send_json(send, 401, error_payload("openai", err), [*extra, _CHALLENGE])
            return 401
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/admin/routing-table":
            if self.fleet is not None and _fleet_scope(scope):
                await send_json(send, 200, await self.fleet.routing_table(), extra)
            else:
                body = await admin.routing_table_json(self.table)
                await send_bytes(send, 200, body, "application/json", extra)
        elif method == "GET" and path == "/admin/registration-stream":
            return await registration_stream(self.registrations, receive, send, extra)
        elif path == "/admin/storage" and method == "GET" and self.lifetime:
            await send_json(send, 200, self.lifetime.storage(), extra)
        elif path == "/admin/metrics/reset" and method == "POST" and self.lifetime:
            try:
                await self.lifetime.reset()
            except HistoryUnwritable as exc:
                err = RouterError(ErrorCode.INTERNAL_ERROR, str(exc))
                await send_json(send, 500, error_payload("openai", err), extra)
                return 500
            message = "per-agent lifetime counters cleared (disk, in-memory, and Prometheus series)"
            await send_json(send, 200, {"status": "metrics reset", "message": message}, extra)
        elif method == "GET" and path == "/admin/health":
            await send_json(send, 200, admin.health(self.table, self.queue), extra)
        elif method == "GET" and path == "/admin/models":
            await send_json(send, 200, {"object": "list", "data": self._admin_models()}, extra)
        elif method == "GET" and path.startswith("/admin/models/"):
            model = path[len("/admin/models/") :]
            cards = [c for c in self._admin_models() if c["id"] == model]
            if not cards:
                return await _not_found(send, rid, "openai", "model_not_found")
            # As upstream: `/v1/models/{model}`'s card, with its agent list.
            card = models.detail(cards[0], self.table.for_model(model))
            await send_json(send, 200, card, extra)
        elif path == "/admin/policy" and method == "GET":
            vary = ("vary", "accept")
            if admin.wants_json(header(scope, b"accept")):
                # Upstream answers JSON; its scripts ask for it, and `jq` reads it.
                # One ETag for both forms: a script may send either back in If-Match.
                tag = etag(self.store.version())
                await send_json(send, 200, admin.policy_json(self.store), [*extra, tag, vary])
                return 200
            body = self.store.current.source.encode()
            tag = etag(self.store.version())
            await send_bytes(send, 200, body, "application/yaml", [*extra, tag, vary])
        elif path == "/admin/policy" and method == "PUT":
            return await admin.put_document(
                self.store,
                scope,
                receive,
                send,
                extra,
                lambda: {
                    "status": "policy updated",  # upstream's words, which its scripts read
                    "chain": self.store.current.chain_names(),
                    "version": self.store.version(),
                },
                flat=True,  # upstream's `{"error": "…"}`
            )
        elif path == PREFIX or path.startswith(PREFIX + "/"):
            return await admin_policy_models(self.store, scope, receive, send, extra)
        elif path == "/admin/auth" and self.tenants:
            return await admin_auth(self.tenants, scope, receive, send, extra)
        elif path == KEYS_PREFIX or path.startswith(KEYS_PREFIX + "/"):
            registry = self.tenants.registry if self.tenants else None
            return await admin_api_keys(registry, scope, receive, send, extra)
        elif self.console is not None and self.console.handles(path):
            return await self.console.admin(scope, receive, send, extra)
        elif path in _ADMIN_METHODS:
            return await _not_allowed(send, rid, "openai", _ADMIN_METHODS[path])
        else:
            return await _not_found(send, rid, "openai")
        return 200

    def _audit_admin(self, scope: Scope, rid: str, status: int, elapsed: float) -> None:
        """Every admin call's audit line, reads too, as upstream: an operator asks who
        looked at the routing table as well as who changed a key."""
        if self.tenants is not None and self.tenants.audit_log is not None:
            record = AdminRecord(
                action=scope["method"],
                target=scope["path"],
                status=status,
                key_id=self.admin_keys.key_id(scope),
                source_ip=self.proxies.client_ip(scope),
                request_id=rid,
                duration_s=elapsed,
            )
            self.tenants.audit_admin(record)

    def _audit_v1(self, scope: Scope, rid: str, tenant: str, status: int, elapsed: float) -> None:
        assert self.tenants is not None
        if self.tenants.audit_log is not None:
            key = scope.get(API_KEY)
            self.tenants.audit(
                None,
                scope["path"],
                rid,
                tenant,
                status,
                elapsed,
                key_id=key.id if key is not None else None,
                source_ip=self.proxies.client_ip(scope),
            )

    def _admin_models(self) -> list[dict]:
        cards = []
        for card in self.client.models():
            peers = self.table.for_model(card["id"])
            card["agent_peer_ids"] = [p.peer_id for p in peers]
            card["active_requests"] = sum(p.active for p in peers)
            card["queue_length"] = self.queue.length(card["id"])
            cards.append(models.with_display(card, peers))
        return cards


def _with_traceparent(send: Send, span: Span) -> Send:
    """The response names the request's trace (W3C `traceparent`), so a client can find it."""
    headers = [(b"traceparent", (span.traceparent() or "").encode())]
    return with_headers(send, lambda: headers)


def _with_anthropic_request_id(send: Send, rid: str) -> Send:
    """The request ID also as `request-id`, Anthropic's name for it: the anthropic SDK
    reads only that one (`request_id` of a message, a raw response or an APIError)."""
    headers = [(b"request-id", rid.encode("latin-1"))]
    return with_headers(send, lambda: headers)


def _fleet_scope(scope: Scope) -> bool:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return query.get("scope", [""])[-1] == "fleet"


# Upstream's challenge, realm and all.
_CHALLENGE = ("www-authenticate", 'Bearer realm="hivenet-router"')
_ADMIN_METHODS = {
    "/admin/routing-table": "GET",
    "/admin/health": "GET",
    "/admin/registration-stream": "GET",
    "/admin/storage": "GET",
    "/admin/metrics/reset": "POST",
    "/admin/models": "GET",
    "/admin/policy": "GET, PUT",
    "/admin/auth": "GET, PUT",
}


def protocol_of(path: str) -> str:
    """The error format a caller of `path` understands (Anthropic's under /v1/messages)."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return "openai"


# What a GET answers, HEAD answers too, without the body (the server leaves it out):
# load balancers' health checks and monitors may ask either way.
_READ_METHODS = ("GET", "HEAD")


async def _not_found(send: Send, rid: str, protocol: str, code: str = "not_found") -> int:
    message = "no agent serves this model" if code == "model_not_found" else "no such endpoint"
    err = RouterError(ErrorCode(code), message)
    await send_json(send, 404, error_payload(protocol, err), [("x-request-id", rid)])
    return 404


async def _not_allowed(
    send: Send, rid: str, protocol: str, allow: str, ticket: Ticket | None = None
) -> int:
    err = RouterError(ErrorCode.METHOD_NOT_ALLOWED, f"method not allowed; use {allow}")
    headers = [("x-request-id", rid), ("allow", allow)]
    return await send_error(send, protocol, err, headers, ticket)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def with_lifespan(app: Any) -> Any:
    """Answer ASGI lifespan events for an app that does not (prometheus_client's)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        else:
            await app(scope, receive, send)

    return wrapped


def metrics_only(app: Any) -> Any:
    """prometheus_client's app, at `GET /metrics` (and HEAD) only, as Prometheus scrapes
    it; it answers the page to any path and method of its own."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (
            scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD")
        ):
            await app(scope, receive, send)
            return
        status = 404 if scope["path"] != "/metrics" else 405
        body = b"only GET /metrics here\n"
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
        if status == 405:
            headers.append((b"allow", b"GET, HEAD"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return wrapped
