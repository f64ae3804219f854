"""The router's lock-free counters and histograms against prometheus_client's own: the
same moves give the same metrics page, byte for byte, in both exposition formats."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from router import lean_metrics
from router.lean_metrics import LeanCounter, LeanHistogram
from router.metrics import RouterMetrics

BUCKETS = (0.0001, 0.00025, 0.001, 0.5, 1, 2.5, 120)
AMOUNTS = (0.0, 0.0001, 0.00010001, 0.00025, 0.7, 1.0, 2.5, 119.9, 120.0, 121.0, math.inf, 1e-9)


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both kinds note when a child was made: the same instant for both."""
    monkeypatch.setattr("time.time", lambda: 1_700_000_000.25)


def pages(registry: CollectorRegistry) -> tuple[bytes, bytes]:
    return generate_latest(registry), generate_openmetrics(registry)


def pair() -> tuple[CollectorRegistry, CollectorRegistry, list, list]:
    """A registry of prometheus_client's metrics and one of the lean ones, alike."""
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    made: list[list] = [[], []]
    for registry, counter, histogram, out in (
        (theirs, Counter, Histogram, made[0]),
        (ours, LeanCounter, LeanHistogram, made[1]),
    ):
        out.append(
            counter("t_requests_total", "Requests\nby path", ["path", "status"], registry=registry)
        )
        out.append(counter("t_routed", "Routed, no _total given", ["model"], registry=registry))
        out.append(
            histogram("t_seconds", 'Time "quoted"', ["path"], buckets=BUCKETS, registry=registry)
        )
        out.append(
            histogram(
                "t_inf_seconds", "Ends at +Inf", ["m"], buckets=(1, math.inf), registry=registry
            )
        )
    return theirs, ours, made[0], made[1]


def test_no_sample_yet_gives_the_same_page() -> None:
    theirs, ours, _, _ = pair()
    assert pages(ours) == pages(theirs)
    assert b"# TYPE t_requests_total counter" in pages(ours)[0]


def test_the_same_moves_give_the_same_page() -> None:
    theirs, ours, their_metrics, our_metrics = pair()
    rng = random.Random(7)
    labels = ["/v1/chat/completions", "/v1/messages", 'we"ird\\path\n', "ü"]
    for _ in range(3000):
        which = rng.randrange(4)
        if which == 0:
            values = (rng.choice(labels), rng.choice(["200", "429", "503"]))
            amount = rng.choice([1, 1, 1, 2.5, 0])
        elif which == 1:
            values, amount = (rng.choice(labels),), 1
        else:
            values = (rng.choice(labels),)
            amount = rng.choice([*AMOUNTS, rng.uniform(0, 3), rng.expovariate(100)])
        for metric in (their_metrics[which], our_metrics[which]):
            child = metric.labels(*values)
            child.inc(amount) if which < 2 else child.observe(amount)
    assert pages(ours) == pages(theirs)
    text = pages(ours)[0].decode()
    assert 't_seconds_bucket{le="+Inf",path="/v1/messages"}' in text
    assert "t_routed_total{" in text and "t_routed_created{" in text


def test_a_value_that_is_not_a_string_is_one_label_with_its_text() -> None:
    theirs, ours, their_metrics, our_metrics = pair()
    for metric in (their_metrics[0], our_metrics[0]):
        metric.labels("/p", 200).inc()
        metric.labels("/p", "200").inc()
    assert pages(ours) == pages(theirs)
    assert our_metrics[0].labels("/p", "200").value == 2


def test_nan_is_summed_and_counted_in_no_bucket() -> None:
    theirs, ours, their_metrics, our_metrics = pair()
    for metric in (their_metrics[2], our_metrics[2]):
        metric.labels("/p").observe(0.5)
        metric.labels("/p").observe(math.nan)
    assert pages(ours) == pages(theirs)


def test_refusals_are_prometheus_clients() -> None:
    _, _, _, ours = pair()
    with pytest.raises(ValueError):
        ours[0].labels("/only-one")
    with pytest.raises(ValueError):
        ours[0].labels("/p", "200").inc(-1)
    with pytest.raises(ValueError):
        LeanHistogram("h", "unsorted", ["a"], CollectorRegistry(), buckets=(2, 1))
    registry = CollectorRegistry()
    LeanCounter("dup_total", "one", ["a"], registry)
    with pytest.raises(ValueError):
        Counter("dup", "two", ["a"], registry=registry)


def test_created_series_follow_prometheus_clients_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lean_metrics, "_CREATED", False)
    monkeypatch.setattr("prometheus_client.metrics._use_created", False)
    theirs, ours, their_metrics, our_metrics = pair()
    for metric in (their_metrics[0], our_metrics[0]):
        metric.labels("/p", "200").inc()
    for metric in (their_metrics[2], our_metrics[2]):
        metric.labels("/p").observe(0.3)
    assert pages(ours) == pages(theirs)
    assert b"_created" not in pages(ours)[0]


def test_the_routers_page_names_the_lean_families() -> None:
    metrics = RouterMetrics()
    metrics.requests.labels("/v1/chat/completions", "200", "-").inc()
    metrics.duration.labels("/v1/chat/completions", "-").observe(0.03)
    metrics.overhead.labels("/v1/chat/completions").observe(0.0004)
    metrics.routed.labels("m", "-").inc()
    sample = metrics.registry.get_sample_value
    labels = {"endpoint": "/v1/chat/completions", "tenant": "-"}
    assert sample("hivenet_router_http_requests_total", {**labels, "status": "200"}) == 1
    assert sample("hivenet_router_request_duration_seconds_bucket", {**labels, "le": "0.05"}) == 1
    assert sample("hivenet_router_request_duration_seconds_bucket", {**labels, "le": "0.025"}) == 0
    assert (
        sample("hivenet_router_router_overhead_seconds_count", {"endpoint": labels["endpoint"]})
        == 1
    )
    assert (
        sample("hivenet_router_routing_requests_routed_total", {"model": "m", "tenant": "-"}) == 1
    )
    text = generate_latest(metrics.registry).decode()
    for family in ("policy_primary_routed_total", "policy_fallback_routed_total"):
        assert f"# TYPE hivenet_router_{family} counter" in text


def test_a_histogram_with_a_negative_bound_has_no_sum() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    children = [
        Histogram("t_delta", "Below zero", ["a"], buckets=(-1, 0, 1), registry=theirs).labels("x"),
        LeanHistogram("t_delta", "Below zero", ["a"], ours, buckets=(-1, 0, 1)).labels("x"),
    ]
    for child in children:
        for amount in (-2, -1, 0.5, 3):
            child.observe(amount)
    assert pages(ours) == pages(theirs)
    assert b"t_delta_sum" not in pages(ours)[0]
