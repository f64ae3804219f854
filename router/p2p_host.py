"""The router's libp2p host, with the fixes py-libp2p 0.8.1 needs to run for months.

See shared/notes/py-libp2p.md: each inbound connection's handler waits for the whole
swarm to stop, holding one of 250 lifetime inbound slots, so a router whose agents
reconnect stops accepting within hours. We make the handler wait for its own
connection instead, and raise the connection limits above the fleet size we support.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import ssl
from collections.abc import Sequence
from typing import Any

import libp2p
import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IMuxedConn
from libp2p.crypto.keys import KeyPair
from libp2p.network.config import ConnectionConfig
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.network.swarm import Swarm
from libp2p.rcmgr import new_resource_manager
from libp2p.rcmgr.connection_limits import ConnectionLimits
from libp2p.rcmgr.manager import ResourceLimits

from protocol.p2p import tune_libp2p

log = logging.getLogger("router.p2p")

# The fleet size we promise; libp2p's defaults (300 connections) are far below it.
MAX_AGENT_CONNECTIONS = 4096
_PATCHED_VERSION = "0.8.1"


class PerSourceLimit:
    """`--p2p-max-conns-per-ip`: live inbound connections per source IPv4 /32 or IPv6
    /56 (one site's prefix), so one address cannot take the router's 4,096 slots.
    Agents behind one NAT share a source: size it above twice their number, as
    upstream advises (reconnects overlap during a rollout)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.live: dict[str, int] = {}

    @staticmethod
    def source(remote: multiaddr.Multiaddr | None) -> str | None:
        if remote is None:
            return None
        for proto, prefix in (("ip4", 32), ("ip6", 56)):
            try:
                ip = remote.value_for_protocol(proto)
            except Exception:  # py-multiaddr raises its own error for a missing part
                continue
            if ip:
                return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))
        return None

    def take(self, source: str) -> bool:
        count = self.live.get(source, 0)
        if count >= self.limit:
            return False
        self.live[source] = count + 1
        return True

    def give(self, source: str) -> None:
        count = self.live.get(source, 0) - 1
        if count > 0:
            self.live[source] = count
        else:
            self.live.pop(source, None)


async def _handle_inbound_until_closed(
    self: Swarm, read_write_closer: Any, maddr: multiaddr.Multiaddr, failure_event: Any
) -> None:
    """Swarm._do_handle_inbound_connection, waiting on this connection's close only."""
    if isinstance(read_write_closer, IMuxedConn):
        return await _ORIGINAL_HANDLER(self, read_write_closer, maddr, failure_event)
    remote = self._build_remote_multiaddr(read_write_closer)
    if remote is not None and not await self.connection_gate.is_allowed(remote):
        with contextlib.suppress(Exception):
            await read_write_closer.close()
        return
    per_source: PerSourceLimit | None = getattr(self, "hivenet_per_source", None)
    source = PerSourceLimit.source(remote) if per_source is not None else None
    if per_source is not None and source is not None:
        if not per_source.take(source):
            log.warning("p2p_connection_refused source=%s limit=%d", source, per_source.limit)
            with contextlib.suppress(Exception):
                await read_write_closer.close()
            return
        try:
            await _upgrade_and_wait(self, read_write_closer, maddr)
        finally:
            per_source.give(source)
        return
    await _upgrade_and_wait(self, read_write_closer, maddr)


async def _upgrade_and_wait(
    self: Swarm, read_write_closer: Any, maddr: multiaddr.Multiaddr
) -> None:
    raw_conn = None
    try:
        raw_conn = RawConnection(read_write_closer, False)
        muxed = await self.upgrade_inbound_raw_conn(raw_conn, maddr)
        await muxed.event_closed.wait()
    except Exception as exc:
        log.debug("inbound connection ended: %s", exc)
        with contextlib.suppress(Exception):
            await (raw_conn or read_write_closer).close()


_ORIGINAL_HANDLER = Swarm._do_handle_inbound_connection


def _fix_inbound_handler(swarm: Swarm, max_conns_per_ip: int) -> None:
    if libp2p.__version__ != _PATCHED_VERSION:
        raise RuntimeError(
            f"router/p2p_host.py patches py-libp2p {_PATCHED_VERSION} internals; "
            f"found {libp2p.__version__}: re-check the inbound handler fix"
        )
    swarm._do_handle_inbound_connection = _handle_inbound_until_closed.__get__(swarm)  # type: ignore[method-assign]
    swarm.hivenet_per_source = PerSourceLimit(max_conns_per_ip)  # type: ignore[attr-defined]


def router_host(
    key_pair: KeyPair,
    listen_addrs: Sequence[multiaddr.Multiaddr],
    websocket: bool,
    max_conns_per_ip: int = 32,
    tls: ssl.SSLContext | None = None,
) -> Any:
    tune_libp2p()
    limits = ConnectionLimits(
        max_pending_inbound=512,
        max_pending_outbound=64,
        max_established_inbound=MAX_AGENT_CONNECTIONS,
        max_established_outbound=256,
        max_established_per_peer=8,
        max_established_total=MAX_AGENT_CONNECTIONS + 256,
    )
    host = new_host(
        key_pair=key_pair,
        listen_addrs=list(listen_addrs),
        enable_websocket=websocket or tls is not None,
        tls_server_config=tls,
        connection_config=ConnectionConfig(
            max_connections=MAX_AGENT_CONNECTIONS + 256,
            min_connections=0,
            max_connections_per_peer=4,
            low_watermark=0,
            high_watermark=MAX_AGENT_CONNECTIONS + 128,
        ),
        # ResourceLimits defaults to 1,000 connections: the 1,001st agent could never join.
        resource_manager=new_resource_manager(
            limits=ResourceLimits(
                max_connections=MAX_AGENT_CONNECTIONS + 256,
                max_memory_mb=4096,
                max_streams=4 * MAX_AGENT_CONNECTIONS,
            ),
            connection_limits=limits,
        ),
    )
    _fix_inbound_handler(host.get_network(), max_conns_per_ip)
    return host


def check_listening(host: Any, listen_addrs: Sequence[multiaddr.Multiaddr]) -> None:
    """OSError unless every address asked for has its listener.

    py-libp2p starts the listeners it can and notes the rest in a debug line only: with
    its agent port taken, a router reported itself listening and ready, and no agent
    could reach it."""
    listening = getattr(host.get_network(), "listeners", {})
    for addr in listen_addrs:
        if str(addr) not in listening:
            raise OSError(f"cannot listen for agents on {addr}: {_why_not(addr)}")


def _why_not(addr: multiaddr.Multiaddr) -> str:
    """What binding the address says now (py-libp2p kept its own error to itself)."""
    try:
        ip, port = addr.value_for_protocol("ip4"), int(addr.value_for_protocol("tcp"))
        with socket.socket() as probe:
            probe.bind((ip, port))
    except (OSError, ValueError, multiaddr.exceptions.ProtocolLookupError) as exc:
        return str(exc) or type(exc).__name__
    return "its listener did not start"


async def close_listeners(host: Any) -> None:
    """host.run() leaves the TCP listener accepting after it exits; close it ourselves."""
    for listener in list(getattr(host.get_network(), "listeners", {}).values()):
        with contextlib.suppress(Exception), trio.move_on_after(1):
            await listener.close()
