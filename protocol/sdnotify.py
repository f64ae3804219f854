"""systemd's notify socket protocol: one datagram per state change, no library needed."""

from __future__ import annotations

import os
import socket


def sd_notify(state: str) -> bool:
    """Send `state` (e.g. READY=1) to systemd when run as Type=notify; False otherwise."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True
