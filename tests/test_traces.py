"""OpenTelemetry traces from real router and agent processes, received by a local OTLP/HTTP
collector (a small HTTP server here, decoding with `opentelemetry-proto`), and what
the daemons do with trace context when tracing is off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.fleet import Fleet, Router, inference_audit_lines, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@dataclass
class Collected:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    attributes: dict[str, Any]
    error: bool


@dataclass
class Collector:
    """OTLP/HTTP protobuf receiver on loopback: POST /v1/traces."""

    spans: list[Collected] = field(default_factory=list)
    content_types: set[str] = field(default_factory=set)

    def receive(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service = next(
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            )
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    attributes = {
                        a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes
                    }
                    self.spans.append(
                        Collected(
                            service,
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            attributes,
                            s.status.code == 2,
                        )
                    )

    def named(self, service: str, name: str) -> list[Collected]:
        return [s for s in self.spans if s.service == service and s.name == name]


@dataclass
class FakeEngine:
    """A vLLM-shaped engine that records the `traceparent` of each completion call."""

    traceparents: list[str | None] = field(default_factory=list)


def _serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


@pytest.fixture
def collector() -> Iterator[tuple[Collector, int]]:
    got = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            got.content_types.add(self.headers["content-type"])
            if self.path == "/v1/traces":
                got.receive(body)
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server, port = _serve(Handler)
    yield got, port
    server.shutdown()


@pytest.fixture
def engine() -> Iterator[tuple[FakeEngine, int]]:
    seen = FakeEngine()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, payload: object) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._answer({"object": "list", "data": [{"id": "m1", "object": "model"}]})
            else:
                self._answer({})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            seen.traceparents.append(self.headers.get("traceparent"))
            self._answer(
                {
                    "id": "c1",
                    "object": "chat.completion",
                    "model": "m1",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "hi"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }
            )

        def log_message(self, *args: object) -> None:
            pass

    server, port = _serve(Handler)
    yield seen, port
    server.shutdown()


def _otel_env(port: int) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }


def _chat(router: Router, traceparent: str | None) -> httpx.Response:
    headers = {"traceparent": traceparent} if traceparent else {}
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hello"}]},
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r


def test_one_trace_across_router_agent_and_engine(
    fleet: Fleet,
    tmp_path: Path,
    collector: tuple[Collector, int],
    engine: tuple[FakeEngine, int],
) -> None:
    got, port = collector
    seen, engine_port = engine
    env = _otel_env(port)
    audit = tmp_path / "audit.log"
    router = fleet.router("--audit-log", str(audit), env=env)
    backend = ["--backend-url", f"http://127.0.0.1:{engine_port}"]
    fleet.agent(router, "m1", *backend, env=env, engine="vllm")

    r = _chat(router, CLIENT_TRACEPARENT)
    rid = r.headers["x-request-id"]
    answer_trace = r.headers["traceparent"].split("-")
    assert answer_trace[1] == TRACE_ID

    wait_until(
        lambda: got.named("hivenet-agent", "agent.forward"), what="the agent's span exported"
    )
    wait_until(
        lambda: got.named("hivenet-router", "POST /v1/chat/completions"),
        what="the router's root span exported",
    )
    assert got.content_types == {"application/x-protobuf"}
    (root,) = got.named("hivenet-router", "POST /v1/chat/completions")
    (admission,) = got.named("hivenet-router", "admission")
    (route,) = got.named("hivenet-router", "route")
    (step,) = got.named("hivenet-router", "step")
    (attempt,) = got.named("hivenet-router", "try")
    (forward,) = got.named("hivenet-router", "forward")
    (agent_span,) = got.named("hivenet-agent", "agent.forward")
    assert {s.trace_id for s in got.spans} == {TRACE_ID}
    # The tree: client → router root → admission, route → step → try → forward →
    # agent → engine.
    assert root.parent == CLIENT_SPAN
    assert answer_trace[2] == root.span_id
    assert admission.parent == root.span_id
    assert route.parent == root.span_id
    assert step.parent == route.span_id
    assert attempt.parent == step.span_id
    assert forward.parent == attempt.span_id
    assert agent_span.parent == forward.span_id
    assert seen.traceparents == [f"00-{TRACE_ID}-{agent_span.span_id}-01"]

    assert root.attributes["hivenet.request_id"] == rid
    assert root.attributes["http.response.status_code"] == 200
    assert agent_span.attributes["hivenet.request_id"] == rid
    assert forward.attributes["hivenet.peer_id"] == route.attributes["hivenet.peer_id"]
    assert not any(s.error for s in got.spans)

    line = router.wait_log(rf"req={rid} method=.*")
    assert f"trace_id={TRACE_ID}" in line.group(0)
    (record,) = inference_audit_lines(audit)
    assert record["trace_id"] == TRACE_ID


def test_a_bad_client_traceparent_starts_a_new_trace(
    fleet: Fleet, collector: tuple[Collector, int]
) -> None:
    got, port = collector
    router = fleet.router(env=_otel_env(port))
    fleet.agent(router, "m1", env=_otel_env(port))
    for bad in ("garbage", f"00-{'0' * 32}-{CLIENT_SPAN}-01", "00-" + "g" * 32 + "-" + "1" * 16):
        r = _chat(router, bad)
        trace_id = r.headers["traceparent"].split("-")[1]
        assert trace_id not in (TRACE_ID, "0" * 32)
    roots = wait_until(
        lambda: len(s := got.named("hivenet-router", "POST /v1/chat/completions")) == 3 and s,
        what="three root spans",
    )
    assert all(s.parent == "" for s in roots)


def test_tracing_off_passes_the_client_context_to_the_engine(
    fleet: Fleet, tmp_path: Path, engine: tuple[FakeEngine, int]
) -> None:
    seen, engine_port = engine
    router = fleet.router("--audit-log", str(tmp_path / "audit.log"))
    backend = ["--backend-url", f"http://127.0.0.1:{engine_port}"]
    fleet.agent(router, "m1", *backend, engine="vllm")
    r = _chat(router, CLIENT_TRACEPARENT)
    _chat(router, "not a traceparent")
    assert "traceparent" not in r.headers
    assert seen.traceparents == [CLIENT_TRACEPARENT, None]
    assert "trace_id=" not in router.log()
    record = inference_audit_lines(tmp_path / "audit.log")[0]
    assert record["trace_id"] == ""  # upstream: a string, never null


def test_a_collector_that_is_down_costs_no_request(fleet: Fleet) -> None:
    from tests.fleet import free_port

    env = _otel_env(free_port())  # nothing listens there
    router = fleet.router(env=env)
    fleet.agent(router, "m1", env=env)
    for _ in range(3):
        _chat(router, None)
    router.wait_log("trace_export_failed")
    _chat(router, None)
    assert router.log().count("trace_export_failed") == 1
    assert router.alive()


def test_off_by_default_opentelemetry_is_never_imported(tmp_path: Path) -> None:
    """The daemons built as `serve` builds them, a request's hooks run: neither the tracer
    nor OpenTelemetry's trace SDK or exporter is loaded. (redis-py imports OpenTelemetry's
    metrics API on its own wherever OpenTelemetry is installed; that is not tracing.)"""
    code = f"""
