"""`If-Match` on the admin API's writes (`PUT /admin/policy`, `PUT /admin/auth`, the
`/admin/api-keys` writes): the `ETag` a script read must still name the running
document, which with `--state-url` is the fleet's (router/fleet/config_sync.py), so a
stale tag is refused on every router, not only on the one it was read from.

A stale tag is 412 with the current one in `ETag` and `current_etag`, so a script can
read again and retry; a write that lost too many races to other routers' writes at
once is 503 with `Retry-After: 1`.
"""

from __future__ import annotations

from router.documents import etag
from router.http.asgi import Scope, Send, header, send_json


def if_match(scope: Scope) -> str | None:
    return header(scope, b"if-match")


async def send_precondition_failed(send: Send, extra: list[tuple[str, str]], current: str) -> int:
    tag = etag(current)
    body = {
        "error": f"If-Match does not name the running document: its ETag is now {tag[1]}",
        "current_etag": tag[1],
    }
    await send_json(send, 412, body, [*extra, tag])
    return 412


async def send_contended(send: Send, extra: list[tuple[str, str]]) -> int:
    body = {"error": "other routers wrote this document at the same moment: retry the write"}
    await send_json(send, 503, body, [*extra, ("retry-after", "1")])
    return 503
