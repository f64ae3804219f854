"""Labelled counters and histograms that every request moves, without a lock.

prometheus_client's children take a threading lock per `inc` and per bucket and sum of
an `observe`, and `labels()` checks its arguments and takes one more: with the five a
whole answer moves, about 5% of the router's CPU per answer at 64 clients (py-spy, the
system calls left out). The router moves its metrics and serves its metrics page from
its one trio thread, so nothing here needs a lock. These are collectors: the registry
asks them for the same families and samples prometheus_client's own would give, so the
page is the same, in either exposition format (a test holds them equal).
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.utils import INF, floatToGoString

# prometheus_client's own switch for the `_created` series, read the way it reads it.
_CREATED = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in (
    "true",
    "1",
    "t",
)


class CountChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        # The first bound at or above the amount (+Inf's past the last finite one). NaN
        # is in no bucket, as in prometheus_client, whose `amount <= bound` never holds.
        if amount == amount:
            self.counts[bisect_left(self._bounds, amount)] += 1


Child = TypeVar("Child", CountChild, HistogramChild)


class _Labelled(Generic[Child]):
    kind = ""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Child] = {}
        registry.register(self)

    def labels(self, *values: str) -> Child:
        """The child for these label values, as prometheus_client's `labels()`."""
        return self._children.get(values) or self._child_for(values)

    def _child_for(self, values: tuple[str, ...]) -> Child:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected")
        values = tuple(str(value) for value in values)
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._new_child()
        return child

    def _new_child(self) -> Child:
        raise NotImplementedError

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, self.kind)
        for values, child in list(self._children.items()):
            labels = dict(zip(self.labelnames, values, strict=True))
            self._add_samples(metric, labels, child)
        return [metric]

    def _add_samples(self, metric: Metric, labels: dict[str, str], child: Child) -> None:
        raise NotImplementedError


class LeanCounter(_Labelled[CountChild]):
    """A labelled Counter: `labels(*values).inc(amount)`."""

    kind = "counter"

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _new_child(self) -> CountChild:
        return CountChild()

    def _add_samples(self, metric: Metric, labels: dict[str, str], child: CountChild) -> None:
        metric.add_sample(self.name + "_total", labels, child.value)
        if _CREATED:
            metric.add_sample(self.name + "_created", labels, child.created)


class LeanHistogram(_Labelled[HistogramChild]):
    """A labelled Histogram: `labels(*values).observe(amount)`."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds) or not bounds:
            raise ValueError("buckets must be given, in increasing order")
        if bounds[-1] != INF:
            bounds.append(INF)
        self.bounds = bounds
        self._le = [floatToGoString(b) for b in bounds]
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def _add_samples(self, metric: Metric, labels: dict[str, str], child: HistogramChild) -> None:
        name = self.name
        total = 0.0
        for le, count in zip(self._le, child.counts, strict=True):
            total += count
            metric.add_sample(name + "_bucket", {**labels, "le": le}, total)
        metric.add_sample(name + "_count", labels, total)
        if self.bounds[0] >= 0:
            metric.add_sample(name + "_sum", labels, child.sum)
        if _CREATED:
            metric.add_sample(name + "_created", labels, child.created)
