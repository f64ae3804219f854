"""The garbage collector's young-generation threshold for the daemons' processes.

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

import trio

YOUNG_THRESHOLD = 20_000


def tune_collector() -> None:
    """Raise the young generation's threshold; the older two keep their defaults."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


# The frozen set may grow by this fraction (new long-lived objects, or cycles among
# frozen objects that became garbage and that only a complete pass frees) before it is
# thawed for one complete pass: CPython's own rule for its oldest generation (25%).
THAW_GROWTH = 0.25


class OldFreezer:
    """Keeps what survives a full collection out of the next ones.

    A full (generation 2) pass walks every tracked object: at 1,000 agent sessions about
    50 ms every 25 s, with the event loop stopped meanwhile (bench.fleet). Objects that
    survived one are mostly the fleet's sessions and the process's modules, alive for
    hours; `gc.freeze()` after such a pass moves them to the permanent generation, which
    collections skip, so the next full pass walks only what was promoted since.

    The cost: garbage cycles among frozen objects (a session that ended) wait. When the
    frozen count has grown by `THAW_GROWTH` since the last complete pass, `gc.unfreeze()`
    hands everything back, the next full pass is complete (one long pause), and what
    survives it is frozen anew; a fleet that does not grow thaws rarely, one that churns
    reclaims its dead sessions at that rate. Only trio code calls `tick` (a collection
    callback must not freeze in the middle of a pass); `on_gc` just notes the pass.
    """

    def __init__(self, growth: float = THAW_GROWTH) -> None:
        self.growth = growth
        self.full_passes = 0
        self._seen = 0  # full passes handled by `tick`
        self.baseline = gc.get_freeze_count()  # frozen after the last complete pass
        self.thawed = True  # the next full pass walks everything
        self.thaws = 0

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "stop" and info.get("generation") == 2:
            self.full_passes += 1

    def tick(self) -> None:
        """After a full pass: freeze its survivors, or thaw for a complete one."""
        if self.full_passes == self._seen:
            return
        self._seen = self.full_passes
        gc.freeze()
        frozen = gc.get_freeze_count()
        if self.thawed:
            self.thawed = False
            self.baseline = frozen
        elif frozen > self.baseline * (1 + self.growth):
            gc.unfreeze()
            self.thawed = True
            self.thaws += 1

    def install(self) -> None:
        gc.callbacks.append(self.on_gc)

    def uninstall(self) -> None:
        if self.on_gc in gc.callbacks:
            gc.callbacks.remove(self.on_gc)

    async def run(self, period: float = 1.0) -> None:
        """Install, and tick every `period` seconds until cancelled."""
        self.install()
        try:
            while True:
                await trio.sleep(period)
                self.tick()
        finally:
            self.uninstall()
