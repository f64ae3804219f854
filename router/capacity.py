"""Capacity slots and the per-model wait queue.

Slots are counted on the peer record. The queue is FIFO: a release wakes the head
waiter only; a waiter that wakes passes the wake-up on to the one behind it, whether
it got a slot (there may be more room) or not (the freed agent may not match its
step), so every waiter sees each change once, in arrival order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from router.peers import Peer


def try_acquire(peer: Peer) -> bool:
    """Take one slot on `peer` if it has one free; synchronous, so atomic under trio."""
    if peer.active >= peer.metadata.capacity:
        return False
    peer.active += 1
    return True


@dataclass(eq=False)
class Waiter:
    event: trio.Event = field(default_factory=trio.Event)


class WaitQueue:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._waiters: dict[str, list[Waiter]] = {}

    def length(self, model: str) -> int:
        return len(self._waiters.get(model, ()))

    def lengths(self) -> dict[str, int]:
        return {m: len(w) for m, w in self._waiters.items() if w}

    def full(self, model: str) -> bool:
        return self.depth <= 0 or self.length(model) >= self.depth

    def notify(self, model: str) -> None:
        """Capacity may have appeared for `model`: wake the head waiter."""
        waiters = self._waiters.get(model)
        if waiters:
            waiters[0].event.set()

    def join(self, model: str) -> Waiter:
        waiter = Waiter()
        self._waiters.setdefault(model, []).append(waiter)
        return waiter

    def woke(self, model: str, waiter: Waiter) -> None:
        """Stay queued in place after a wake-up that did not yield a slot."""
        self._pass_on(model, waiter)
        waiter.event = trio.Event()

    def leave(self, model: str, waiter: Waiter) -> None:
        """Leave the queue (slot taken, gave up, or cancelled); wake the next in line."""
        woken = waiter.event.is_set()
        if woken:
            self._pass_on(model, waiter)
        waiters = self._waiters.get(model)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[model]

    def _pass_on(self, model: str, waiter: Waiter) -> None:
        waiters = self._waiters.get(model, [])
        try:
            i = waiters.index(waiter)
        except ValueError:
            return
        if i + 1 < len(waiters):
            waiters[i + 1].event.set()