import sys
from agent.app import AgentDaemon
from agent.settings import AgentSettings
from router.app import RouterDaemon
from router.settings import RouterSettings
from protocol.tracing import NO_TRACER
d = {str(tmp_path)!r}
router = RouterDaemon(RouterSettings(identity_path=d + "/r.key"))
agent = AgentDaemon(AgentSettings(routers=[], model="m1", identity_path=d + "/a.key", engine="sim"))
assert router.tracer is NO_TRACER and agent.tracer is NO_TRACER
with router.tracer.root("x") as span, span.child("y") as child:
    assert child.traceparent() is None
ours = ("protocol.otel", "opentelemetry.sdk.trace", "opentelemetry.exporter")
loaded = sorted(m for m in sys.modules if m.startswith(ours))
assert not loaded, loaded
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _traces(got: Collector, count: int) -> list[list[Collected]]:
    """The router's spans grouped by trace, once `count` root spans arrived."""
    roots = wait_until(
        lambda: len(r := got.named("hivenet-router", "POST /v1/chat/completions")) >= count and r,
        what=f"{count} traces",
    )
    return [[s for s in got.spans if s.trace_id == root.trace_id] for root in roots]


def _one(spans: list[Collected], name: str, parent: Collected) -> Collected:
    (span,) = [s for s in spans if s.name == name and s.parent == parent.span_id]
    return span


