"""`shed_if`: a step's admission check against router-wide load, before its gates.

The load fields are read only when a step's rules name them, so a policy without
`shed_if` pays nothing, and one with it pays O(1) for queue depths and one pass over
the model's agents for `model_capacity_utilization` (the gates make the same pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.capacity import WaitQueue
from router.peers import Peer
from router.policy.schema import POOL_SHED_FIELDS, Rule, Shed


@dataclass(frozen=True)
class ShedHit:
    """The rule that refused a request, and the load value that violated it."""

    rule: Rule
    value: float

    def detail(self) -> str:
        """`model_queue_depth(got=3,gte=2)`, in the style of the gates' drain details."""
        rule = self.rule
        return f"{rule.field}(got={_number(self.value)},{rule.op}={_number(rule.threshold)})"


def load_value(field: str, model: str, pool: Sequence[Peer], queue: WaitQueue) -> float | None:
    """The router-wide load `field` for a request of `model`; None when unknown."""
    if field == "model_queue_depth":
        return float(queue.length(model))
    if field == "total_queue_depth":
        return float(queue.total())
    if field == "model_capacity_utilization":
        capacity = active = 0
        for peer in pool:
            if peer.routable:
                capacity += peer.metadata.capacity
                active += peer.active
        # No healthy agent: nothing to measure, and a missing value passes, as in gate 7.
        return active / capacity if capacity else None
    if field in POOL_SHED_FIELDS:
        # Upstream's front door: the mean over the healthy agents that report it; an
        # agent that has not reported yet is left out, and none reporting passes.
        values = [v for p in pool if p.routable and (v := p.engine.get(field)) is not None]
        return sum(values) / len(values) if values else None
    raise ValueError(f"unknown shed_if field {field!r}")


def shed(
    rules: Shed,
    tenant: str,
    priority: int,
    model: str,
    pool: Sequence[Peer],
    queue: WaitQueue,
) -> ShedHit | None:
    """The first violated load rule, in policy order, when `rules` select the request."""
    if not rules.selects(tenant, priority):
        return None
    for rule in rules.rules:
        value = load_value(rule.field, model, pool, queue)
        if value is not None and rule.violated(value):
            return ShedHit(rule, value)
    return None


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3g}"
