"""Admin and client API keys, compared in constant time."""

from __future__ import annotations

import hmac

from router.http.asgi import Scope, header

DEFAULT_TENANT = "default"


def presented_key(scope: Scope, allow_x_api_key: bool) -> str | None:
    auth = header(scope, b"authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    if allow_x_api_key:
        return header(scope, b"x-api-key")
    return None


def _matches(given: str, known: str) -> bool:
    return hmac.compare_digest(given.encode(), known.encode())


class AdminKeys:
    def __init__(self, keys: list[str], insecure: bool) -> None:
        self.keys = keys
        self.insecure = insecure

    def allows(self, scope: Scope) -> bool:
        if not self.keys:
            return self.insecure
        given = presented_key(scope, allow_x_api_key=False)
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
            self.tenants[key.strip()] = tenant.strip() or DEFAULT_TENANT

    @property
    def required(self) -> bool:
        return bool(self.tenants)

    def tenant(self, scope: Scope) -> str | None:
        """The caller's tenant, or None when keys are required and none matches."""
        if not self.tenants:
            return DEFAULT_TENANT
        given = presented_key(scope, allow_x_api_key=True)
        if given is None:
            return None
        found = None
        for key, tenant in self.tenants.items():
            if _matches(given, key):
                found = tenant
        return found
