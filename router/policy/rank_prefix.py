"""`prefix-aware`: send a prompt where its prefix was sent before, unless that agent is busy.

An engine that already holds a prompt's prefix in its KV cache skips that much prefill:
a multi-turn chat or an agent loop that returns to the same agent gets its first token
several times sooner on long prompts (`python -m bench.strategies`). The router cannot
see the engines' caches, so it remembers where it sent each prefix (one
router/policy/prefix_tree.py tree per model) and expects the cache to hold it; the
engine's LRU may have evicted it since, which costs a miss, never a wrong answer.

The pick: the least-loaded candidate sets the floor; every candidate whose
active/capacity is within `balance_threshold` of that floor is eligible, and the
eligible agent with the longest remembered prefix wins (equal prefixes: the lighter,
then the lowest peer ID). With no remembered prefix, or when every agent holding it is
busier than the threshold allows, this is least-loaded. SGLang's and vLLM's
`cache_aware` routers make the same trade with an absolute and a relative threshold on
queue lengths; one threshold on the capacity fraction serves agents of unequal sizes.

The tree learns at selection, once the slot is held (as SGLang's router inserts at
routing time): the prompt is being prefilled there from that moment, and the next turn
of a conversation may arrive before this one's answer ends. It forgets an agent that
leaves the peer table; the router's restart starts every tree empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.peers import Peer
from router.policy.prefix_tree import PrefixTree
from router.policy.strategy import RankRequest, least_loaded, lighter

DEFAULT_BLOCK_CHARS = 1024
DEFAULT_MAX_BLOCKS = 65_536
# An eighth of capacity: one request more than the lightest at the agents' default
# capacity of 10, two at 16. bench.strategies (8 agents of capacity 16, 4 shared system
# prompts, turns interleaved): at 0.125 the busiest agent served 1.12x the mean load at
# a 77% hit rate; at 0.1, 1.08x and 73%; at 0.2, 1.57x and 79%; at 0.25, 1.73x and 81%
# (conversations that open with one system prompt pile onto the agent first sent it).
DEFAULT_BALANCE_THRESHOLD = 0.125


@dataclass(frozen=True)
class PrefixParams:
    """`strategy_params` of a `prefix-aware` step."""

    block_chars: int = DEFAULT_BLOCK_CHARS
    max_blocks: int = DEFAULT_MAX_BLOCKS  # per model
    balance_threshold: float = DEFAULT_BALANCE_THRESHOLD  # in active/capacity


class PrefixAware:
    def __init__(self) -> None:
        self._trees: dict[tuple[str, int], PrefixTree] = {}  # (model, block_chars)

    def __repr__(self) -> str:
        return f"<PrefixAware {len(self._trees)} trees>"

    def tree(self, model: str, block_chars: int) -> PrefixTree | None:
        return self._trees.get((model, block_chars))

    def pick(
        self, candidates: Sequence[Peer], request: RankRequest, params: PrefixParams, now: float
    ) -> Peer | None:
        floor = least_loaded(candidates)
        tree = self._trees.get((request.model, params.block_chars))
        if floor is None or tree is None:
            return floor
        depth = tree.match(request.block_keys(params.block_chars))
        if not depth:
            return floor
        # (active / capacity) - (floor's) <= threshold, kept in floats: the threshold
        # is a float and an exact tie at the boundary is no tie-break.
        limit = floor.active / floor.metadata.capacity + params.balance_threshold
        best = floor
        best_depth = depth.get(floor.peer_id, 0)
        for peer in candidates:
            found = depth.get(peer.peer_id, 0)
            if found < best_depth or found == 0:
                continue
            if found == best_depth and not lighter(peer, best):
                continue
            if peer.active / peer.metadata.capacity <= limit:
                best, best_depth = peer, found
        return best

    def chosen(self, peer: Peer, request: RankRequest, params: PrefixParams) -> None:
        key = (request.model, params.block_chars)
        tree = self._trees.get(key)
        if tree is None:
            tree = self._trees[key] = PrefixTree()
        tree.insert(request.block_keys(params.block_chars), peer.peer_id, params.max_blocks)

    def forget(self, peer_id: str) -> None:
        for key, tree in list(self._trees.items()):
            tree.forget(peer_id)
            if not len(tree):
                del self._trees[key]
