"""`GET /admin/auth` (the tenants without their key hashes) and `PUT /admin/auth`."""

from __future__ import annotations

from protocol.errors import ErrorCode, RouterError, error_payload
from router.documents import etag
from router.http.admin import put_document, send_rejected
from router.http.asgi import Receive, Scope, Send, send_json
from router.tenants.gate import TenantGate


async def admin_auth(
    gate: TenantGate, scope: Scope, receive: Receive, send: Send, extra: list[tuple[str, str]]
) -> int:
    method = scope["method"]
    if method == "GET":
        await send_json(send, 200, gate.admin_view(), [*extra, etag(gate.store.version())])
        return 200
    if method != "PUT":
        err = RouterError(ErrorCode.METHOD_NOT_ALLOWED, "method not allowed; use GET, PUT")
        await send_json(send, 405, error_payload("openai", err), [*extra, ("allow", "GET, PUT")])
        return 405
    if gate.store.path is None:
        errors = [
            "this router runs without --auth-file (HIVENET_ROUTER_API_KEYS or no keys);"
            " start it with --auth-file to manage tenants"
        ]
        return await send_rejected(send, extra, gate.store.noun, errors)

    def accepted() -> dict:
        tenants = sorted(gate.store.current.tenants) if gate.store.current else []
        return {"tenants": tenants, "version": gate.store.version()}

    return await put_document(gate.store, scope, receive, send, extra, accepted)
