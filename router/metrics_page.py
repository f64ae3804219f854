"""`GET /metrics` on `--metrics-port`, built in steps so that a scrape does not stop
the event loop.

prometheus_client's ASGI app collects and formats the whole registry in one call. With
1,000 agents that is about 30,000 per-agent samples: 100 to 250 ms of CPU in one run
batch of the router's loop (bench.fleet), during which no frame, heartbeat or request
moves, once per Prometheus scrape. Here the per-agent families are built a slice of the
table at a time and formatted `SLICE` samples at a time, with a checkpoint whenever
`STEP_SECONDS` have passed. The page is the same bytes prometheus_client would send:
its own encoders (text or OpenMetrics, as the `Accept` header chooses), gzip when asked
(compressed in steps too), and its own app for a `name[]` selection.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from time import perf_counter
from typing import Any
from urllib.parse import parse_qs

import trio
from prometheus_client import CollectorRegistry, make_asgi_app
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.metrics_core import Metric

# The longest stretch of building or formatting between two checkpoints. A step runs
# until a check finds this passed, so it is this plus one piece: at 2 ms and 200
# samples a piece, steps of 3 ms here, and up to 9 ms of CPU on a busy host
# (bench.fleet, issue 51), against the loop's target of 5 ms.
STEP_SECONDS = 0.001
# Samples formatted between two checks of the pace (about 0.5 ms of formatting here).
SLICE = 100
# A scrape's per-agent families, built ahead in steps (router/agent_metrics.py reads it).
PREPARED: ContextVar[list[Metric] | None] = ContextVar("prepared_agent_families", default=None)
_EOF = b"# EOF\n"


class Pace:
    """`await pace.step()` often; it checkpoints once `STEP_SECONDS` have passed, and
    calls `settle` first."""

    def __init__(self, settle: Callable[[], None] | None = None) -> None:
        self.since = perf_counter()
        self.settle = settle

    async def step(self) -> None:
        if perf_counter() - self.since >= STEP_SECONDS:
            if self.settle is not None:
                self.settle()
            await trio.lowlevel.checkpoint()
            self.since = perf_counter()


class _Families:
    """A registry-shaped holder of ready families, for prometheus_client's encoders."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def _slices(family: Metric) -> list[Metric]:
    """`family` in pieces of `SLICE` samples (one per agent's series): formatting 1,000
    samples in one go takes 5 ms or more here."""
    if len(family.samples) <= SLICE or not _sliceable(family):
        return [family]
    pieces = []
    for start in range(0, len(family.samples), SLICE):
        piece = copy.copy(family)
        piece.samples = family.samples[start : start + SLICE]
        pieces.append(piece)
    return pieces


def _sliceable(family: Metric) -> bool:
    """The text format writes a family's `_created` (and a gauge histogram's `_gsum`,
    `_gcount`) samples after the rest, as a family of their own: such a family is
    formatted whole. The agents' gauges and counters have none."""
    if family.type in ("histogram", "gaugehistogram", "summary"):
        return False
    return not any(s.name.endswith(("_created", "_gsum", "_gcount")) for s in family.samples)


def _without_header(part: bytes) -> bytes:
    """A family's later piece without the `# HELP`/`# TYPE`/`# UNIT` lines its first one
    has: a sample line never starts with `#`."""
    while part.startswith(b"#"):
        part = part[part.index(b"\n") + 1 :]
    return part


def _header(scope: dict, name: str) -> str:
    return ",".join(
        value.decode("latin-1") for key, value in scope["headers"] if key.decode().lower() == name
    )


def metrics_page(
    registry: CollectorRegistry, agents: Any, settle: Callable[[], None] | None = None
) -> Any:
    """The ASGI app; `agents` has `async prepare(pace) -> list[Metric]` (AgentCollector).

    `settle` runs before each checkpoint: the router's `Freezer.freeze`. A page holds
    about 30,000 samples for 1,000 agents until it is sent, objects that die by their
    reference count; frozen as they are built, no collector pass walks them (a pass
    during a scrape walked up to 20,000 of them, 5 to 7 ms of one turn)."""
    whole = make_asgi_app(registry)

    async def app(scope: dict, receive: Any, send: Any) -> None:
        params = parse_qs(scope.get("query_string", b"").decode("utf-8"))
        if "name[]" in params:  # a selection: small, prometheus_client's own
            await whole(scope, receive, send)
            return
        encoder, content_type = choose_encoder(_header(scope, "accept"))
        pace = Pace(settle)
        token = PREPARED.set(await agents.prepare(pace))
        try:
            parts: list[bytes] = []
            for family in registry.collect():
                for i, piece in enumerate(_slices(family)):
                    part = encoder(_Families([piece])).removesuffix(_EOF)
                    parts.append(part if i == 0 else _without_header(part))
                    await pace.step()
        finally:
            PREPARED.reset(token)
        if content_type.startswith("application/openmetrics-text"):
            parts.append(_EOF)
        headers = [(b"content-type", content_type.encode())]
        if gzip_accepted(_header(scope, "accept-encoding")):
            parts = await _gzipped(parts, pace)
            headers.append((b"content-encoding", b"gzip"))
        output = b"".join(parts)
        message = await receive()
        if message.get("type") == "http.request":
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": output})

    return app


async def _gzipped(parts: list[bytes], pace: Pace) -> list[bytes]:
    """One gzip member of `parts`, compressed a part at a time (level 6: a few MB at 9
    would be one long step, for a page a few percent smaller)."""
    z = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: the gzip format
    out = []
    for part in parts:
        out.append(z.compress(part))
        await pace.step()
    out.append(z.flush())
    return out
