"""Capacity slots and the per-model wait queue.

Slots are counted on the peer record. The queue is ordered by priority (higher first)
and first come, first served within a priority: a release wakes the head waiter only;
a waiter that wakes passes the wake-up on to the one behind it, whether it got a slot
(there may be more room) or not (the freed agent may not match its step), so every
waiter sees each change once, in queue order.

A waiter that joins ahead of one already woken is not owed that wake-up: it found no
usable agent when it joined, after the change; every later change wakes the head
again. A waiter woken while one ahead of it is woken too waits for that one to look
first, so the room a change makes goes in queue order whichever task trio runs first.
When the queue is full, a newcomer of higher priority than the last waiter takes that
waiter's place; the evicted request leaves the queue as if it had found it full.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import trio

from router.peers import Peer


def report_elsewhere(peer: Peer, value: object, full: bool = False) -> bool:
    """The agent's count of the other routers' requests (`elsewhere`); True when the
    agent may have gained room, so the model's waiters should look again.

    Bounded to [0, capacity]: a hostile number cannot make the count overflow or stay
    wrong past the next report. `full`: the agent refused a request for want of room,
    so it is full now whatever this router's count says, until its next report.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        reported = min(max(value, 0), peer.metadata.capacity)
    else:
        reported = 0
    own = peer.active - peer.elsewhere
    if full:
        # `own` still counts the refused request, whose slot is about to be released.
        reported = min(max(reported, peer.metadata.capacity - own + 1), peer.metadata.capacity)
    change = reported - peer.elsewhere
    peer.elsewhere = reported
    peer.active = own + reported
    return change < 0


def try_acquire(peer: Peer) -> bool:
    """Take one slot on `peer` if it has one free; synchronous, so atomic under trio."""
    if peer.active >= peer.metadata.capacity:
        return False
    peer.active += 1
    return True


@dataclass(eq=False)
class Waiter:
    priority: int = 0
    event: trio.Event = field(default_factory=trio.Event)
    # Pushed out of a full queue by a request of higher priority.
    evicted: bool = False


def _rank(waiter: Waiter) -> int:
    return -waiter.priority


class WaitQueue:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._waiters: dict[str, list[Waiter]] = {}
        self._total = 0
        # Queued waiters woken and not yet looked, per model: `woken_ahead` scans the
        # queue only when there are two. A count too high costs a scan, never the order.
        self._woken: dict[str, int] = {}

    def length(self, model: str) -> int:
        return len(self._waiters.get(model, ()))

    def total(self) -> int:
        """Waiters of every model."""
        return self._total

    def lengths(self) -> dict[str, int]:
        return {m: len(w) for m, w in self._waiters.items() if w}

    def full(self, model: str) -> bool:
        return self.depth <= 0 or self.length(model) >= self.depth

    def notify(self, model: str) -> None:
        """Capacity may have appeared for `model`: wake the head waiter."""
        waiters = self._waiters.get(model)
        if waiters:
            self._wake(model, waiters[0])

    def join(self, model: str, priority: int = 0) -> Waiter | None:
        """A place behind every waiter of the same or higher priority; None when full.

        O(log n) to find the place and O(n) to insert, n the model's waiters.
        """
        if self.depth <= 0:
            return None
        waiters = self._waiters.setdefault(model, [])
        if len(waiters) >= self.depth:
            last = waiters[-1]
            if last.priority >= priority:
                return None
            waiters.pop()
            self._total -= 1
            self._unwoken(model, last)
            last.evicted = True
            last.event.set()
        waiter = Waiter(priority)
        waiters.insert(bisect.bisect_right(waiters, -priority, key=_rank), waiter)
        self._total += 1
        return waiter

    def woke(self, model: str, waiter: Waiter) -> None:
        """Stay queued in place after a wake-up that did not yield a slot."""
        self._pass_on(model, waiter)
        self.rearm(model, waiter)

    def woken_ahead(self, model: str, waiter: Waiter) -> bool:
        """Whether a waiter ahead of `waiter` has been woken and not yet looked.

        A wake-up passed down the queue for one change can reach a waiter after the head
        was woken for a later one: the room that change made is the head's to look at
        first. Taken by whichever task trio ran first, it went to a lower priority."""
        if self._woken.get(model, 0) < 2:
            return False  # the waiter's own wake-up, or none: the chain's usual case
        waiters = self._waiters.get(model, ())
        for ahead in waiters:
            if ahead is waiter:
                return False
            if ahead.event.is_set():
                return waiter in waiters  # an evicted waiter is ahead of no one
        return False

    def rearm(self, model: str, waiter: Waiter) -> None:
        """Wait again without passing the wake-up on: the one ahead will, once it looks."""
        self._unwoken(model, waiter)
        waiter.event = trio.Event()

    def leave(self, model: str, waiter: Waiter) -> None:
        """Leave the queue (slot taken, gave up, or cancelled); wake the next in line."""
        woken = waiter.event.is_set()
        if woken:
            self._pass_on(model, waiter)
        waiters = self._waiters.get(model)
        if waiters is not None and waiter in waiters:
            self._unwoken(model, waiter)
            waiters.remove(waiter)
            self._total -= 1
            if not waiters:
                del self._waiters[model]
                self._woken.pop(model, None)

    def _pass_on(self, model: str, waiter: Waiter) -> None:
        waiters = self._waiters.get(model, [])
        try:
            i = waiters.index(waiter)
        except ValueError:
            return
        if i + 1 < len(waiters):
            self._wake(model, waiters[i + 1])

    def _wake(self, model: str, waiter: Waiter) -> None:
        if not waiter.event.is_set():
            waiter.event.set()
            self._woken[model] = self._woken.get(model, 0) + 1

    def _unwoken(self, model: str, waiter: Waiter) -> None:
        """`waiter`, still queued, has looked (or leaves): one woken waiter fewer."""
        if waiter.event.is_set():
            self._woken[model] = max(0, self._woken.get(model, 0) - 1)
