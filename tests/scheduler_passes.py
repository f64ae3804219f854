"""Counting a task's passes through trio's scheduler, for the tests of paths that
must not make one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio


class Reschedules(trio.abc.Instrument):
    """The times one task is put back on trio's run queue: once per yield."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.count = 0

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


@contextmanager
def passes_of_this_task() -> Iterator[Reschedules]:
    steps = Reschedules(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        yield steps
    finally:
        trio.lowlevel.remove_instrument(steps)
