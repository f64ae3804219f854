"""How long the router's event loop goes without looking at its sockets, and why.

Trio's loop alternates an I/O wait (epoll) with a batch of runnable tasks. While a batch
runs, no new byte is read and no timer fires: a batch's length is the lag every frame,
heartbeat and request arriving meanwhile sees. `LoopWatch` is a trio Instrument that
times each batch (from `after_io_wait` to the next `before_io_wait`) into a histogram,
and a `gc.callbacks` hook that times each collection, the usual cause of a long batch in
a process holding 1,000 agent sessions.

A batch is timed twice: on the wall clock (the lag that clients and agents see) and in
the thread's CPU time (the loop's own work in it). On a host whose cores are shared,
the difference is time the kernel gave to other processes, which no change to the
router removes. The collector's passes are timed in CPU time. The cost: three clock
reads and two bucket lookups per loop turn, about 1.5 µs against 3.2 µs for an empty
turn of trio's loop (`docs/benchmarks/index.md`, Fleet).
"""

from __future__ import annotations

import contextlib
import gc
from time import perf_counter, thread_time
from typing import Any, Protocol

import trio


class Observer(Protocol):
    def observe(self, amount: float) -> None: ...


class LoopWatch(trio.abc.Instrument):
    """Times trio's run batches into `batches` (wall clock) and `busy` (CPU time), and
    the collector's passes into `gc_pauses` (CPU time, one observer per generation).
    `install()` inside `trio.run`, `uninstall()` before it returns."""

    def __init__(self, batches: Observer, busy: Observer, gc_pauses: list[Observer]) -> None:
        self._batches = batches
        self._busy = busy
        self._gc_pauses = gc_pauses
        self._batch_start: float | None = None
        self._batch_cpu = 0.0
        self._gc_start = 0.0
        self.longest = 0.0  # the longest batch seen, seconds
        self.longest_gc = 0.0
        # The run's live tasks, kept by trio's spawn and exit hooks from `install()` on
        # (hivenet_router_trio_tasks): walking the task tree at each scrape took 7 ms
        # of one turn with 1,000 agents, about 10,000 tasks (bench.fleet, issue 51).
        self.tasks = 0

    # The instrument: trio calls only the hooks a class defines.
    def after_io_wait(self, timeout: float) -> None:
        self._batch_start = perf_counter()

    def before_io_wait(self, timeout: float) -> None:
        # CPU time from one I/O wait to the next: a waiting epoll takes none, so this is
        # the batch's, read once a turn (a thread_time() read is about 0.45 µs here).
        cpu = thread_time()
        start = self._batch_start
        if start is not None:
            took = perf_counter() - start
            self._busy.observe(cpu - self._batch_cpu)
            self._batches.observe(took)
            if took > self.longest:
                self.longest = took
        self._batch_cpu = cpu

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.tasks += 1

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self.tasks -= 1

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = thread_time()
            return
        took = thread_time() - self._gc_start
        generation = info.get("generation", 2)
        if 0 <= generation < len(self._gc_pauses):
            self._gc_pauses[generation].observe(took)
        if took > self.longest_gc:
            self.longest_gc = took

    def install(self) -> None:
        self.tasks = count_tasks()  # no await before the hooks count the rest
        trio.lowlevel.add_instrument(self)
        gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        with contextlib.suppress(KeyError):  # never added, or already gone
            trio.lowlevel.remove_instrument(self)


def count_tasks() -> int:
    """The live tasks of the current trio run, counted by walking its task tree (a few
    ms for 10,000 tasks); 0 outside a run."""
    try:
        root = trio.lowlevel.current_root_task()
    except RuntimeError:
        return 0
    count = 0
    stack = [root]
    while stack:
        task = stack.pop()
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count
