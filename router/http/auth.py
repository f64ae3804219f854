"""Admin and client API keys, compared in constant time."""

from __future__ import annotations

import hmac

from router.http.asgi import Scope, header

DEFAULT_TENANT = "default"


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


def _matches(given: str, known: str) -> bool:
    return hmac.compare_digest(given.encode(), known.encode())


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
        return any([_matches(given, k) for k in self.keys])


class ClientKeys:
    """`key:tenant,key2:tenant2`; without keys every client is tenant `default`."""

    def __init__(self, spec: str) -> None:
        self.tenants: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, tenant = part.partition(":")
            if key.strip():
                self.tenants[key.strip()] = tenant.strip() or DEFAULT_TENANT

    @property
    def required(self) -> bool:
        return bool(self.tenants)

    def tenant(self, scope: Scope) -> str | None:
        """The caller's tenant, or None when keys are required and none matches."""
        if not self.tenants:
            return DEFAULT_TENANT
        found = None
        # Every presented key against every known key: timing reveals nothing.
        for given in presented_keys(scope, allow_x_api_key=True):
            for key, tenant in self.tenants.items():
                if _matches(given, key) and found is None:
                    found = tenant
        return found
