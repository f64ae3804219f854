"""What every ranking unit is: one signature, the request it ranks for, the load order.

Shaped like llm-d's scheduler plugins (a small named unit behind a one-method
interface): a `Strategy` picks one agent among the candidates that survived every
gate, in peer-ID order, and hears which agent the router finally took. The router
calls `chosen` only once the slot is acquired, so an agent that lost the race for its
last slot is never remembered as chosen, and the re-selection sees the same state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.peers import Peer
from router.policy.prefix_tree import blocks, prompt_text


@dataclass(slots=True)
class RankRequest:
    """The request as a strategy sees it: its model and its parsed body.

    The body was parsed once by the HTTP layer; its prompt is cut into blocks at most
    once per block size, however many selections and fallback steps the request sees.
    """

    model: str
    payload: dict[str, Any]
    _blocks: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)

    def blocks(self, block_chars: int) -> tuple[list[int], list[int]]:
        """The prompt's block keys and where each block ends (prefix_tree.blocks)."""
        cut = self._blocks.get(block_chars)
        if cut is None:
            cut = self._blocks[block_chars] = blocks(prompt_text(self.payload), block_chars)
        return cut


class Strategy(Protocol):
    """A ranking unit. `params` is the step's `strategy_params` (None when it has none)."""

    def pick(
        self, candidates: Sequence[Peer], request: RankRequest, params: Any, now: float
    ) -> Peer | None: ...

    def chosen(self, peer: Peer, request: RankRequest, params: Any) -> None: ...

    def forget(self, peer_id: str) -> None: ...


def lighter(a: Peer, b: Peer) -> bool:
    """a's active/capacity is below b's. Integers are cross-multiplied: floats would make
    1/3 and 2/6 differ by rounding and break ties by accident."""
    return a.active * b.metadata.capacity < b.active * a.metadata.capacity


def least_loaded(candidates: Sequence[Peer]) -> Peer | None:
    """The agent with the lowest active/capacity ratio; ties go to the lowest peer ID.

    Candidates arrive in peer-ID order, so keeping the first minimum is the tie-break.
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


class Stateless:
    """A unit that remembers nothing: the router's choices and departures are no news."""

    def chosen(self, peer: Peer, request: RankRequest, params: Any) -> None:
        del peer, request, params

    def forget(self, peer_id: str) -> None:
        del peer_id


class LeastLoaded(Stateless):
    """`least-loaded`: the lowest active/capacity, the seeds' default."""

    def pick(
        self, candidates: Sequence[Peer], request: RankRequest, params: Any, now: float
    ) -> Peer | None:
        return least_loaded(candidates)
