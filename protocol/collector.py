"""The garbage collector's work in the daemons' processes, kept in short passes.

A trio daemon keeps each task suspended in a chain of coroutines that is built anew
with every frame or request it waits for, so between two collections the youngest
generation fills with live objects: about 50,000 in a router with 1,000 idle agents.
CPython's default collects that generation every 700 net allocations and walks all of
them each time (10-20 ms a collection there). Measured with `gc.callbacks` and the
benchmarks, at the default: about 9% of an idle fleet's router CPU, and 0.29 against
0.25 ms of router CPU per whole answer at 64 clients (`bench.stream_relay --whole`);
the agent's CPU per stream about 5% lower with the raised threshold. Every 20,000 net
allocations walks the same live objects about thirty times less often; the cyclic
garbage that waits for it meanwhile is a few MB at most.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable

import trio

YOUNG_THRESHOLD = 20_000


def tune_collector() -> None:
    """Raise the young generation's threshold; the older two keep their defaults."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


# How often the router freezes what is alive (`Freezer`): a young pass then walks at
# most what was allocated in this long and is still alive. At 1,000 agents about 2,000
# objects (each agent's read waits on its connection, rebuilt by each heartbeat: about
# 20 objects every 5 s), a fraction of a millisecond.
TICK_SECONDS = 0.5
# The memory in use may grow by this fraction (new sessions, or garbage cycles among
# frozen objects, which only a complete pass frees) before everything is thawed for
# one complete pass: CPython's own rule for its oldest generation (25%).
THAW_GROWTH = 0.25


def resident_pages() -> int:
    """The process's resident memory in pages (/proc/self/statm), about 2 µs; where
    there is no /proc, the allocator's blocks in use (`sys.getallocatedblocks`).

    Not `sys.getallocatedblocks` everywhere: it visits every pool of every arena, and
    in a router of 100 MB, cold between two ticks, that took 0.4 to 5 ms a call (timed
    in the router, 2026-12-06): most of an idle router's CPU, and a turn of its loop
    that long twice a second."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return sys.getallocatedblocks()
    try:
        return int(os.read(fd, 128).split()[1])
    finally:
        os.close(fd)


class Freezer:
    """Keeps every pass of the collector to what was allocated in the last tick.

    A pass walks every tracked object of the generations it collects. In a router with
    1,000 agents the young ones are mostly the agents' waits: each heartbeat ends one
    connection's read and starts the next, a new chain of coroutines, cells and trio
    records (about 20 objects) that lives until the next heartbeat, 5 s on. Net of what
    dies, a heartbeat allocates nothing, so the raised threshold lets 30 s or more go
    between two young passes, and each then walked everyone's current wait: 50,000
    objects and 15 to 50 ms of CPU in one turn of the loop (bench.fleet, at issue 51).

    Each tick collects the two young generations, which hold only what was allocated
    since the last tick and is still alive (cycles that died in it are freed), then
    `gc.freeze()`s what is left: the next passes, automatic or the next tick's, skip
    it. A frozen object freed by its reference count is freed as any other; a garbage
    cycle that holds a frozen object waits. When the memory in use has grown by
    `THAW_GROWTH` since the last complete pass, a tick thaws everything and makes one
    (one long pause, as the collector's own rule for its oldest generation would), and
    freezes what survives it. The first tick makes one too.

    Only trio code calls `tick` (a collection callback must not freeze in the middle
    of a pass).
    """

    def __init__(
        self,
        growth: float = THAW_GROWTH,
        in_use: Callable[[], int] = resident_pages,
    ) -> None:
        self.growth = growth
        # The memory in use after the last complete pass; 0 before the first. Resident
        # pages, not a count of objects: gc.get_freeze_count() walks every frozen
        # object (27 ms for 300,000).
        self.baseline = 0
        self._in_use = in_use
        self.complete_passes = 0

    def tick(self) -> None:
        """Freeze what the young generations hold, or make a complete pass."""
        if not self.baseline or self._in_use() > self.baseline * (1 + self.growth):
            self.complete()
            return
        gc.collect(1)
        gc.freeze()

    def freeze(self) -> None:
        """Freeze what is alive now, uncollected: for objects known to die by their
        reference count (a `/metrics` page being built), which no pass need walk."""
        if self.baseline:  # after the first complete pass
            gc.freeze()

    def complete(self) -> None:
        """Thaw, collect everything, freeze the survivors: the new baseline."""
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.baseline = self._in_use()
        self.complete_passes += 1

    async def run(self, period: float = TICK_SECONDS) -> None:
        """Tick every `period` seconds until cancelled."""
        while True:
            await trio.sleep(period)
            self.tick()
