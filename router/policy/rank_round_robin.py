"""`round-robin`: each model's candidates in turn, by peer ID.

The router remembers the peer ID it last took per model and takes the first candidate
after it, wrapping to the lowest. Keyed by peer ID rather than by a counter, so an agent
that joins, leaves or is gated out shifts nobody else's turn. Load is not consulted:
the capacity gate already keeps full agents out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.peers import Peer
from router.policy.strategy import RankRequest


class RoundRobin:
    def __init__(self) -> None:
        self._last: dict[str, str] = {}  # model -> the peer ID taken last

    def __repr__(self) -> str:
        return f"<RoundRobin {len(self._last)} models>"

    def pick(
        self, candidates: Sequence[Peer], request: RankRequest, params: Any, now: float
    ) -> Peer | None:
        if not candidates:
            return None
        last = self._last.get(request.model)
        if last is not None:
            for peer in candidates:
                if peer.peer_id > last:
                    return peer
        return candidates[0]

    def chosen(self, peer: Peer, request: RankRequest, params: Any) -> None:
        self._last[request.model] = peer.peer_id

    def forget(self, peer_id: str) -> None:
        # A departed agent's ID still orders the turn correctly: nothing to drop.
        del peer_id
