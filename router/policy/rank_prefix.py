"""`prefix-aware`: send a prompt where its prefix was sent before, unless that agent is busy.

An engine that already holds a prompt's prefix in its KV cache skips that much prefill:
a multi-turn chat or an agent loop that returns to the same agent gets its first token
several times sooner on long prompts (`python -m bench.strategies`). The router cannot
see the engines' caches, so it remembers where it sent each prefix (one
router/policy/prefix_tree.py tree per model) and expects the cache to hold it; the
engine's LRU may have evicted it since, which costs a miss, never a wrong answer.

The pick follows SGLang's and vLLM's `cache_aware` routers, with their two balance
thresholds on load measured as active/capacity, so agents of unequal sizes compare:

1. The candidate with the longest remembered prefix (equal: the lighter, then the lowest
   peer ID) wins when that prefix covers at least `cache_threshold` of the prompt's
   characters, unless it is *overloaded*: busier than the least-loaded candidate by
   more than `balance_threshold` and by more than `balance_rel_threshold` times.
2. Otherwise the prompt is placed like a new conversation: among the agents not
   overloaded whose remembered blocks are within `balance_rel_threshold` times the
   fewest, the longest match (a shared system prompt), then the fewest blocks.
   `cache_aware` sends such a prompt to the smallest tree; weighing the cache's fill
   rather than the moment's load spreads conversations evenly, so that they can then
   stay where they are.

bench.strategies (8 agents of capacity 16, 48 conversations opening with one of 4
shared system prompts, a first turn two thirds system prompt, a second turn 71% what
the first sent; loaded 2-core machine, hit rate and busiest agent over the mean;
`cache_aware` 84.6% at 2.00x in the same runs):

| cache_threshold, balance_threshold, balance_rel_threshold | hit rate | busiest/mean |
|---|---:|---:|
| one threshold (0.125), as before | 78.4% | 1.12 |
| 0.5, 0.25, 1.5 | 82.9% | 1.57 |
| 0.7, 0.125, 1.5 | 78.3% | 1.05 |
| 0.7, 0.25, 1.5 | 84.3-84.4% | 1.05-1.12 |
| **0.7, 0.375, 1.5** | 84.6% (3 runs) | 1.00-1.17 |
| 0.7, 0.375, 1.25 | 84.6% | 1.00 |
| 0.7, 0.5, 1.5 | 84.6% | 1.50 |

Below 0.67 a first turn follows its system prompt and conversations pile onto the
agent first sent it; a balance threshold of 0.125 (two requests at capacity 16) moves
conversations away from their cache whenever two more requests land on their agent.

With every conversation staying on its agent (bench.strategies' "history misses" 0),
what placement still decides is how many agents prefill each system prompt. On the
default trace (shared prefill; 2026-12-05, load average 2-10 from other work) each
prefill costs 0.047 points, and 8 is the fewest with the busiest agent within 1.5x of
the mean: each of the 4 system prompts opens 12 of the 48 conversations, an agent
within 1.5x holds at most 9, so each prompt needs two agents. `cache_aware`'s 85.2% is
4 prefills, one worker per prompt, at 2.00x. Where a prompt matching too little may go,
by runs of `--only "hivenet prefix-aware"`:

| room for a new conversation | system prompt prefills | hit rate |
|---|---|---:|
| **within balance_rel_threshold times the fewest blocks** | 8 in 9 runs of 9 | 85.0% |
| within balance_rel_threshold times the mean | 8 in 4 of 6 (9, 10) | 84.9-85.0% |
| the same, the mean at least the prompt's own blocks | 8 in 6 of 8 (9 twice) | 84.9-85.0% |
| cache_threshold 0.6 (a first turn follows its system prompt) | 4, at 2.00x | 85.2% |

The two rejected rooms let a new conversation join an agent holding its system prompt
sooner, and did not reach 8 more often. The trace's first turns reach the router in
trace order (system prompts 0, 3, 2, 1, 0, ...), so the first 8 new conversations,
each sent to an agent holding nothing, put each prompt on two agents; traffic whose
prompts arrive in another order may need a third agent for some.

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
DEFAULT_BALANCE_THRESHOLD = 0.375
DEFAULT_BALANCE_REL_THRESHOLD = 1.5
DEFAULT_CACHE_THRESHOLD = 0.7


@dataclass(frozen=True)
class PrefixParams:
    """`strategy_params` of a `prefix-aware` step."""

    block_chars: int = DEFAULT_BLOCK_CHARS
    max_blocks: int = DEFAULT_MAX_BLOCKS  # per model
    balance_threshold: float = DEFAULT_BALANCE_THRESHOLD  # in active/capacity
    balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD  # a ratio of loads
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD  # a fraction of the prompt


def load_limit(floor: Peer, params: PrefixParams) -> float:
    """The active/capacity above which an agent is *overloaded*: busier than the
    lightest candidate, `floor`, by more than both thresholds."""
    lightest = floor.active / floor.metadata.capacity
    return max(lightest + params.balance_threshold, lightest * params.balance_rel_threshold)


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
        keys, ends = request.blocks(params.block_chars)
        depth = tree.match(keys)
        best: Peer | None = None
        if depth:
            # The deepest match first, then one pass for the lightest agent holding it:
            # no comparison of loads between agents that hold less.
            top = max(depth.values())
            for peer in candidates:
                if depth.get(peer.peer_id) == top and (best is None or lighter(peer, best)):
                    best = peer
        limit = load_limit(floor, params)
        if best is not None:
            covered = ends[top - 1] / ends[-1] if ends[-1] else 1.0
            if covered >= params.cache_threshold and best.active / best.metadata.capacity <= limit:
                return best
        return self._roomiest(candidates, floor, tree.held, depth, limit, params)

    @staticmethod
    def _roomiest(
        candidates: Sequence[Peer],
        floor: Peer,
        held: dict[str, int],
        depth: dict[str, int],
        limit: float,
        params: PrefixParams,
    ) -> Peer:
        """Where a prompt matching too little goes: among the agents not overloaded
        whose remembered blocks are within `balance_rel_threshold` of the fewest, the
        longest match (a shared system prompt), then the fewest blocks, the lighter, the
        lowest peer ID; so new conversations spread by what the caches hold, not by the
        moment's load alone."""
        room = min(held.get(peer.peer_id, 0) for peer in candidates)
        room *= params.balance_rel_threshold
        best: Peer | None = None
        best_depth = 0
        best_blocks = 0
        for peer in candidates:
            peer_id = peer.peer_id
            blocks = held.get(peer_id, 0)
            if blocks > room:
                continue
            found = depth.get(peer_id, 0)
            if best is not None and (
                found < best_depth
                or (
                    found == best_depth
                    and (
                        blocks > best_blocks or (blocks == best_blocks and not lighter(peer, best))
                    )
                )
            ):
                continue
            if peer.active / peer.metadata.capacity <= limit:
                best, best_depth, best_blocks = peer, found, blocks
        return floor if best is None else best

    def chosen(self, peer: Peer, request: RankRequest, params: PrefixParams) -> None:
        key = (request.model, params.block_chars)
        tree = self._trees.get(key)
        if tree is None:
            tree = self._trees[key] = PrefixTree()
        tree.insert(request.blocks(params.block_chars)[0], peer.peer_id, params.max_blocks)

    def forget(self, peer_id: str) -> None:
        for key, tree in list(self._trees.items()):
            tree.forget(peer_id)
            if not len(tree):
                del self._trees[key]
