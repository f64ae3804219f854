"""The OpenTelemetry tracer behind protocol/tracing.py, imported only when tracing is on.

Spans come from the OpenTelemetry SDK (its sampler from `OTEL_TRACES_SAMPLER`, its
resource from `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`). They are exported by
a trio task, not by the SDK's BatchSpanProcessor, whose worker thread and blocking
`requests` export would be the only thread in either daemon: finished spans wait in a
list (at most `OTEL_BSP_MAX_QUEUE_SIZE`, 2048, beyond which they are dropped and
counted), and every `OTEL_BSP_SCHEDULE_DELAY` (5 s) the task encodes them as OTLP
protobuf (the exporter's own encoder) and POSTs them with httpx to
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/traces`,
with `OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_EXPORTER_OTLP_TIMEOUT`. With
`OTEL_EXPORTER_OTLP_PROTOCOL=grpc`, or an endpoint without a scheme (`tempo:4317`, as
upstream's compose file has it), the same batch goes as one OTLP/gRPC call instead
(protocol/otlp_grpc.py, HTTP/2 with `h2` in the same trio task). A collector that is
down costs one warning per outage and the spans of that batch, never a request.
"""

from __future__ import annotations

import logging
import math
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

import httpx
import trio
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from protocol.logs import quote
from protocol.otlp_grpc import GrpcTarget, parse_target
from protocol.otlp_grpc import export as export_grpc
from protocol.tracing import Attribute, Span, valid_traceparent

log = logging.getLogger("otel")

_PROPAGATOR = TraceContextTextMapPropagator()


def _ignored(name: str, value: str, reason: str) -> None:
    # As the OpenTelemetry specification asks of an SDK: a value it cannot use is
    # named and left out, and tracing goes on with the default.
    log.warning(
        "tracing_setting_ignored name=%s value=%s reason=%s", name, quote(value), quote(reason)
    )


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        # An infinite delay would never export, an infinite queue never drop.
        _ignored(name, text, f"not a positive number: {default:g} used")
        return default
    return value


# RFC 9110 5.1 and 5.5: what httpx can send as a field name and value; anything else
# would fail each export, and a character beyond ASCII would raise out of the task.
_FIELD_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_FIELD_VALUE = re.compile(r"[\x20-\x7e\t]*")


def _headers(name: str, text: str) -> dict[str, str]:
    """`OTEL_EXPORTER_OTLP_HEADERS`: `k=v,k2=v2`, percent-encoded values."""
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), urllib.parse.unquote(value.strip())
        if not sep or not key:
            continue
        if _FIELD_NAME.fullmatch(key) is None or _FIELD_VALUE.fullmatch(value) is None:
            _ignored(name, key, "not an HTTP field name and value: that header left out")
            continue
        out[key.lower()] = value
    return out


GRPC, HTTP_PROTOBUF = "grpc", "http/protobuf"


def traces_protocol(env: Mapping[str, str]) -> str:
    """`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` or `OTEL_EXPORTER_OTLP_PROTOCOL`; without
    either, an endpoint without a scheme (`tempo:4317`, upstream's compose file) is gRPC,
    as upstream's exporter reads it, and a URL is OTLP/HTTP."""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        text = env.get(name, "").strip().lower()
        if text in (GRPC, HTTP_PROTOBUF):
            return text
        if text:
            _ignored(name, text, "grpc or http/protobuf (http/json is not spoken here)")
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )
    return HTTP_PROTOBUF if "://" in endpoint else GRPC


def traces_endpoint(env: Mapping[str, str], protocol: str = HTTP_PROTOBUF) -> str:
    explicit = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if explicit:
        return explicit
    if protocol == GRPC:  # one fixed path: the endpoint is the server's address
        return env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    return env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"


def _usable_endpoint(url: str) -> bool:
    """An http(s) URL not on OTLP's gRPC port."""
    try:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port
    except ValueError:
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.hostname) and port != 4317


