"""Idle-state cleanup, upstream's: every five minutes the router forgets what no longer
limits anyone, so that keys created and dropped at run time do not grow its memory.

What goes: B4 key buckets that are full again, tenant and key records whose request
bucket is full and whose daily count is of a past UTC day (nothing in flight), and a
model's occupancy record once it has held no request for fifteen minutes. Each is
what a new record would be, so nothing a client sees changes; cumulative metrics and
the audit log are untouched (an occupancy record's gauges go with it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from router.admission.control import Admission
    from router.tenants.counters import LocalCounters

SWEEP_INTERVAL = 300.0
IDLE_POOL = 900.0

log = logging.getLogger("router.admission")


async def sweep_idle(admission: Admission, counters: LocalCounters) -> None:
    """The router's sweeper task (its nursery owns it); trio's clock, so a test's
    mock clock drives it."""
    while True:
        await trio.sleep(SWEEP_INTERVAL)
        buckets, pools = admission.sweep(trio.current_time())
        tenants = counters.sweep()
        if buckets or pools or tenants:
            log.debug(
                "idle_state_swept key_buckets=%d pools=%d tenant_counts=%d",
                buckets,
                pools,
                tenants,
            )
