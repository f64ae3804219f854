"""`X-RateLimit-Remaining-Requests` and `-Tokens` on an admitted inference request's
answer, as the Go router sends them: what the tenant's request bucket and daily token
budget leave after this request; a limit that is not set sends no header (not `-1`).

The token count is the budget before this request's own tokens, which are charged
when its answer ends.
"""

from __future__ import annotations

from router.http.asgi import Headers, Scope, Send, with_headers
from router.http.client import TICKET


def with_quota_headers(scope: Scope, send: Send) -> Send:
    def remaining() -> Headers:
        ticket = scope.get(TICKET)
        if ticket is None:
            return []
        requests, tokens = ticket.remaining
        extra = []
        if requests is not None:
            extra.append((b"x-ratelimit-remaining-requests", str(requests).encode()))
        if tokens is not None:
            extra.append((b"x-ratelimit-remaining-tokens", str(tokens).encode()))
        return extra

    return with_headers(send, remaining)
