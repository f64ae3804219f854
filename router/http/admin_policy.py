"""`/admin/policy/models[/{name}]`: the named per-model policies, as the Go router
serves them (GET the list or one, PUT to create or replace, DELETE idempotently).

Like `PUT /admin/policy`, a change lasts until the next restart or directory reload;
files under `--policy-model-dir` are what persists. With `--state-url` a change reaches
the other routers (router/fleet/config_sync.py); the list's `ETag` is then the same on
every router once they agree. A document's GET and PUT answer with its `ETag`; a PUT or
DELETE with `If-Match` is refused (412, the current tag) unless it names the running
document, the fleet's with `--state-url` (router/http/preconditions.py).
"""

from __future__ import annotations

from protocol.errors import ErrorCode, RouterError, error_payload
from router.documents import Contended, PreconditionFailed, version_of
from router.documents import etag as document_etag
from router.http.admin import MAX_DOCUMENT_BYTES, send_rejected
from router.http.asgi import BodyTooLarge, ClientGone, Receive, Scope, Send, read_body, send_json
from router.http.preconditions import if_match, send_contended, send_precondition_failed
from router.policy.models import ModelConflict, check_name
from router.policy.store import PolicyStore

PREFIX = "/admin/policy/models"


async def admin_policy_models(
    store: PolicyStore, scope: Scope, receive: Receive, send: Send, extra: list[tuple[str, str]]
) -> int:
    path, method = scope["path"], scope["method"]
    if path in (PREFIX, PREFIX + "/"):
        if method != "GET":
            return await _error(send, extra, ErrorCode.METHOD_NOT_ALLOWED, "use GET", 405)
        texts = sorted((n, d.policy.source) for n, d in store.models.named.items())
        etag = ("etag", '"' + version_of("\0".join(f"{n}\0{t}" for n, t in texts)) + '"')
        await send_json(send, 200, store.models.view(), [*extra, etag])
        return 200
    name = path[len(PREFIX) + 1 :]
    why = check_name(name)
    if why is not None:
        return await _error(send, extra, ErrorCode.REQUEST_INVALID, why, 400)
    if method == "GET":
        version = store.named_version(name)
        if version is None:
            return await _error(send, extra, ErrorCode.NOT_FOUND, f"no policy {name!r}", 404)
        body = {"name": name, **store.models.describe(name)}
        await send_json(send, 200, body, [*extra, document_etag(version)])
        return 200
    if method not in ("PUT", "DELETE"):
        return await _error(send, extra, ErrorCode.METHOD_NOT_ALLOWED, "use GET, PUT, DELETE", 405)
    text: str | None = None
    if method == "PUT":
        try:
            text = (await read_body(scope, receive, MAX_DOCUMENT_BYTES)).decode("utf-8")
        except (BodyTooLarge, UnicodeDecodeError):
            errors = store.reject(["policy body must be UTF-8 YAML under 1 MiB"], "admin_api")
            return await send_rejected(send, extra, "policy", errors)
        except ClientGone:
            return 499
    try:
        errors = await store.change_named(name, text, "admin_api", if_match(scope))
    except ModelConflict as exc:
        store.reject([str(exc)], "admin_api")
        return await _error(send, extra, ErrorCode.REQUEST_INVALID, str(exc), 409)
    except PreconditionFailed as exc:
        return await send_precondition_failed(send, extra, exc.current)
    except Contended:
        return await send_contended(send, extra)
    if errors:
        return await send_rejected(send, extra, "policy", errors)
    version = store.named_version(name)
    if text is None or version is None:
        await send_json(send, 200, {"status": "policy deleted", "name": name}, extra)
        return 200
    models = list(store.models.named[name].policy.models)
    body = {"status": "policy updated", "name": name, "models": models}
    await send_json(send, 200, body, [*extra, document_etag(version)])
    return 200


async def _error(
    send: Send, extra: list[tuple[str, str]], code: ErrorCode, message: str, status: int
) -> int:
    err = RouterError(code, message, status=status)
    await send_json(send, status, error_payload("openai", err), extra)
    return status
