"""What the console's recent-requests ring adds to one request, in microseconds.

    python -m bench.recent [--requests 200000]

Per request the router calls `Console.begin` and `Console.end` and the story handler
sees each log line: at the default `info`, the access line. This times those calls
alone, with the ring full (the steady state), beside the access line's own logging cost,
so the two can be compared; `bench.overhead` measures whole requests but its noise on a
shared host is larger than this.
"""

from __future__ import annotations

import argparse
import io
import logging
import time

from protocol.logs import setup_logging
from router.http.client import ROUTE
from router.recent import RecentRequests, StoryHandler


class _Route:
    model = "bench-model"
    agent = "12D3KooWAgent"
    tries = 1


def _time(n: int, body: object) -> float:
    start = time.perf_counter()
    body(n)  # type: ignore[operator]
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200_000)
    args = parser.parse_args()
    n = args.requests
    setup_logging({"HIVENET_LOG_LEVEL": "info"})
    root = logging.getLogger()
    root.handlers[0].stream = io.StringIO()  # type: ignore[attr-defined]
    log = logging.getLogger("http")
    recent = RecentRequests()
    scope = {ROUTE: _Route()}

    def access_lines(count: int) -> None:
        for i in range(count):
            log.info("req=%s method=%s path=%s status=%d", f"r{i}", "POST", "/v1/chat", 200)

    def ring(count: int) -> None:
        for i in range(count):
            entry = recent.begin(f"r{i}", "/v1/chat/completions")
            route = scope[ROUTE]
            entry.model, entry.agent, entry.tries = route.model, route.agent, route.tries
            entry.status, entry.tenant, entry.latency_ms = 200, "-", 1.0
            log.info("req=%s method=%s path=%s status=%d", f"r{i}", "POST", "/v1/chat", 200)
            recent.end(entry)

    plain = min(_time(n, access_lines) for _ in range(3))
    handler = StoryHandler(recent)
    root.addHandler(handler)
    with_ring = min(_time(n, ring) for _ in range(3))
    root.removeHandler(handler)
    print(f"access line alone: {plain:.2f} µs/request")
    print(f"access line + ring + story: {with_ring:.2f} µs/request")
    print(f"the console's share: {with_ring - plain:.2f} µs/request")


if __name__ == "__main__":
    main()
