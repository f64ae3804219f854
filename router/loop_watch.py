"""How long the router's event loop goes without looking at its sockets, and why.

Trio's loop alternates an I/O wait (epoll) with a batch of runnable tasks. While a batch
runs, no new byte is read and no timer fires: a batch's length is the lag every frame,
heartbeat and request arriving meanwhile sees. `LoopWatch` is a trio Instrument that
times each batch (from `after_io_wait` to the next `before_io_wait`) into a histogram,
and a `gc.callbacks` hook that times each collection, the usual cause of a long batch in
a process holding 1,000 agent sessions. Its cost is two clock reads and a bucket lookup
per loop turn (about 1 µs; `docs/benchmarks/index.md`, Fleet).
"""

from __future__ import annotations

import contextlib
import gc
from time import perf_counter
from typing import Any, Protocol

import trio


class Observer(Protocol):
    def observe(self, amount: float) -> None: ...


class LoopWatch(trio.abc.Instrument):
    """Times trio's run batches into `batches` and the collector's passes into `gc_pauses`
    (one observer per generation, 0 to 2). `install()` inside `trio.run`, `uninstall()`
    before it returns."""

    def __init__(self, batches: Observer, gc_pauses: list[Observer]) -> None:
        self._batches = batches
        self._gc_pauses = gc_pauses
        self._batch_start: float | None = None
        self._gc_start = 0.0
        self.longest = 0.0  # the longest batch seen, seconds
        self.longest_gc = 0.0

    # The instrument: trio calls only the hooks a class defines.
    def after_io_wait(self, timeout: float) -> None:
        self._batch_start = perf_counter()

    def before_io_wait(self, timeout: float) -> None:
        start = self._batch_start
        if start is not None:
            took = perf_counter() - start
            self._batches.observe(took)
            if took > self.longest:
                self.longest = took

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = perf_counter()
            return
        took = perf_counter() - self._gc_start
        generation = info.get("generation", 2)
        if 0 <= generation < len(self._gc_pauses):
            self._gc_pauses[generation].observe(took)
        if took > self.longest_gc:
            self.longest_gc = took

    def install(self) -> None:
        trio.lowlevel.add_instrument(self)
        gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        with contextlib.suppress(KeyError):  # never added, or already gone
            trio.lowlevel.remove_instrument(self)
