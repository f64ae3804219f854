"""CORS for browser clients (the Go router's middleware): every answer to a request
with an `Origin` carries `Access-Control-Allow-Origin: *`, and a preflight `OPTIONS`
is answered 204 before authentication, neither logged nor audited.

`*` is safe here: callers authenticate with a bearer key in a header, never a cookie,
so no browser sends credentials on their behalf.
"""

from __future__ import annotations

from router.http.asgi import Headers, Scope, Send, header, with_headers

ALLOW_METHODS = "GET, POST, PUT, DELETE, OPTIONS"
ALLOW_HEADERS = (
    "Authorization, Content-Type, X-API-Key, X-Request-ID, anthropic-version, anthropic-beta"
)
# `request-id` is the request ID under Anthropic's name (/v1/messages), the one its SDK
# reads.
EXPOSE_HEADERS = (
    "X-Request-ID, request-id, Retry-After, X-RateLimit-Remaining-Requests,"
    " X-RateLimit-Remaining-Tokens"
)
# Browsers cap it anyway (Chromium: 2 hours); 10 minutes keeps a policy change visible.
MAX_AGE = "600"
# A preflight's echoed header list is capped: it comes from the client.
MAX_REQUEST_HEADERS = 1024


def is_preflight(scope: Scope) -> bool:
    return (
        scope["method"] == "OPTIONS"
        and header(scope, b"origin") is not None
        and header(scope, b"access-control-request-method") is not None
    )


async def preflight(scope: Scope, send: Send, request_id: str) -> None:
    asked = header(scope, b"access-control-request-headers") or ""
    allowed = asked if asked and len(asked) <= MAX_REQUEST_HEADERS else ALLOW_HEADERS
    headers = [
        (b"access-control-allow-origin", b"*"),
        (b"access-control-allow-methods", ALLOW_METHODS.encode()),
        (b"access-control-allow-headers", allowed.encode("latin-1", "replace")),
        (b"access-control-max-age", MAX_AGE.encode()),
        (b"x-request-id", request_id.encode()),
        (b"content-length", b"0"),
    ]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


_ANSWER_HEADERS: Headers = [
    (b"access-control-allow-origin", b"*"),
    (b"access-control-expose-headers", EXPOSE_HEADERS.encode()),
]


def with_cors(scope: Scope, send: Send) -> Send:
    """`send`, adding the CORS headers when the request came from a browser."""
    if header(scope, b"origin") is None:
        return send
    return with_headers(send, lambda: _ANSWER_HEADERS)
