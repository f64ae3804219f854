"""The admin API's views of the routing table, health, models and policy."""

from __future__ import annotations

import time

import trio

from protocol.fields import ENGINE_FIELDS, HARDWARE_FIELDS
from router.capacity import WaitQueue
from router.peers import Peer, PeerTable
from router.policy.gates import metric_value


def _wall(monotonic_at: float, now: float) -> str:
    at = time.time() - (now - monotonic_at)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"


def _age(at: float, now: float) -> float | None:
    return round(now - at, 3) if at else None


def agent_view(peer: Peer, now: float) -> dict:
    stats = peer.stats
    engine: dict[str, float | str | None] = {f: metric_value(peer, f, now) for f in ENGINE_FIELDS}
    engine["age_seconds"] = _age(peer.engine_at, now)
    hardware: dict[str, float | str | None] = {
        f: metric_value(peer, f, now) for f in HARDWARE_FIELDS
    }
    hardware["age_seconds"] = _age(peer.hardware_at, now)
    return {
        "peer_id": peer.peer_id,
        "metadata": peer.metadata.to_json(),
        "status": {
            "healthy": peer.healthy and peer.connected,
            "backend_healthy": peer.backend_healthy,
            "connected": peer.connected,
            "draining": peer.draining,
            "last_seen": _wall(peer.last_seen, now),
            "active_requests": peer.active,
            "capacity_utilization": peer.load_ratio,
        },
        "universal": {
            "success_rate": stats.success_rate,
            "srtt": stats.srtt_ms,
            "consecutive_failures": stats.consecutive_failures,
        },
        "engine": engine,
        "hardware": hardware,
    }


def routing_table(table: PeerTable) -> dict:
    now = trio.current_time()
    peers = sorted(table.all(), key=lambda p: (p.metadata.model, p.peer_id))
    return {"agents": [agent_view(p, now) for p in peers]}


def health(table: PeerTable, queue: WaitQueue) -> dict:
    now = trio.current_time()
    peers = table.all()
    healthy = sum(1 for p in peers if p.routable)
    return {
        "status": "healthy" if peers and healthy == len(peers) else "degraded",
        "total_agents": len(peers),
        "healthy_agents": healthy,
        "queues": {model: queue.length(model) for model in table.models()},
        "agents": [
            {
                "peer_id": p.peer_id,
                "model": p.metadata.model,
                "healthy": p.healthy and p.connected,
                "backend_healthy": p.backend_healthy,
                "active_requests": p.active,
                "capacity": p.metadata.capacity,
                "last_seen": _wall(p.last_seen, now),
            }
            for p in sorted(peers, key=lambda p: p.peer_id)
        ],
    }
