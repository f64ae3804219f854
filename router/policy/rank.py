"""Ranking: choose one agent among those that survived every gate."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.peers import Peer


def least_loaded(candidates: Sequence[Peer]) -> Peer | None:
    """The agent with the lowest active/capacity ratio; ties go to the lowest peer ID.

    Candidates arrive in peer-ID order, so keeping the first minimum is the tie-break.
    Ratios are compared by cross-multiplying the integers: floats would make 1/3 and
    2/6 differ by rounding and break ties by accident.
    """
    best: Peer | None = None
    best_active = 0
    best_capacity = 1
    for peer in candidates:
        active = peer.active
        capacity = peer.metadata.capacity
        if best is None or active * best_capacity < best_active * capacity:
            best, best_active, best_capacity = peer, active, capacity
    return best


Strategy = Callable[[Sequence[Peer]], Peer | None]

STRATEGIES: dict[str, Strategy] = {"least-loaded": least_loaded}

# Named by the seeds as not implemented; a policy using one is rejected at load time.
NOT_IMPLEMENTED: tuple[str, ...] = (
    "lowest-srtt",
    "round-robin",
    "prefix-aware",
    "lowest-kv-cache",
    "lowest-queue",
    "best-ttft",
    "best-itl",
)
