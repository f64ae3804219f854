"""The client address an audit line names: the socket's peer, unless the operator
names the proxies in front of the router (`--trusted-proxies CIDR,...`).

A forwarding header is written by whoever sends the request, so it is believed only
when the peer is one of those proxies; then `X-Forwarded-For` is read from its right
end, each hop a trusted proxy added, and the first address that is not a trusted proxy
is the client (the left part is the client's own word). Without that header
`X-Real-IP` is read the same way. These are the headers, and the order, upstream's
Gin router reads.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_HEADERS = (b"x-forwarded-for", b"x-real-ip")
# Hops read from a header's right end: a proxy chain is a handful of hops, and a
# header of 10,000 commas must not cost 10,000 parses per request.
MAX_HOPS = 16


@dataclass(frozen=True)
class TrustedProxies:
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> TrustedProxies:
        """`10.0.0.0/8,192.168.1.7`: CIDRs or single addresses; ValueError names the
        entry that is neither."""
        networks: list[IPNetwork] = []
        for item in (text or "").split(","):
            item = item.strip()
            if not item:
                continue
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ValueError(
                    f"--trusted-proxies: {item!r} is not an address or CIDR (10.0.0.0/8)"
                ) from None
        return cls(tuple(networks))

    def trusts(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.networks)

    def client_ip(self, scope: dict[str, Any]) -> str:
        """The client's address for `scope`: its peer, or what the trusted proxies
        say; "" when the server knows no peer (a Unix socket)."""
        client = scope.get("client")
        peer = str(client[0]) if client else ""
        if not self.networks or not self.trusts(peer):
            return peer
        for name in _HEADERS:
            values = [v for k, v in scope.get("headers", ()) if k.lower() == name]
            if values:
                found = self._from_header(values)
                if found:
                    return found
        return peer

    def _from_header(self, values: Sequence[bytes]) -> str:
        hops = b",".join(values).decode("latin-1").split(",")[-MAX_HOPS:]
        address = ""
        for hop in reversed(hops):
            hop = hop.strip()
            try:
                # No IPv6 zone (`fe80::1%eth0`): the parser takes any text after the `%`,
                # which a client would write into the audit line, and a zone of the
                # proxy's own host names no client anyway.
                if "%" in hop:
                    raise ValueError(hop)
                address = str(ipaddress.ip_address(hop))
            except ValueError:
                return ""  # a hop that is no address: the chain cannot be followed
            if not self.trusts(address):
                return address
        return address  # every hop a trusted proxy: the leftmost one read
