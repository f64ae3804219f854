"""`--max-concurrent` and `--queue-size`: the Go router's router-wide bound on forwards
in flight, and on the requests that may wait for one.

Each agent's `--capacity` already bounds what it is sent, so the bound is off unless
set (upstream's default, 50, would cap a fleet of 32-slot agents at two agents' worth).
A request holds its slot while it is routed, up to the response head: the stream that
follows runs on the agent's slot. Past `queue_size` waiters a request waits up to
QUEUE_FULL_WAIT for a place among them, as upstream's does for its full pending
channel, then is refused with 503 `queue_full`, upstream's code for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext

import trio

from protocol.errors import ErrorCode, RouterError

QUEUE_FULL_RETRY_AFTER = 1.0
# How long a request past a full queue waits for a place in it (upstream's five seconds).
QUEUE_FULL_WAIT = 5.0
_UNBOUNDED: AbstractAsyncContextManager[None] = nullcontext()


class ForwardLimit:
    def __init__(self, max_concurrent: int, queue_size: int) -> None:
        self.limiter = trio.CapacityLimiter(max_concurrent) if max_concurrent > 0 else None
        self.queue_size = queue_size
        self.waiting = 0
        # Requests past a full queue, woken when a place (or, with no queue, a slot) frees.
        self._overflow = trio.lowlevel.ParkingLot()

    def __repr__(self) -> str:
        if self.limiter is None:
            return "<ForwardLimit off>"
        stats = self.limiter.statistics()
        return (
            f"<ForwardLimit {stats.borrowed_tokens}/{stats.total_tokens} in flight,"
            f" {self.waiting}/{self.queue_size} waiting>"
        )

    def slot(self) -> AbstractAsyncContextManager[None]:
        """Held while a request is routed; with the bound off, a context manager that
        does nothing, without the generator `_held` costs each request (2 µs)."""
        return _UNBOUNDED if self.limiter is None else self._held()

    @asynccontextmanager
    async def _held(self) -> AsyncIterator[None]:
        limiter = self.limiter
        assert limiter is not None
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:
            if self._full(limiter):
                with trio.move_on_after(QUEUE_FULL_WAIT):
                    while self._full(limiter):
                        await self._overflow.park()
                if self._full(limiter):
                    raise RouterError(
                        ErrorCode.QUEUE_FULL,
                        f"router is at --max-concurrent {int(limiter.total_tokens)} forwards"
                        f" with {self.waiting} requests waiting (--queue-size"
                        f" {self.queue_size}) for {QUEUE_FULL_WAIT:g} s",
                        retry_after=QUEUE_FULL_RETRY_AFTER,
                    ) from None
            self.waiting += 1
            try:
                await limiter.acquire()
            finally:
                self.waiting -= 1
                self._overflow.unpark()
        try:
            yield
        finally:
            limiter.release()
            self._overflow.unpark()

    def _full(self, limiter: trio.CapacityLimiter) -> bool:
        """No place among the waiters, and no free slot to take instead."""
        return self.waiting >= self.queue_size and not limiter.available_tokens
