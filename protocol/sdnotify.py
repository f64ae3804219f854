"""systemd's notify socket protocol: one datagram per state change, no library needed.

Under `Type=notify` systemd sets NOTIFY_SOCKET to a unix datagram socket (a path, or an
abstract name written with a leading `@`) and waits for `READY=1`; `STOPPING=1`,
`RELOADING=1` and `STATUS=...` lines show in `systemctl status`. Outside systemd the
variable is unset and every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("router")


def sd_notify(state: str, environ: dict[str, str] | None = None) -> bool:
    """Send `state` (e.g. READY=1) to systemd; False when not run under Type=notify.

    A notify socket that cannot be reached is logged and ignored: a daemon must never
    stop serving because its supervisor went away.
    """
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify_failed socket=%s error=%s", env["NOTIFY_SOCKET"], exc)
        return False
    return True
