"""What agent sessions that have not joined may hold: counted per connection, per
source address and in all.

Before its hello a session has only passed a Noise handshake, which any key passes, and
peer IDs cost nothing to make. Each such session may hold one frame of at most
HELLO_FRAME_BYTES (protocol/frames.py) for at most the hello timeout, so these counts
bound the router's memory for strangers: 4 sessions per connection hold at most
256 KiB, 64 per address 4 MiB, 1,024 in all 64 MiB. A stream over a count is reset
before anything is read from it. An agent opens one stream per session and a router
answers its hello within milliseconds, so a fleet behind one NAT address that reconnects
all at once (a router restart) is slowed by the per-address count, not kept out: a
refused agent dials again within its backoff (0.2 to 5 s).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from protocol.frames import HELLO_FRAME_BYTES

# An IPv6 host holds a /64 and picks addresses from it at will.
IPV6_PREFIX = 64


@dataclass(frozen=True)
class UnjoinedLimits:
    per_connection: int = 4
    per_address: int = 64
    total: int = 1024
    frame_bytes: int = HELLO_FRAME_BYTES


def source_of(remote: tuple[str, int] | None) -> str:
    """The address a connection's sessions are counted under: the IPv4 address, or the
    IPv6 /64 (an IPv4-mapped address counts as its IPv4 address)."""
    if remote is None:
        return "unknown"
    host = remote[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/{IPV6_PREFIX}", strict=False))
    return str(ip)


class Unjoined:
    """Live counts of sessions that have not joined, and the check on each new one."""

    def __init__(self, limits: UnjoinedLimits) -> None:
        self.limits = limits
        self.total = 0
        self._by_connection: dict[int, int] = {}
        self._by_source: dict[str, int] = {}

    def __repr__(self) -> str:
        return (
            f"<Unjoined {self.total} sessions on {len(self._by_connection)} connections "
            f"from {len(self._by_source)} addresses>"
        )

    def enter(self, connection: int, source: str) -> str | None:
        """Count a new session; or, over a limit, the reason it is refused (not counted)."""
        limits = self.limits
        if self._by_connection.get(connection, 0) >= limits.per_connection:
            return f"{limits.per_connection} unjoined sessions on this connection already"
        if self._by_source.get(source, 0) >= limits.per_address:
            return f"{limits.per_address} unjoined sessions from {source} already"
        if self.total >= limits.total:
            return f"{limits.total} unjoined sessions in all already"
        self._by_connection[connection] = self._by_connection.get(connection, 0) + 1
        self._by_source[source] = self._by_source.get(source, 0) + 1
        self.total += 1
        return None

    def leave(self, connection: int, source: str) -> None:
        self.total -= 1
        _decrement(self._by_connection, connection)
        _decrement(self._by_source, source)

    def on_source(self, source: str) -> int:
        return self._by_source.get(source, 0)


def _decrement(counts: dict, key: object) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
