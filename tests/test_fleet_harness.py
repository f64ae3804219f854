"""The test fleet's own behaviour that other tests lean on."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
import redis

from tests import redis_server
from tests.fleet import LOWEST_PICK, Fleet, ephemeral_floor, free_port, free_ports, pick_span


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


def test_a_router_whose_websocket_port_was_taken_starts_on_another(fleet: Fleet) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        router = fleet.router("--p2p-ws-port", str(taken))
        assert f"/tcp/{taken}/" not in router.multiaddr
        assert "/ws/p2p/" in router.multiaddr
        assert "Address already in use" in router.log()


def test_a_redis_server_whose_port_was_taken_before_its_first_start_starts_on_another(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(redis_server, "free_port", lambda: next(picks, None) or free_port())
        server = redis_server.RedisServer(tmp_path, fleet.env).start()
        try:
            assert server.port != taken
            assert "Address already in use" in (tmp_path / f"redis-{taken}.log").read_text()
            assert redis.Redis(port=server.port, socket_timeout=2).ping()
        finally:
            server.stop()


def test_ports_are_picked_below_the_kernels_own_and_apart_for_each_worker() -> None:
    """No outgoing connection can take a picked port before its daemon binds it, and
    the two xdist workers never pick the same one."""
    first, second = pick_span(32768, "gw0", 2), pick_span(32768, "gw1", 2)
    assert first is not None and second is not None
    assert LOWEST_PICK <= first.start < first.stop <= second.start < second.stop <= 32768
    assert pick_span(32768, "", 1) == range(LOWEST_PICK, 32768)  # no xdist: all of it
    assert pick_span(LOWEST_PICK + 500, "gw0", 1) is None  # too little room: port 0
    block = free_ports(3)
    later = {free_port() for _ in range(20)}
    assert not later & {block, block + 1, block + 2}
    assert len(later) == 20
    floor = ephemeral_floor()
    if floor - LOWEST_PICK >= 2_000:
        assert all(LOWEST_PICK <= port < floor for port in later | {block})
