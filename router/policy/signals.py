"""What an agent's live signals read as now: gate 7's values and the metric strategies'.

Both read through `metric_value`, so a stale snapshot is unknown to a gate and to a
ranking alike.
"""

from __future__ import annotations

from protocol.fields import ENGINE_FIELDS, HARDWARE_FIELDS
from router.peers import HISTORY_FIELDS, Peer, UniversalStats

# A snapshot older than three sampling periods means the agent stopped reporting it;
# acting on the old value would keep excluding (or admitting) on stale data.
STALE_AFTER_PERIODS = 3


def metric_value(peer: Peer, field: str, now: float) -> float | None:
    """The value gate 7 compares for `field`; None when it is unknown or stale."""
    if field == "capacity_utilization":
        return peer.active / peer.metadata.capacity
    stats = peer.stats
    if field in HISTORY_FIELDS:
        # A half-open or closed breaker lets the agent past its history (peers.py).
        return history_value(stats, field) if stats.history_gated(now) else None
    if field == "srtt":
        return stats.srtt_ms
    if field in ENGINE_FIELDS:
        if now - peer.engine_at > STALE_AFTER_PERIODS * peer.engine_interval:
            return None
        return peer.engine.get(field)
    if field in HARDWARE_FIELDS:
        if now - peer.hardware_at > STALE_AFTER_PERIODS * peer.hardware_interval:
            return None
        return peer.hardware.get(field)
    raise ValueError(f"unknown gate field {field!r}")


def history_value(stats: UniversalStats, field: str) -> float | None:
    if field == "success_rate":
        return stats.success_rate
    return stats.consecutive_failures if stats.successes + stats.failures else None
