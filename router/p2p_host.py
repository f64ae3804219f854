"""The router's libp2p host, with the fixes py-libp2p 0.8.1 needs to run for months.

See shared/notes/py-libp2p.md: each inbound connection's handler waits for the whole
swarm to stop, holding one of 250 lifetime inbound slots, so a router whose agents
reconnect stops accepting within hours. We make the handler wait for its own
connection instead, and raise the connection limits above the fleet size we support.
"""

from __future__ import annotations

import contextlib
import logging
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


def _fix_inbound_handler(swarm: Swarm) -> None:
    if libp2p.__version__ != _PATCHED_VERSION:
        raise RuntimeError(
            f"router/p2p_host.py patches py-libp2p {_PATCHED_VERSION} internals; "
            f"found {libp2p.__version__}: re-check the inbound handler fix"
        )
    swarm._do_handle_inbound_connection = _handle_inbound_until_closed.__get__(swarm)  # type: ignore[method-assign]


def router_host(
    key_pair: KeyPair,
    listen_addrs: Sequence[multiaddr.Multiaddr],
    websocket: bool,
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
    _fix_inbound_handler(host.get_network())
    return host


async def close_listeners(host: Any) -> None:
    """host.run() leaves the TCP listener accepting after it exits; close it ourselves."""
    for listener in list(getattr(host.get_network(), "listeners", {}).values()):
        with contextlib.suppress(Exception), trio.move_on_after(1):
            await listener.close()
