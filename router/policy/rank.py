"""Ranking: choose one agent among those that survived every gate.

`STRATEGIES` names every unit `strategy:` accepts; `Ranking` holds one instance of
each per router, so what round-robin and prefix-aware remember outlives a policy
reload and is dropped with the router.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from router.peers import Peer
from router.policy import rank_metrics
from router.policy.rank_prefix import PrefixAware, PrefixParams
from router.policy.rank_round_robin import RoundRobin
from router.policy.strategy import LeastLoaded, RankRequest, Strategy, least_loaded

__all__ = ["PARAMS", "STRATEGIES", "RankRequest", "Ranking", "Strategy", "least_loaded"]

STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "least-loaded": LeastLoaded,
    "lowest-srtt": rank_metrics.lowest_srtt,
    "round-robin": RoundRobin,
    "prefix-aware": PrefixAware,
    "lowest-kv-cache": rank_metrics.lowest_kv_cache,
    "lowest-queue": rank_metrics.lowest_queue,
    "best-ttft": rank_metrics.best_ttft,
    "best-itl": rank_metrics.best_itl,
}

# The strategies that take a `strategy_params` block, and its record.
PARAMS: dict[str, type[PrefixParams]] = {"prefix-aware": PrefixParams}


class Ranking:
    """The router's ranking units, each made on first use and kept for the router's life."""

    def __init__(self) -> None:
        self._units: dict[str, Strategy] = {}

    def __repr__(self) -> str:
        return f"<Ranking {', '.join(self._units) or 'unused'}>"

    def unit(self, name: str) -> Strategy:
        strategy = self._units.get(name)
        if strategy is None:
            strategy = self._units[name] = STRATEGIES[name]()
        return strategy

    def pick(
        self,
        name: str,
        params: Any,
        candidates: Sequence[Peer],
        request: RankRequest,
        now: float,
    ) -> Peer | None:
        return self.unit(name).pick(candidates, request, params, now)

    def chosen(self, name: str, params: Any, peer: Peer, request: RankRequest) -> None:
        self.unit(name).chosen(peer, request, params)

    def forget(self, peer_id: str) -> None:
        """An agent left the peer table: no unit may keep ranking by what it held."""
        for strategy in self._units.values():
            strategy.forget(peer_id)
