"""`--router` without `/p2p/<peer-id>`: the router's peer ID learned at each dial.

libp2p dials a peer ID, never a bare address. So the agent first dials a peer ID of
its own making: the Noise handshake refuses it and names the key the router presented
(`PeerIDMismatchesPubkey`), and the agent then dials that peer ID. The key proves
nothing about who runs it; the router's proof of the shared secret in its welcome
(protocol/router_proof.py) does, and an agent that dialed this way requires it.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

_PRESENTED = re.compile(r"remote_peer_id_from_pubkey=(\w+)")
# The address families a name may resolve to, by its multiaddr protocol.
_NAME_FAMILIES = {"dns": socket.AF_UNSPEC, "dns4": socket.AF_INET, "dns6": socket.AF_INET6}


@dataclass(frozen=True)
class RouterAddress:
    """A `--router` value: its address and, when pinned, the router's peer ID."""

    text: str
    addr: multiaddr.Multiaddr
    peer_id: ID | None  # None: learned at each dial, and the secret proof required

    @property
    def pinned(self) -> bool:
        return self.peer_id is not None


def parse_router(address: str) -> RouterAddress:
    """ValueError says what is wrong with the address."""
    try:
        addr = multiaddr.Multiaddr(address)
        peer_id = None
        if "/p2p/" in address:
            info = info_from_p2p_addr(addr)
            addr, peer_id = info.addrs[0], info.peer_id
        # The agent has only TCP and WebSocket transports: any other address (QUIC, a
        # bare /dnsaddr) would start an agent that fails every dial.
        addr.value_for_protocol("tcp")
    except Exception as exc:  # multiaddr and libp2p raise several unrelated types
        raise ValueError(
            f"--router {address!r} is not a router multiaddr (e.g. /ip4/203.0.113.7/tcp/9000,"
            f" optionally with /p2p/<router-peer-id>): {exc}"
        ) from None
    return RouterAddress(address, addr, peer_id)


async def dial_addrs(addr: multiaddr.Multiaddr) -> list[multiaddr.Multiaddr]:
    """The addresses to dial for `addr`, its DNS name (if any) resolved now.

    py-libp2p 0.8.1 resolves a TCP address's name with its own DNS client, which
    reads neither /etc/hosts nor the search domains: `/dns4/localhost/...` or a
    compose service's name never dials. The system's resolver, asked at each dial,
    knows what every other program on the host knows, and follows a router that
    moved. A WebSocket address keeps its name: its transport resolves it the same
    way, and needs it for the Host header, the proxy's CONNECT and the TLS check.
    """
    names = [p.name for p in addr.protocols()]
    family = _NAME_FAMILIES.get(names[0])
    if family is None or {"ws", "wss", "tls"} & set(names):
        return [addr]
    host = addr.value_for_protocol(names[0])
    port = int(addr.value_for_protocol("tcp"))
    rest = addr.split(1)[1]
    found: list[multiaddr.Multiaddr] = []
    for af, _, _, _, sockaddr in await trio.socket.getaddrinfo(
        host, port, family, socket.SOCK_STREAM
    ):
        ip = str(sockaddr[0])
        if "%" in ip:  # a link-local IPv6 address with its zone: not a multiaddr
            continue
        resolved = multiaddr.Multiaddr(f"/{'ip6' if af == socket.AF_INET6 else 'ip4'}/{ip}")
        resolved = resolved.encapsulate(rest)
        if resolved not in found:
            found.append(resolved)
    if not found:
        raise ConnectionError(f"{host} has no address to dial")
    return found


def presented_peer_id(exc: BaseException) -> ID | None:
    """The peer ID a Noise handshake refused in `exc` (anywhere in its causes)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if type(e).__name__ == "PeerIDMismatchesPubkey":
            match = _PRESENTED.search(str(e))
            if match is not None:
                return ID.from_base58(match.group(1))
        todo += [e.__cause__, e.__context__]
        for attr in ("exceptions", "errors"):
            nested = getattr(e, attr, None)
            if isinstance(nested, list | tuple):
                todo += [x for x in nested if isinstance(x, BaseException)]
    return None


async def learn_peer_id(host: Any, addrs: list[multiaddr.Multiaddr]) -> ID:
    """The peer ID of whoever answers at `addrs`; ConnectionError when none is learned."""
    probe = ID.from_pubkey(create_new_key_pair().public_key)
    where = ", ".join(map(str, addrs))
    try:
        await host.connect(PeerInfo(probe, addrs))
    except Exception as exc:  # the expected way out: the handshake names the real key
        found = presented_peer_id(exc)
        if found is not None:
            return found
        raise ConnectionError(f"no libp2p peer answered at {where}: {exc}") from None
    raise ConnectionError(f"{where} accepted a made-up peer ID: not a libp2p router")
