"""`/admin/api-keys[…]`: the dynamic client-key registry, with upstream's paths, bodies
and answers (router/tenants/registry.py holds the registry itself).

Errors are upstream's simple `{"error": "…"}`, plus `errors` with each reason: a 400
lists every problem of the write, a stale version is 409 with `current_version`, a
router not in dynamic mode answers 501.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from router.documents import Contended, PreconditionFailed, etag
from router.http.asgi import BodyTooLarge, ClientGone, Receive, Scope, Send, read_body, send_json
from router.http.preconditions import if_match, send_contended, send_precondition_failed
from router.tenants.registry import (
    MAX_ENTRY_BYTES,
    MAX_REGISTRY_BYTES,
    KeyRegistry,
    StaleVersion,
)

PREFIX = "/admin/api-keys"
ORIGIN = "admin_api"


@dataclass(frozen=True)
class _Answered:
    """A body that could not be read: the status already sent."""

    status: int


async def admin_api_keys(
    registry: KeyRegistry | None,
    scope: Scope,
    receive: Receive,
    send: Send,
    extra: list[tuple[str, str]],
) -> int:
    if registry is None:
        # Upstream's body, word for word; what to do about it beside it.
        hint = "start the router with HIVENET_ROUTER_AUTH_MODE=dynamic or api.mode: dynamic"
        body = {"error": "dynamic key registry not active", "hint": hint + " in the auth file"}
        return await _answer(send, extra, 501, body)
    path, method = scope["path"], scope["method"]
    rest = path[len(PREFIX) :].strip("/")
    current = registry.current
    if rest == "":
        if method != "GET":
            return await _not_allowed(send, extra, "GET")
        keys = [current.public(k) for k in sorted(current.entries)]
        # The tag `If-Match` names on a write (router/http/preconditions.py).
        tagged = [*extra, etag(registry.version())]
        return await _answer(send, tagged, 200, {"count": len(keys), "keys": keys})
    if rest == "version":
        if method != "GET":
            return await _not_allowed(send, extra, "GET")
        body = {"version": current.version, "count": len(current.entries)}
        return await _answer(send, extra, 200, body)
    if rest == "replace":
        if method != "POST":
            return await _not_allowed(send, extra, "POST")
        raw = await _json_body(scope, receive, send, extra, MAX_REGISTRY_BYTES)
        if isinstance(raw, _Answered):
            return raw.status
        build = lambda: registry.replaced_by(raw)  # noqa: E731
        return await _write(registry, scope, send, extra, build, count=True)
    key_id = rest
    if method == "GET":
        if key_id not in current.entries:
            return await _answer(send, extra, 404, {"error": f"key not found: {key_id}"})
        return await _answer(send, extra, 200, {"key": current.public(key_id)})
    if method == "DELETE":
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        version = query.get("version", [None])[-1]
        if version is None:
            why = "the version query parameter is required (?version=rev_00000043)"
            return await _answer(send, extra, 400, {"error": why, "errors": [why]})
        build = lambda: registry.without_entry(key_id, version)  # noqa: E731
        return await _write(registry, scope, send, extra, build)
    if method != "PUT":
        return await _not_allowed(send, extra, "GET, PUT, DELETE")
    raw = await _json_body(scope, receive, send, extra, MAX_ENTRY_BYTES)
    if isinstance(raw, _Answered):
        return raw.status
    if not isinstance(raw, dict):
        why = "body: must be a JSON object (a key entry with its version)"
        return await _answer(send, extra, 400, {"error": why, "errors": [why]})
    build = lambda: registry.with_entry(key_id, raw)  # noqa: E731
    return await _write(registry, scope, send, extra, build, entry_of=key_id)


async def _write(
    registry: KeyRegistry,
    scope: Scope,
    send: Send,
    extra: list[tuple[str, str]],
    build: Any,
    count: bool = False,
    entry_of: str | None = None,
) -> int:
    # With --state-url `build` runs on the fleet's registry (router/fleet/config_sync.py).
    try:
        errors = await registry.edit(build, ORIGIN, if_match(scope))
    except StaleVersion as exc:
        body = {"error": "stale version", "current_version": exc.current}
        return await _answer(send, extra, 409, body)
    except PreconditionFailed as exc:
        return await send_precondition_failed(send, extra, exc.current)
    except Contended:
        return await send_contended(send, extra)
    if errors:
        if entry_of is not None:
            # A refused write left the registry it was built from running.
            entry_at = len([k for k in registry.current.entries if k != entry_of])
            # One key's write: its reasons name its fields, not its place in the registry.
            at = f"keys[{entry_at}]"
            errors = [e.replace(f"{at}.", "").replace(f"{at}:", "entry:") for e in errors]
        return await _answer(send, extra, 400, {"error": "; ".join(errors), "errors": errors})
    body: dict[str, Any] = {"ok": True}
    if count:
        body["count"] = len(registry.current.entries)
    return await _answer(send, [*extra, etag(registry.version())], 200, body)


async def _json_body(
    scope: Scope, receive: Receive, send: Send, extra: list[tuple[str, str]], limit: int
) -> object:
    """The JSON body, or what was answered instead."""
    try:
        raw = await read_body(scope, receive, limit)
    except BodyTooLarge:
        why = f"request body over {limit} bytes"
        return _Answered(await _answer(send, extra, 400, {"error": why, "errors": [why]}))
    except ClientGone:
        return _Answered(499)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        why = f"body: invalid JSON ({exc})"
        return _Answered(await _answer(send, extra, 400, {"error": why, "errors": [why]}))


async def _not_allowed(send: Send, extra: list[tuple[str, str]], allow: str) -> int:
    body = {"error": f"method not allowed; use {allow}"}
    return await _answer(send, [*extra, ("allow", allow)], 405, body)


async def _answer(send: Send, extra: list[tuple[str, str]], status: int, body: dict) -> int:
    await send_json(send, status, body, extra)
    return status
