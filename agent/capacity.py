"""The agent's `--capacity`, counted over every router session it serves.

Each router counts its own requests; only the agent sees them all. It refuses a
request that would exceed its capacity (`agent_full`, before any work) and tells each
router how many requests the others hold (`elsewhere`) in the frames it sends anyway:
heartbeats, `response_end` (or `response`) and `error`. Frames beyond those go out
only near the limit: when a slot frees, each other router last told a count that left
no room or one slot (`told_full`) gets a heartbeat, so its queued requests need not
wait a heartbeat period (5 s) for the room. At most one such heartbeat per router per
finished request, and none while the agent has two slots or more free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class Holder:
    """One router session's share: its live requests and what it was last told."""

    notify: Callable[[], None]
    held: int = 0
    # Told a number that, with its own requests, filled the agent.
    told_full: bool = False


@dataclass
class SharedCapacity:
    capacity: int
    in_flight: int = 0
    holders: list[Holder] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"<SharedCapacity {self.in_flight}/{self.capacity}, {len(self.holders)} routers>"

    def join(self, notify: Callable[[], None]) -> Holder:
        holder = Holder(notify)
        self.holders.append(holder)
        return holder

    def leave(self, holder: Holder) -> None:
        if holder in self.holders:
            self.holders.remove(holder)
            self.in_flight -= holder.held
            holder.held = 0

    def try_take(self, holder: Holder) -> bool:
        """A slot for one request of `holder`'s router; False when the agent is full."""
        if self.in_flight >= self.capacity:
            holder.told_full = True
            return False
        self.in_flight += 1
        holder.held += 1
        return True

    def give_back(self, holder: Holder) -> None:
        """A request ended; routers told the agent was full hear of the room."""
        self.in_flight -= 1
        holder.held -= 1
        for other in self.holders:
            if other.told_full and other is not holder:
                other.told_full = False
                other.notify()

    def elsewhere(self, holder: Holder) -> int:
        """What to tell `holder`'s router: the requests the other routers hold."""
        others = self.in_flight - holder.held
        # One free slot or none: a router that sees this may queue on it.
        if self.in_flight + 1 >= self.capacity:
            holder.told_full = True
        return others
