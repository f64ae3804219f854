"""The address an agent's connection came from, as the router saw it.

Behind NAT or an HTTP proxy this is the NAT's or the proxy's address, not the agent's:
it tells an operator which network path an agent took, not how to reach it (the router
never dials agents).
"""

from __future__ import annotations

from typing import Any

# py-libp2p 0.8.1's layers from a stream down to its transport connection.
_TOWARD_TRANSPORT = ("muxed_conn", "secured_conn", "conn", "stream")


def remote_address_of(stream: Any) -> str:
    """`host:port` of the connection under a libp2p stream; "" when unknown.

    TCP connections report it themselves. py-libp2p 0.8.1's WebSocket connection
    returns None, so for it we read the endpoint trio-websocket keeps.
    """
    try:
        address = stream.muxed_conn.get_remote_address()
    except Exception:  # a half-closed connection may raise from its socket
        address = None
    if address:
        return f"{address[0]}:{address[1]}"
    node, depth = stream, 0
    while node is not None and depth < 8:
        ws = getattr(node, "_ws_connection", None)
        endpoint = getattr(ws, "remote", None)
        if endpoint is not None and hasattr(endpoint, "address"):
            return f"{endpoint.address}:{endpoint.port}"
        node = next((getattr(node, a) for a in _TOWARD_TRANSPORT if hasattr(node, a)), None)
        depth += 1
    return ""
