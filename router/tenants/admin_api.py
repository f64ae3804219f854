"""`GET /admin/auth` (the tenants without their key hashes) and `PUT /admin/auth`."""

from __future__ import annotations

from protocol.errors import ErrorCode, RouterError
from router.http.asgi import BodyTooLarge, ClientGone, Receive, Scope, Send, read_body, send_json
from router.http.client import error_payload
from router.tenants.gate import TenantGate

MAX_AUTH_BYTES = 1024 * 1024


async def admin_auth(
    gate: TenantGate, scope: Scope, receive: Receive, send: Send, extra: list[tuple[str, str]]
) -> int:
    method = scope["method"]
    if method == "GET":
        await send_json(send, 200, gate.admin_view(), extra)
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
    else:
        try:
            text = (await read_body(scope, receive, MAX_AUTH_BYTES)).decode("utf-8")
        except (BodyTooLarge, UnicodeDecodeError):
            errors = gate.store.reject(["auth body must be UTF-8 YAML under 1 MiB"], "admin_api")
        except ClientGone:
            return 499
        else:
            errors = gate.store.replace(text, "admin_api")
    if errors:
        err = RouterError(ErrorCode.REQUEST_INVALID, "auth file rejected: " + "; ".join(errors))
        payload = error_payload("openai", err)
        payload["error"]["errors"] = errors
        await send_json(send, 400, payload, extra)
        return 400
    tenants = sorted(gate.store.current.tenants) if gate.store.current else []
    await send_json(send, 200, {"status": "ok", "tenants": tenants}, extra)
    return 200
