"""`GET /metrics` is built in steps (router/metrics_page.py): the same page as
prometheus_client's, and other tasks run while a large fleet's page is built."""

from __future__ import annotations

import gc
import gzip
from typing import Any

import pytest
import trio
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from protocol.collector import Freezer
from router import metrics_page
from router.agent_metrics import AgentCollector
from router.lean_metrics import LeanHistogram
from router.metrics_page import PREPARED
from tests.peer_tables import many_agents, turns_during

AGENTS = 300


def _fleet() -> tuple[CollectorRegistry, AgentCollector]:
    table = many_agents(AGENTS)
    registry = CollectorRegistry()
    collector = AgentCollector(table, registry)
    counter = Counter("hivenet_router_x_total", "a counter", ["model"], registry=registry)
    for n in range(AGENTS):  # with its `_created` samples, written after the rest
        counter.labels(f"m{n}").inc(3)
    # A histogram of many series: its family is formatted in slices that cut through one.
    lag = LeanHistogram("hivenet_router_y_seconds", "a histogram", ["n"], registry, [0.1, 1])
    for n in range(150):
        lag.labels(str(n)).observe(n / 100)
    return registry, collector


def _steady(page: bytes) -> bytes:
    """The page less the samples read from the wall clock (last seen), which move."""
    lines = page.split(b"\n")
    return b"\n".join(x for x in lines if not x.startswith(b"hivenet_router_agent_last_seen"))


async def _get(
    app: Any, headers: list[tuple[bytes, bytes]], query: bytes = b""
) -> tuple[dict, bytes]:
    scope = {"type": "http", "path": "/metrics", "method": "GET", "headers": headers}
    scope["query_string"] = query
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0], b"".join(m.get("body", b"") for m in sent[1:])


def test_the_page_is_prometheus_clients_own() -> None:
    registry, collector = _fleet()
    page = metrics_page.metrics_page(registry, collector)

    async def main() -> None:
        start, body = await _get(page, [])
        assert start["status"] == 200
        assert _steady(body) == _steady(generate_latest(registry))
        assert body.count(b"hivenet_router_agent_capacity{") == AGENTS
        start, body = await _get(page, [(b"accept", b"application/openmetrics-text")])
        assert dict(start["headers"])[b"content-type"].startswith(b"application/openmetrics-text")
        assert _steady(body) == _steady(openmetrics_latest(registry))
        assert body.endswith(b"# EOF\n") and body.count(b"# EOF") == 1
        start, body = await _get(page, [(b"accept-encoding", b"gzip")])
        assert dict(start["headers"])[b"content-encoding"] == b"gzip"
        assert _steady(gzip.decompress(body)) == _steady(generate_latest(registry))
        _, body = await _get(page, [], b"name[]=hivenet_router_x_total")
        assert body.startswith(b"# HELP hivenet_router_x_total")
        assert b"agent_capacity" not in body
        assert PREPARED.get() is None  # a later collection builds its own

    trio.run(main)


def test_other_tasks_run_while_a_large_page_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    registry, collector = _fleet()
    page = metrics_page.metrics_page(registry, collector)
    monkeypatch.setattr(metrics_page, "STEP_SECONDS", 0.0)  # a checkpoint at every step

    async def main() -> None:
        (_, body), turns = await turns_during(lambda: _get(page, []))
        assert _steady(body) == _steady(generate_latest(registry))
        # One turn at least per agent built and per slice formatted.
        assert turns >= AGENTS

    trio.run(main)


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "unfrozen"])
def test_no_collector_pass_walks_the_page_being_built(
    monkeypatch: pytest.MonkeyPatch, freeze: bool
) -> None:
    # The page's samples live until it is sent and die by their reference count: the
    # router's Freezer freezes them at each step, so a pass meanwhile walks only what
    # the last step allocated (at 1,000 agents a pass walked up to 20,000 of them).
    registry, collector = _fleet()
    freezer = Freezer()
    walkable: list[int] = []

    def settle() -> None:
        walkable.append(sum(len(gc.get_objects(generation=g)) for g in range(3)))
        if freeze:
            freezer.freeze()

    page = metrics_page.metrics_page(registry, collector, settle)
    monkeypatch.setattr(metrics_page, "STEP_SECONDS", 0.0)  # a checkpoint at every step
    gc.unfreeze()
    try:
        freezer.tick()  # the first: a complete pass, its survivors frozen
        _, body = trio.run(_get, page, [])
    finally:
        gc.unfreeze()
    assert _steady(body) == _steady(generate_latest(registry))
    samples = body.count(b"\nhivenet_router_agent_")
    assert samples > 10 * AGENTS
    if freeze:
        assert max(walkable) < 2_000, max(walkable)
    else:  # what a pass would walk grows with the page
        assert max(walkable) > samples
