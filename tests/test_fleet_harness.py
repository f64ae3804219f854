"""The test fleet's own behaviour that other tests lean on."""

from __future__ import annotations

import socket

import httpx

from tests.fleet import Fleet


def test_a_router_whose_port_was_taken_before_its_first_start_starts_on_others(
    fleet: Fleet,
) -> None:
    """Ports are picked free and bound later by the router: another worker's socket can
    take one in between, which once failed a suite run (Errno 98 on the metrics port)."""
    router = fleet.router(start=False)
    taken = router.metrics_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        router.start()
        assert router.metrics_port != taken
        assert "Address already in use" in router.log()
        assert httpx.get(router.url + "/health", timeout=5).status_code == 200
