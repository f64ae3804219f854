"""Client connections to the router's HTTP port are released when clients leave.

Hypercorn 0.18.0, the router's former HTTP server, kept a closed client's socket
(CLOSE_WAIT) and two tasks for the whole keep-alive timeout: this test saw hundreds of
descriptors left open. router/http/server.py closes a connection when its client does.
"""

from __future__ import annotations

import httpx
import psutil

from tests.fleet import Fleet, wait_until


def test_short_lived_client_connections_leave_nothing_open(fleet: Fleet) -> None:
    router = fleet.router()
    proc = psutil.Process(router.popen.pid)
    before = proc.num_fds()
    for _ in range(300):
        with httpx.Client(base_url=router.url, timeout=10) as client:
            assert client.get("/health").status_code == 200
    # Closed connections are released at once, not after the 75 s keep-alive timeout.
    wait_until(lambda: proc.num_fds() - before < 30, 10, "client sockets released")
    tasks = router.metric("hivenet_router_trio_tasks")
    assert tasks < 120, tasks
