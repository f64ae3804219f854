"""The operator console: its static page at `/ui`, and the admin endpoints only it
added (`POST /admin/explain`, `GET /admin/exclusions`, `GET /admin/requests[/{id}]`,
`POST /admin/policy/validate`, `GET /admin/tenants/usage`).

The page is three static files and holds no data: everything it shows comes from the
admin API, with the admin key the operator typed into its login form, sent as an
`Authorization` header. The key lives in the tab's sessionStorage and nowhere else
(no cookie, no URL), so a page of another site can neither read it nor make the
browser send it: a cross-site request reaches the admin API without a key and is
refused, which is what protects the state-changing calls. The page's answers carry a
Content Security Policy that allows only the console's own script and style (no inline
script, no eval, no other origin), `frame-ancestors 'none'` and `X-Frame-Options: DENY`
(no framing, so no clickjacking), and the script writes every agent-supplied string
with `textContent`.

The console costs a request nothing while nobody looks, beyond the recent-requests
ring (router/recent.py); `--no-ui` turns that off too.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from protocol.errors import ErrorCode, RouterError, error_payload
from router.explain import (
    MAX_EXPLAIN_BYTES,
    Explainer,
    ExplainInvalid,
    exclusions,
    parse_request,
)
from router.http.admin import MAX_DOCUMENT_BYTES
from router.http.asgi import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    read_body,
    send_bytes,
    send_json,
)
from router.http.auth import presented_keys
from router.http.client import ENDPOINTS, ROUTE
from router.policy.store import PolicyStore
from router.recent import FILTERS, RecentRequest, RecentRequests, story
from router.tenants.config import hash_key
from router.tenants.gate import TenantGate
from router.tenants.keys import ClientKeys
from router.tenants.upstream_auth import new_upstream_key, preview

PAGE_PREFIX = "/ui"
_STATIC = "console_static"
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
}
# Only the console's own files, from its own origin; nothing inline, nothing framed.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = [
    ("content-security-policy", CSP),
    ("x-frame-options", "DENY"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
    ("cache-control", "no-store"),
]
ADMIN_PATHS = (
    "/admin/explain",
    "/admin/exclusions",
    "/admin/requests",
    "/admin/policy/validate",
    "/admin/tenants/usage",
    "/admin/keygen",
)
MAX_LISTED = 500
# difflib's line diff is quadratic at worst, and runs on the router's one thread: two
# policies of 40,000 lines took it 2.4 s, of 5,000 lines 0.05 s. A policy is a few
# hundred lines; past this many line pairs the diff is left out.
MAX_DIFF_PAIRS = 25_000_000


def _load_static() -> dict[str, tuple[bytes, str]]:
    files: dict[str, tuple[bytes, str]] = {}
    root = resources.files("router.http").joinpath(_STATIC)
    for item in root.iterdir():
        suffix = "." + item.name.rsplit(".", 1)[-1]
        if item.is_file() and suffix in _TYPES:
            files[item.name] = (item.read_bytes(), _TYPES[suffix])
    return files


class Console:
    def __init__(
        self,
        explainer: Explainer,
        recent: RecentRequests,
        store: PolicyStore,
        client_keys: ClientKeys,
        tenants: TenantGate | None = None,
        ui: bool = True,
    ) -> None:
        self.explainer = explainer
        # `--no-ui`: no page and no ring; explain and the other endpoints stay, for scripts.
        self.ui = ui
        self.recent = recent if ui else None
        self.store = store
        self.client_keys = client_keys
        self.tenants = tenants
        self.files = _load_static()

    def __repr__(self) -> str:
        return f"<Console {len(self.files)} files, {self.recent!r}>"

    # --- the recent-requests ring --------------------------------------------------------

    def begin(self, rid: str, path: str) -> RecentRequest | None:
        recent = self.recent
        if recent is None or path not in ENDPOINTS:
            return None
        return recent.begin(rid, path)

    def end(
        self, entry: RecentRequest, scope: Scope, status: int, tenant: str, elapsed: float
    ) -> None:
        assert self.recent is not None
        route = scope.get(ROUTE)
        if route is not None:
            entry.model, entry.agent, entry.tries = route.model, route.agent, route.tries
        entry.status, entry.tenant, entry.latency_ms = status, tenant, elapsed * 1000
        self.recent.end(entry)

    # --- the page ----------------------------------------------------------------------

    async def page(self, scope: Scope, send: Send, rid: str) -> int:
        path, method = scope["path"], scope["method"]
        extra = [("x-request-id", rid), *SECURITY_HEADERS]
        name = path[len(PAGE_PREFIX) :]
        if name and not name.startswith("/"):
            name = "?"  # /uifoo is no console file
        found = self.files.get(name.lstrip("/") or "index.html")
        if found is None:
            err = RouterError(ErrorCode.NOT_FOUND, "no such console file")
            await send_json(send, 404, error_payload("openai", err), extra)
            return 404
        if method not in ("GET", "HEAD"):
            err = RouterError(ErrorCode.METHOD_NOT_ALLOWED, "method not allowed; use GET")
            await send_json(send, 405, error_payload("openai", err), [*extra, ("allow", "GET")])
            return 405
        body, content_type = found
        await send_bytes(send, 200, body, content_type, extra)
        return 200

    # --- its admin endpoints -------------------------------------------------------------

    def handles(self, path: str) -> bool:
        return path in ADMIN_PATHS or path.startswith("/admin/requests/")

    async def admin(
        self, scope: Scope, receive: Receive, send: Send, extra: list[tuple[str, str]]
    ) -> int:
        path, method = scope["path"], scope["method"]
        routes: dict[tuple[str, str], Callable[..., Any]] = {
            ("POST", "/admin/explain"): self._explain,
            ("GET", "/admin/exclusions"): self._exclusions,
            ("GET", "/admin/requests"): self._requests,
            ("POST", "/admin/policy/validate"): self._validate,
            ("GET", "/admin/tenants/usage"): self._usage,
            ("POST", "/admin/keygen"): self._keygen,
        }
        if path.startswith("/admin/requests") and self.recent is None:
            why = "the recent-requests ring is off with the console (--no-ui)"
            return await _error(send, extra, ErrorCode.NOT_FOUND, why, 404)
        if path.startswith("/admin/requests/") and method == "GET":
            return await self._request(path[len("/admin/requests/") :], send, extra)
        handler = routes.get((method, path))
        if handler is None:
            allow = "GET" if path.startswith("/admin/requests") else _allow(path)
            return await _error(
                send, extra, ErrorCode.METHOD_NOT_ALLOWED, f"method not allowed; use {allow}", 405
            )
        result: int = await handler(scope, receive, send, extra)
        return result

    async def _explain(
        self, scope: Scope, receive: Receive, send: Send, extra: list[tuple[str, str]]
    ) -> int:
        try:
            raw = await read_body(scope, receive, MAX_EXPLAIN_BYTES)
        except BodyTooLarge:
            why = f"explain body exceeds {MAX_EXPLAIN_BYTES} bytes"
            return await _error(send, extra, ErrorCode.REQUEST_INVALID, why, 400)
        except ClientGone:
            return 499
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            why = f"body is not JSON: {exc}"[:300]
            return await _error(send, extra, ErrorCode.REQUEST_INVALID, why, 400)
        try:
            req = parse_request(body, ENDPOINTS)
        except ExplainInvalid as exc:
            return await _error(send, extra, ErrorCode.REQUEST_INVALID, str(exc), 400)
        tenant, priority = self._tenant(req.tenant, req.headers)
        capability = ENDPOINTS[req.path][0]
        answer = self.explainer.explain(req, capability, tenant, priority)
        await send_json(send, 200, answer, extra)
        return 200

    def _tenant(self, named: str | None, headers: dict[str, str]) -> tuple[str, int]:
        """The tenant a request with `headers` would be (its key), or the one named."""
        name = named
        if name is None:
            fake = {
                "headers": [
                    (k.encode("latin-1", "replace"), v.encode("latin-1", "replace"))
                    for k, v in headers.items()
                ]
            }
            keys = presented_keys(fake, allow_x_api_key=True)
            if self.tenants is not None:
                name, _ = self.tenants.identify_key(keys)
            else:
                name = self.client_keys.tenant(keys)
        name = name or "-"
        record = self.tenants.tenant(name) if self.tenants is not None else None
        return name, record.priority if record is not None else 0

    async def _exclusions(
        self, scope: Scope, receive: Receive, send: Send, extra: list[tuple[str, str]]
    ) -> int:
        ex = self.explainer
        body = {"agents": exclusions(ex.table, ex.policy_for, ex.clock())}
        await send_json(send, 200, body, extra)
        return 200

    async def _requests(
        self, scope: Scope, receive: Receive, send: Send, extra: list[tuple[str, str]]
    ) -> int:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        filters = {name: query[name][-1] for name in FILTERS if query.get(name, [""])[-1]}
        try:
            limit = int(query.get("limit", ["100"])[-1])
        except ValueError:
            limit = -1
        if not 1 <= limit <= MAX_LISTED:
            why = f"`limit` must be a whole number from 1 to {MAX_LISTED}"
            return await _error(send, extra, ErrorCode.REQUEST_INVALID, why, 400)
        recent = self.recent
        assert recent is not None
        rows = recent.list(filters, limit)
        body = {"size": recent.size, "count": len(rows), "requests": rows}
        await send_json(send, 200, body, extra)
        return 200

    async def _request(self, rid: str, send: Send, extra: list[tuple[str, str]]) -> int:
        recent = self.recent
        assert recent is not None
        entry = recent.get(rid)
        if entry is None:
            why = "no such request among the recent ones"
            return await _error(send, extra, ErrorCode.NOT_FOUND, why, 404)
        await send_json(send, 200, {**entry.summary(), "lines": story(entry.records)}, extra)
        return 200

    async def _validate(
        self, scope: Scope, receive: Receive, send: Send, extra: list[tuple[str, str]]
    ) -> int:
        """A policy checked as `PUT /admin/policy` would check it, and its diff against
        the running one; nothing is installed."""
        try:
            text = (await read_body(scope, receive, MAX_DOCUMENT_BYTES)).decode("utf-8")
        except (BodyTooLarge, UnicodeDecodeError):
            why = "policy body must be UTF-8 YAML under 1 MiB"
            return await _error(send, extra, ErrorCode.REQUEST_INVALID, why, 400)
        except ClientGone:
            return 499
        store = self.store
        errors: list[str] = []
        chain: list[str] = []
        try:
            chain = store.parse(text).chain_names()
        except Exception as exc:  # DocumentError names every problem; a bug one line
            errors = list(getattr(exc, "errors", None) or [f"{type(exc).__name__}"])
        running = store.current.source.splitlines(keepends=True)
        proposed = text.splitlines(keepends=True)
        if len(running) * len(proposed) > MAX_DIFF_PAIRS:
            diff = (
                f"(diff left out: {len(running)} running and {len(proposed)} proposed lines"
                " are too many to compare here; compare the files with diff)"
            )
        else:
            diff = "".join(
                difflib.unified_diff(
                    running, proposed, f"running (version {store.version()})", "proposed"
                )
            )
        body = {
            "valid": not errors,
            "errors": errors,
            "chain": chain,
            "version": store.version(),
            "diff": diff,
        }
        await send_json(send, 200, body, extra)
        return 200

    async def _keygen(
        self, scope: Scope, receive: Receive, send: Send, extra: list[tuple[str, str]]
    ) -> int:
        """A new client key and its hash, as `hivenet-router keygen` makes them; nothing is
        stored. The console puts the hash in the registry and shows the key once."""
        key = new_upstream_key()
        body = {"key": key, "key_hash": hash_key(key), "preview": preview(key)}
        await send_json(send, 200, body, [*extra, ("cache-control", "no-store")])
        return 200

    async def _usage(
        self, scope: Scope, receive: Receive, send: Send, extra: list[tuple[str, str]]
    ) -> int:
        gate = self.tenants
        config = gate.config if gate is not None else None
        rows = []
        if gate is not None and config is not None:
            local = gate.state.local.counts
            for name, tenant in sorted(config.tenants.items()):
                counts = local.get(name)
                rows.append(
                    {
                        **tenant.public(),
                        "usage": {
                            "inflight": len(counts.inflight) if counts is not None else 0,
                            "tokens_today": gate.state.local.used_today(name),
                        },
                    }
                )
        state = gate.state.mode if gate is not None else "memory"
        body = {"state_store": state, "scope": "this router", "tenants": rows}
        await send_json(send, 200, body, extra)
        return 200


def _allow(path: str) -> str:
    return (
        "POST" if path in ("/admin/explain", "/admin/policy/validate", "/admin/keygen") else "GET"
    )


async def _error(
    send: Send, extra: list[tuple[str, str]], code: ErrorCode, message: str, status: int
) -> int:
    err = RouterError(code, message, status=status)
    await send_json(send, status, error_payload("openai", err), extra)
    return status
