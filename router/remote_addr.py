"""The address an agent's connection came from, as the router saw it.

Behind NAT or an HTTP proxy this is the NAT's or the proxy's address, not the agent's:
it tells an operator which network path an agent took, not how to reach it (the router
never dials agents).
"""

from __future__ import annotations

from typing import Any

# py-libp2p 0.8.1's layers from a stream down to its transport connection.
_TOWARD_TRANSPORT = ("muxed_conn", "secured_conn", "conn", "stream")


def remote_endpoint(stream: Any) -> tuple[str, int] | None:
    """(host, port) of the connection under a libp2p stream; None when unknown.

    TCP connections report it themselves. py-libp2p 0.8.1's WebSocket connection
    returns None, so for it we read the endpoint trio-websocket keeps: without that, every
    agent over `/ws` would look alike to the limits that count sessions per address.
    """
    try:
        address = stream.muxed_conn.get_remote_address()
    except Exception:  # a half-closed connection may raise from its socket
        address = None
    if address:
        return str(address[0]), int(address[1])
    node, depth = stream, 0
    while node is not None and depth < 8:
        ws = getattr(node, "_ws_connection", None)
        endpoint = getattr(ws, "remote", None)
        if endpoint is not None and hasattr(endpoint, "address"):
            return str(endpoint.address), int(endpoint.port)
        node = next((getattr(node, a) for a in _TOWARD_TRANSPORT if hasattr(node, a)), None)
        depth += 1
    return None


def format_endpoint(endpoint: tuple[str, int] | None) -> str:
    """`host:port` (`[v6]:port`), or "" when unknown."""
    if endpoint is None:
        return ""
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
