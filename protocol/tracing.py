"""Request traces: the hooks both daemons call, and what they cost when tracing is off.

Tracing is on when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`
is set, unless `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Then
`tracer_from_env` builds protocol/otel.py's tracer, the only module that imports
OpenTelemetry. Off, it returns NO_TRACER: every span it makes is the one NULL_SPAN,
whose methods do nothing and whose `child` returns itself, so a hook on the request
path is one attribute call and no allocation, and OpenTelemetry is never imported.

Spans are passed explicitly (a request's root span rides on its RouteRequest; a child
is made from its parent), not through a context variable: a request's work crosses
tasks and the link, and the parent of each span is then plain to read.

W3C trace context: `traceparent` is `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`;
the router accepts it from clients, sends it across the link in the request frame and
on the response; the agent sends it to the engine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Protocol

Attribute = str | int | float | bool

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def valid_traceparent(value: str | None) -> str | None:
    """`value` when it is a W3C version-00 traceparent with non-zero ids, else None."""
    if value is None:
        return None
    m = TRACEPARENT.fullmatch(value.strip())
    if m is None or m.group(1) == "0" * 32 or m.group(2) == "0" * 16:
        return None
    return m.group(0)


class Span(Protocol):
    """One timed operation. Used as a context manager: it ends on exit, an exception
    marks it failed."""

    @property
    def trace_id(self) -> str:
        """32 hex digits; empty when not traced."""
        ...

    def __enter__(self) -> Span: ...

    def __exit__(self, *exc: object) -> None: ...

    def set(self, key: str, value: Attribute) -> None: ...

    def fail(self, message: str) -> None:
        """The operation failed (an error status with `message`)."""

    def child(self, name: str, attributes: Mapping[str, Attribute] | None = None) -> Span: ...

    def traceparent(self) -> str | None:
        """This span as a W3C traceparent, for the next hop; None when not traced."""


class Tracer(Protocol):
    enabled: bool

    def root(
        self,
        name: str,
        traceparent: str | None = None,
        attributes: Mapping[str, Attribute] | None = None,
    ) -> Span:
        """A request's first span here: a child of `traceparent` when one came in."""

    async def run(self) -> None:
        """Export finished spans until cancelled (started only when enabled)."""

    async def flush(self) -> None:
        """Export what is left (on shutdown)."""


class _NullSpan:
    __slots__ = ()
    trace_id = ""

    def __repr__(self) -> str:
        return "<NULL_SPAN>"

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set(self, key: str, value: Attribute) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def child(self, name: str, attributes: Mapping[str, Attribute] | None = None) -> _NullSpan:
        return self

    def traceparent(self) -> str | None:
        return None


NULL_SPAN: Span = _NullSpan()


class _NoTracer:
    enabled = False

    def __repr__(self) -> str:
        return "<NO_TRACER>"

    def root(
        self,
        name: str,
        traceparent: str | None = None,
        attributes: Mapping[str, Attribute] | None = None,
    ) -> Span:
        return NULL_SPAN

    async def run(self) -> None:
        return None

    async def flush(self) -> None:
        return None


NO_TRACER: Tracer = _NoTracer()


def tracing_enabled(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def tracer_from_env(service: str, env: Mapping[str, str] | None = None) -> Tracer:
    """NO_TRACER, or an OTLP (HTTP or gRPC) exporting tracer for `service`
    (OTEL_SERVICE_NAME wins)."""
    e = os.environ if env is None else env
    if not tracing_enabled(e):
        return NO_TRACER
    from protocol.otel import OtelTracer  # only here: off, OpenTelemetry is never loaded

    return OtelTracer(service, e)
