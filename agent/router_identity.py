"""`--router` without `/p2p/<peer-id>`: the router's peer ID learned at each dial.

libp2p dials a peer ID, never a bare address. So the agent first dials a peer ID of
its own making: the Noise handshake refuses it and names the key the router presented
(`PeerIDMismatchesPubkey`), and the agent then dials that peer ID. The key proves
nothing about who runs it; the router's proof of the shared secret in its welcome
(protocol/router_proof.py) does, and an agent that dialed this way requires it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import multiaddr
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

_PRESENTED = re.compile(r"remote_peer_id_from_pubkey=(\w+)")


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
        if "/p2p/" in address:
            info = info_from_p2p_addr(addr)
            return RouterAddress(address, info.addrs[0], info.peer_id)
        addr.value_for_protocol("tcp")
    except Exception as exc:  # multiaddr and libp2p raise several unrelated types
        raise ValueError(
            f"--router {address!r} is not a router multiaddr (e.g. /ip4/203.0.113.7/tcp/9000,"
            f" optionally with /p2p/<router-peer-id>): {exc}"
        ) from None
    return RouterAddress(address, addr, None)


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


async def learn_peer_id(host: Any, addr: multiaddr.Multiaddr) -> ID:
    """The peer ID of whoever answers at `addr`; ConnectionError when none is learned."""
    probe = ID.from_pubkey(create_new_key_pair().public_key)
    try:
        await host.connect(PeerInfo(probe, [addr]))
    except Exception as exc:  # the expected way out: the handshake names the real key
        found = presented_peer_id(exc)
        if found is not None:
            return found
        raise ConnectionError(f"no libp2p peer answered at {addr}: {exc}") from None
    raise ConnectionError(f"{addr} accepted a made-up peer ID: not a libp2p router")
