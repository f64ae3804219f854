"""The router's event-loop watch: run batches and collector passes are timed and exported.

A batch that blocks the loop (here a synchronous 30 ms sleep, the shape of a long
garbage collection or a big synchronous parse) must show in the lag histogram, and each
collection in the pause histogram of its generation; a real router exports both.
"""

from __future__ import annotations

import gc
import time

import trio

from router.loop_watch import LoopWatch, count_tasks
from tests.fleet import Fleet, wait_until


class Recorded:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, amount: float) -> None:
        self.values.append(amount)


def test_a_blocking_batch_and_a_collection_are_timed() -> None:
    batches, busy = Recorded(), Recorded()
    pauses = [Recorded(), Recorded(), Recorded()]
    watch = LoopWatch(batches, busy, pauses)

    async def main() -> None:
        watch.install()
        try:
            for _ in range(5):
                await trio.sleep(0.001)  # short turns: the loop waits on I/O between them
            time.sleep(0.03)  # noqa: ASYNC251 - the stall under test: no CPU work
            await trio.sleep(0.001)
            spin_until = time.thread_time() + 0.03
            while time.thread_time() < spin_until:  # the stall under test: CPU work
                pass
            await trio.sleep(0.001)
            gc.collect()
            await trio.sleep(0.001)
        finally:
            watch.uninstall()

    trio.run(main)
    assert len(batches.values) >= 6
    assert max(batches.values) >= 0.03
    assert watch.longest == max(batches.values)
    assert len(busy.values) == len(batches.values)
    turns = list(zip(batches.values, busy.values, strict=True))
    assert any(wall >= 0.03 and cpu < 0.01 for wall, cpu in turns), "the sleep: no CPU"
    assert any(wall >= 0.03 and cpu >= 0.03 for wall, cpu in turns), "the spin: CPU"
    assert pauses[2].values, "gc.collect() is a generation-2 pass"
    assert watch._on_gc not in gc.callbacks


def test_the_live_tasks_are_counted_as_they_come_and_go() -> None:
    # hivenet_router_trio_tasks: a walk of the task tree at each scrape cost one turn
    # 7 ms with 1,000 agents; the watch counts spawns and exits instead.
    watch = LoopWatch(Recorded(), Recorded(), [Recorded()] * 3)
    seen: list[tuple[int, int]] = []

    async def main() -> None:
        watch.install()
        try:
            seen.append((watch.tasks, count_tasks()))
            async with trio.open_nursery() as nursery:
                for _ in range(50):
                    nursery.start_soon(trio.sleep_forever)
                await trio.lowlevel.checkpoint()
                seen.append((watch.tasks, count_tasks()))
                nursery.cancel_scope.cancel()
            seen.append((watch.tasks, count_tasks()))
        finally:
            watch.uninstall()

    trio.run(main)
    assert count_tasks() == 0  # outside a run
    (before, walked), (during, walked_during), (after, walked_after) = seen
    assert before == walked and during == walked_during and after == walked_after
    assert during == before + 50 and after == before


def test_uninstall_without_install_is_harmless() -> None:
    watch = LoopWatch(Recorded(), Recorded(), [Recorded()] * 3)

    async def main() -> None:
        watch.uninstall()

    trio.run(main)


def test_router_exports_loop_lag_and_gc_pauses(fleet: Fleet) -> None:
    router = fleet.router()
    wait_until(
        lambda: router.metric("hivenet_router_event_loop_lag_seconds_count") > 0,
        10,
        "loop turns counted",
    )
    text = router.metrics()
    assert 'hivenet_router_event_loop_lag_seconds_bucket{le="0.005"}' in text
    assert 'hivenet_router_event_loop_busy_seconds_bucket{le="0.005"}' in text
    assert "# TYPE hivenet_router_gc_pause_seconds histogram" in text