def test_a_failed_try_and_the_next_are_spans_of_their_step(
    fleet: Fleet, collector: tuple[Collector, int]
) -> None:
    got, port = collector
    env = _otel_env(port)
    router = fleet.router(env=env)
    agents = [fleet.agent(router, "m1", env=env, wait=False) for _ in range(2)]
    fleet.join(*agents)
    # Idle agents tie, and ties go to the lowest peer id: that one fails first.
    first, second = sorted(agents, key=lambda a: a.peer_id)
    first.sim_state(fail_count=1, fail_status=500)
    _chat(router, None)
    (spans,) = _traces(got, 1)
    (root,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    route = _one(spans, "route", root)
    step = _one(spans, "step", route)
    assert step.attributes["hivenet.step"] == "routing_policy"
    tries = sorted((s for s in spans if s.name == "try"), key=lambda s: s.error, reverse=True)
    assert [t.parent for t in tries] == [step.span_id] * 2
    failed, served = tries
    assert (failed.error, served.error) == (True, False)
    assert failed.attributes["hivenet.peer_id"] == first.peer_id
    assert served.attributes["hivenet.peer_id"] == second.peer_id
    assert _one(spans, "forward", served).attributes["hivenet.peer_id"] == second.peer_id


def test_a_wait_in_the_capacity_queue_is_a_span(
    fleet: Fleet, collector: tuple[Collector, int]
) -> None:
    got, port = collector
    env = _otel_env(port)
    router = fleet.router(env=env)
    agent = fleet.agent(router, "m1", "--capacity", "1", "--sim-token-latency", "100ms", env=env)

    def four_seconds() -> None:
        # 40 tokens at 100 ms each (the sim's ignore_eos, as vLLM's, runs to max_tokens).
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json={
                "model": "m1",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 40,
                "ignore_eos": True,
            },
            timeout=30,
        )
        assert r.status_code == 200, r.text

    long = threading.Thread(target=four_seconds)
    long.start()
    wait_until(
        lambda: router.agent(agent.peer_id)["status"]["active_requests"] == 1,
        what="the agent busy",
    )
    _chat(router, None)
    long.join()
    _traces(got, 2)
    waits = [s for s in got.spans if s.name == "queue_wait"]
    (queued,) = waits
    (step,) = [s for s in got.spans if s.span_id == queued.parent]
    assert step.name == "step"
    assert not queued.error


def test_a_shed_request_is_a_failed_shed_span(
    fleet: Fleet, tmp_path: Path, collector: tuple[Collector, int]
) -> None:
    got, port = collector
    env = _otel_env(port)
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "routing_policy:\n  strategy: least-loaded\n"
        "  shed_if:\n    total_queue_depth: {gte: 0}\n    retry_after: 1\n"
    )
    router = fleet.router("--policy-file", str(policy), env=env)
    fleet.agent(router, "m1", env=env)
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hello"}]},
        timeout=30,
    )
    assert r.status_code == 503 and r.json()["error"]["code"] == "load_shed"
    (spans,) = _traces(got, 1)
    (root,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    route = _one(spans, "route", root)
    shed = _one(spans, "shed", route)
    assert shed.attributes["hivenet.step"] == "routing_policy"
    assert shed.error and route.error and root.error
    assert root.attributes["http.response.status_code"] == 503
    assert not [s for s in spans if s.name in ("step", "try", "forward")]


@pytest.mark.parametrize(
    ("endpoint", "usable"),
    [
        ("http://collector:4318", True),
        ("https://collector.example/otlp", True),
        ("tempo:4317", True),  # upstream's form: gRPC (tests/test_traces_grpc.py)
        ("http://tempo:4317", False),  # OTLP/HTTP on gRPC's port: said
        ("collector", True),  # gRPC on 4317
    ],
)
def test_an_endpoint_this_exporter_cannot_use_is_said_at_startup(
    endpoint: str, usable: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from protocol.otel import OtelTracer

    caplog.set_level("WARNING", logger="otel")
    OtelTracer("hivenet-router", {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    warned = [
        r.getMessage() for r in caplog.records if "tracing_endpoint_unusable" in r.getMessage()
    ]
    assert bool(warned) is not usable, warned


async def test_otel_values_that_cannot_be_used_are_named_and_left_out(
    collector: tuple[Collector, int], caplog: pytest.LogCaptureFixture
) -> None:
    """Each is a warning naming the variable and its default, at startup; none stops the
    daemon then or its export task later (a header beyond ASCII raised out of it)."""
    from protocol.otel import OtelTracer

    got, port = collector
    caplog.set_level("WARNING", logger="otel")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=a%20b,x-bad=%C3%A9,x-nl=a%0Ab",
        "OTEL_BSP_MAX_QUEUE_SIZE": "inf",
        "OTEL_BSP_SCHEDULE_DELAY": "soon",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "-1",
    }
    tracer = OtelTracer("hivenet-router", env)
    assert (tracer.finished.limit, tracer.interval, tracer.timeout) == (2048, 5.0, 10.0)
    assert tracer.headers["x-tenant"] == "a b"
    assert "x-bad" not in tracer.headers and "x-nl" not in tracer.headers
    ignored = " ".join(r.getMessage() for r in caplog.records)
    for name in (
        "OTEL_BSP_MAX_QUEUE_SIZE",
        "OTEL_BSP_SCHEDULE_DELAY",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "OTEL_EXPORTER_OTLP_HEADERS",
    ):
        assert f"tracing_setting_ignored name={name}" in ignored
    with tracer.root("exported"):
        pass
    await tracer.flush()
    assert [s.name for s in got.spans] == ["exported"]


async def test_an_endpoint_that_is_no_url_is_said_and_costs_no_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from protocol.otel import OtelTracer

    caplog.set_level("WARNING", logger="otel")
    tracer = OtelTracer("hivenet-router", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1"})
    with tracer.root("lost"):
        pass
    await tracer.flush()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "tracing_endpoint_unusable" in said and "trace_export_failed" in said
