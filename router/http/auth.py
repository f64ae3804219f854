"""The keys a request presents, and the admin API's keys, compared in constant time."""

from __future__ import annotations

import hashlib

from router.http.asgi import Scope, header
from router.tenants.keys import keys_match


def bearer_key(scope: Scope) -> str | None:
    """The key of `Authorization: Bearer <key>`, or of a raw `Authorization: <key>`,
    which upstream accepts too (clients and admin keys alike). Another scheme's value
    (`Basic …`) is taken whole, so it matches no key."""
    auth = header(scope, b"authorization")
    if not auth:
        return None
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return auth.strip() or None


def presented_keys(scope: Scope, allow_x_api_key: bool) -> list[str]:
    """`Authorization: Bearer` (OpenAI SDKs; the raw key without `Bearer` too) and, for
    clients, `x-api-key` (Anthropic's)."""
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
    """The admin API's keys as SHA-256 digests, compared in constant time. `replace`
    swaps them at once (SIGHUP with HIVENET_ROUTER_ADMIN_API_KEYS_FILE): the next
    request is checked against the new set, so a retired key fails right away."""

    def __init__(self, keys: list[str], insecure: bool) -> None:
        self.insecure = insecure
        self.digests: tuple[str, ...] = ()
        self.replace(keys)

    @property
    def keys(self) -> tuple[str, ...]:
        """The digests: empty when the admin API has no keys."""
        return self.digests

    def replace(self, keys: list[str]) -> None:
        self.digests = tuple(dict.fromkeys(_digest(k) for k in keys))

    def key_id(self, scope: Scope) -> str | None:
        """Which admin key the request presents (`admin-` and 8 hex digits of its
        digest, what the audit log names), or None when it presents none of them."""
        given = bearer_key(scope)
        if given is None:
            return None
        digest = _digest(given)
        # Compare against every key so timing does not reveal which one matched.
        found = [keys_match(digest, k) for k in self.digests]
        return f"admin-{digest[:8]}" if any(found) else None

    def allows(self, scope: Scope) -> bool:
        if not self.digests:
            return self.insecure
        return self.key_id(scope) is not None


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
