"""The strategies that rank by one live signal: lowest-srtt, lowest-kv-cache,
lowest-queue, best-ttft, best-itl.

Each prefers the lowest value of its signal, read as gate 7 reads it (a stale engine
snapshot is unknown); equal values go to the lighter agent, then to the lowest peer ID.
An agent whose engine does not report the signal ranks after every agent that does:
ranking it first would send all traffic to an Ollama agent beside vLLM ones. SRTT is
the exception: the router measures it itself, on an agent's first answer, so an agent
with none yet ranks first, or a newcomer would never be measured and never chosen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from router.peers import Peer
from router.policy.signals import metric_value
from router.policy.strategy import RankRequest, Stateless, lighter


class LowestMetric(Stateless):
    def __init__(self, field: str, unknown: float) -> None:
        self.field = field
        self.unknown = unknown

    def __repr__(self) -> str:
        return f"<LowestMetric {self.field}, unknown as {self.unknown}>"

    def pick(
        self, candidates: Sequence[Peer], request: RankRequest, params: Any, now: float
    ) -> Peer | None:
        best: Peer | None = None
        best_value = 0.0
        for peer in candidates:
            value = metric_value(peer, self.field, now)
            if value is None:
                value = self.unknown
            if best is None or value < best_value or (value == best_value and lighter(peer, best)):
                best, best_value = peer, value
        return best


def lowest_srtt() -> LowestMetric:
    return LowestMetric("srtt", -math.inf)


def lowest_kv_cache() -> LowestMetric:
    return LowestMetric("kv_cache_utilization", math.inf)


def lowest_queue() -> LowestMetric:
    return LowestMetric("waiting_requests", math.inf)


def best_ttft() -> LowestMetric:
    return LowestMetric("avg_ttft_seconds", math.inf)


def best_itl() -> LowestMetric:
    return LowestMetric("avg_itl_seconds", math.inf)
