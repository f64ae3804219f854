"""One task that reads the streamed answers of a session's engine connections.

A streamed answer's task was woken for every socket read of its engine, some six per
16-token answer: each wake a pass through trio's scheduler, a resume down a dozen
coroutine levels and an `epoll_ctl` to wait again, most of what the agent spent per
stream beyond the frames themselves. Here the sockets of the streams under way sit in
an epoll set of their own, which trio waits on as one file descriptor; once it is
readable, one pass hands every ready socket to its reader, however many streams that
is, and each stream's task sleeps until its answer is over.
"""

from __future__ import annotations

import contextlib
import select
from collections.abc import Awaitable, Callable

import trio


class _Watch:
    __slots__ = ("error", "reader", "task")

    def __init__(self, task: trio.lowlevel.Task, reader: Callable[[], bool]) -> None:
        self.task = task
        self.reader = reader
        self.error: Exception | None = None


class ReadPump:
    """Calls each watched socket's reader, in the pump's task, whenever it is readable.

    A reader returns True when its stream needs no more reads; what it raises ends
    the watch and is raised in the task that waits on it (`until_done`). Readers run
    synchronously, so they must never block: read what the socket has, hand it on.
    """

    def __init__(self) -> None:
        # Level-triggered: a socket still holding bytes after its reader's one read is
        # ready again in the next pass.
        self._epoll = select.epoll()
        self._watches: dict[int, _Watch] = {}
        # Streams being read, by the pump or by their own task (`read`).
        self.readers = 0

    def __repr__(self) -> str:
        return f"<ReadPump, {len(self._watches)} sockets watched>"

    def close(self) -> None:
        self._epoll.close()

    async def run(self) -> None:
        """Read until cancelled; readers run in this task."""
        fd = self._epoll.fileno()
        poll = self._epoll.poll
        watches = self._watches
        while True:
            await trio.lowlevel.wait_readable(fd)
            for ready, _ in poll(0):
                watch = watches.get(ready)
                if watch is None:
                    # A socket no stream waits on (a pooled connection the engine
                    # closed, the end of an answer read by its own task): out of the
                    # set until a stream of its connection is watched again.
                    self._drop(ready)
                    continue
                try:
                    if not watch.reader():
                        continue
                except Exception as exc:
                    watch.error = exc
                del watches[ready]
                trio.lowlevel.reschedule(watch.task)
            # The last watch held its reader, and so its stream, until the next pass;
            # a socket that only it kept alive then closed between a poll and its use.
            watch = None

    async def read(
        self,
        sock: int | None,
        reader: Callable[[], bool],
        alone: Callable[[], Awaitable[None]],
    ) -> None:
        """Read one stream: with `alone` in this task while it is the only one being
        read, else with `reader` in the pump's (`until_done`). A pass of the pump costs
        one `epoll_wait` more than a task waiting on its own socket, and a stream whose
        reads it takes over wakes its task once more, at the end: 8% more of the
        agent's CPU for a lone client's 16-token streams, where there is nothing to
        read together. `sock` None (a TLS or test stream): always `alone`."""
        self.readers += 1
        try:
            if sock is None or self.readers == 1:
                await alone()
            else:
                await self.until_done(sock, reader)
        finally:
            self.readers -= 1

    async def until_done(self, sock: int, reader: Callable[[], bool]) -> None:
        """Have `reader` called whenever socket `sock` (a descriptor) is readable, until it
        returns True; what it raises is raised here. A cancel stops the watch at once.

        The socket must stay open while watched (the caller closes it only after this
        returns). It stays in the set after its watch: one `epoll_ctl` per connection
        rather than two per answer, and the kernel drops it from the set when it is
        closed."""
        with contextlib.suppress(FileExistsError):  # in the set since its last answer
            self._epoll.register(sock, select.EPOLLIN)
        watch = self._watches[sock] = _Watch(trio.lowlevel.current_task(), reader)

        def abort(_: object) -> trio.lowlevel.Abort:
            del self._watches[sock]
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        if watch.error is not None:
            raise watch.error

    def _drop(self, sock: int) -> None:
        # Closed since the poll, it has left the set already.
        with contextlib.suppress(OSError):
            self._epoll.unregister(sock)
