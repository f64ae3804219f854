"""Client keys from `HIVENET_ROUTER_API_KEYS` (no auth file), compared in constant time."""

from __future__ import annotations

import hmac

DEFAULT_TENANT = "default"


def keys_match(given: str, known: str) -> bool:
    return hmac.compare_digest(given.encode(), known.encode())


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

    def tenant(self, keys: list[str]) -> str | None:
        """The tenant of the presented `keys`, or None when keys are required and none
        matches."""
        if not self.tenants:
            return DEFAULT_TENANT
        found = None
        # Every presented key against every known key: timing reveals nothing.
        for given in keys:
            for key, tenant in self.tenants.items():
                if keys_match(given, key) and found is None:
                    found = tenant
        return found