class _Finished(SpanProcessor):
    """Holds ended spans for the export task."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.spans: list[ReadableSpan] = []
        self.dropped = 0

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if len(self.spans) < self.limit:
            self.spans.append(span)
        else:
            self.dropped += 1

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class OtelSpan:
    __slots__ = ("_span", "_tracer")

    def __init__(self, tracer: Any, span: Any) -> None:
        self._tracer = tracer
        self._span = span

    def __repr__(self) -> str:
        return f"<OtelSpan {self._span.name} {self.traceparent()}>"

    @property
    def trace_id(self) -> str:
        return format(self._span.get_span_context().trace_id, "032x")

    def __enter__(self) -> OtelSpan:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self._span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        self._span.end()

    def set(self, key: str, value: Attribute) -> None:
        self._span.set_attribute(key, value)

    def fail(self, message: str) -> None:
        self._span.set_status(Status(StatusCode.ERROR, message))

    def child(self, name: str, attributes: Mapping[str, Attribute] | None = None) -> Span:
        context = set_span_in_context(self._span)
        span = self._tracer.start_span(name, context=context, attributes=attributes)
        return OtelSpan(self._tracer, span)

    def traceparent(self) -> str | None:
        ctx = self._span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class OtelTracer:
    enabled = True

    def __init__(self, service: str, env: Mapping[str, str]) -> None:
        attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service}
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.finished = _Finished(int(_number(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)))
        self.provider.add_span_processor(self.finished)
        self.tracer = self.provider.get_tracer("hivenet")
        self.protocol = traces_protocol(env)
        self.endpoint = traces_endpoint(env, self.protocol)
        self.headers = {
            "content-type": "application/x-protobuf",
            **_headers("OTEL_EXPORTER_OTLP_HEADERS", env.get("OTEL_EXPORTER_OTLP_HEADERS", "")),
            **_headers(
                "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS", ""),
            ),
        }
        self.interval = _number(env, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self.batch = int(_number(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512))
        self.timeout = _number(env, "OTEL_EXPORTER_OTLP_TIMEOUT", 10000) / 1000
        self._failing = False
        self.grpc_target: GrpcTarget | None = None
        log.info(
            "tracing_enabled endpoint=%s protocol=%s service=%s",
            quote(self.endpoint),
            self.protocol,
            quote(service),
        )
        if self.protocol == GRPC:
            self.grpc_headers = {k: v for k, v in self.headers.items() if k != "content-type"}
            try:
                self.grpc_target = parse_target(self.endpoint)
            except ValueError as exc:
                log.warning(
                    "tracing_endpoint_unusable endpoint=%s reason=%s",
                    quote(self.endpoint),
                    quote(str(exc)),
                )
        elif not _usable_endpoint(self.endpoint):
            log.warning(
                "tracing_endpoint_unusable endpoint=%s reason=%s",
                quote(self.endpoint),
                quote(
                    "OTLP/HTTP needs http(s)://host:4318; for gRPC (port 4317) set"
                    " OTEL_EXPORTER_OTLP_PROTOCOL=grpc or give host:4317 without a scheme"
                ),
            )

    def __repr__(self) -> str:
        return f"<OtelTracer {self.endpoint}, {len(self.finished.spans)} spans waiting>"

    def root(
        self,
        name: str,
        traceparent: str | None = None,
        attributes: Mapping[str, Attribute] | None = None,
    ) -> Span:
        parent = valid_traceparent(traceparent)
        context = _PROPAGATOR.extract({"traceparent": parent}) if parent else None
        span = self.tracer.start_span(
            name, context=context, kind=SpanKind.SERVER, attributes=attributes
        )
        return OtelSpan(self.tracer, span)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout, trust_env=False) as client:
            while True:
                await trio.sleep(self.interval)
                await self._export(client)

    async def flush(self) -> None:
        with trio.move_on_after(self.timeout):
            async with httpx.AsyncClient(timeout=self.timeout, trust_env=False) as client:
                await self._export(client)

    async def _export(self, client: httpx.AsyncClient) -> None:
        while self.finished.spans:
            spans = self.finished.spans[: self.batch]
            del self.finished.spans[: self.batch]
            body = encode_spans(spans).SerializeToString()
            if self.protocol == GRPC:
                problem = await self._export_grpc(body)
            else:
                problem = await self._export_http(client, body)
            if problem is not None:
                if not self._failing:
                    log.warning(
                        "trace_export_failed endpoint=%s spans=%d reason=%s",
                        quote(self.endpoint),
                        len(spans),
                        quote(problem),
                    )
                self._failing = True
                return
            if self._failing:
                log.info("trace_export_recovered endpoint=%s", quote(self.endpoint))
            self._failing = False

    async def _export_http(self, client: httpx.AsyncClient, body: bytes) -> str | None:
        try:
            r = await client.post(self.endpoint, content=body, headers=self.headers)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            # InvalidURL: an endpoint httpx cannot parse, named at startup.
            return repr(exc)
        return None if r.status_code < 300 else f"collector answered {r.status_code}"

    async def _export_grpc(self, body: bytes) -> str | None:
        if self.grpc_target is None:
            return "no usable gRPC endpoint (named at startup)"
        return await export_grpc(self.grpc_target, body, self.grpc_headers, self.timeout)
