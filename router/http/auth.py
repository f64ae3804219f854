"""The keys a request presents, and the admin API's keys, compared in constant time."""

from __future__ import annotations

from router.http.asgi import Scope, header
from router.tenants.keys import keys_match


def bearer_key(scope: Scope) -> str | None:
    auth = header(scope, b"authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return None


def presented_keys(scope: Scope, allow_x_api_key: bool) -> list[str]:
    """`Authorization: Bearer` (OpenAI SDKs) and, for clients, `x-api-key` (Anthropic's)."""
    keys = []
    bearer = bearer_key(scope)
    if bearer is not None:
        keys.append(bearer)
    if allow_x_api_key:
        x_api_key = header(scope, b"x-api-key")
        if x_api_key and x_api_key.strip():
            keys.append(x_api_key.strip())
    return keys


class AdminKeys:
    def __init__(self, keys: list[str], insecure: bool) -> None:
        self.keys = keys
        self.insecure = insecure

    def allows(self, scope: Scope) -> bool:
        if not self.keys:
            return self.insecure
        given = bearer_key(scope)
        if given is None:
            return False
        # Compare against every key so timing does not reveal which one matched.
        return any([keys_match(given, k) for k in self.keys])
