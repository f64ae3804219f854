"""Traces over OTLP/gRPC (issue 47): router and agent spans of one trace reach a real
OTLP gRPC receiver (grpcio serving opentelemetry-proto's TraceService, started here),
with `OTEL_EXPORTER_OTLP_PROTOCOL=grpc` and with upstream's endpoint form without a
scheme (`host:4317`). The daemons speak gRPC with h2 in trio (protocol/otlp_grpc.py);
grpcio, whose own threads are no trouble in a test process, is only the receiver."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import trio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from protocol.otlp_grpc import GrpcTarget, export, parse_target
from tests.fleet import Fleet, wait_until
from tests.test_traces import CLIENT_TRACEPARENT, TRACE_ID, Collector, _chat


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.got = Collector()
        self.metadata: list[dict[str, str]] = []
        self.refuse = False

    def Export(self, request, context):  # type: ignore[no-untyped-def]  # grpcio's signature
        self.metadata.append(dict(context.invocation_metadata()))
        if self.refuse:
            context.abort(grpc.StatusCode.UNAVAILABLE, "receiver refuses")
        self.got.receive(request.SerializeToString())
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(grace=None)


@pytest.mark.parametrize("form", ["no-scheme", "protocol-grpc"])
def test_router_and_agent_spans_of_one_trace_reach_a_grpc_receiver(
    fleet: Fleet, receiver: tuple[Receiver, int], form: str
) -> None:
    servicer, port = receiver
    if form == "no-scheme":  # upstream's `tempo:4317`
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"127.0.0.1:{port}"}
    else:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_HEADERS": "x-scope-orgid=tenant-a",
        }
    env["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    router = fleet.router(env=env)
    fleet.agent(router, "m1", env=env)
    r = _chat(router, CLIENT_TRACEPARENT)
    assert r.headers["traceparent"].split("-")[1] == TRACE_ID
    got = servicer.got
    wait_until(
        lambda: (
            got.named("hivenet-router", "POST /v1/chat/completions")
            and got.named("hivenet-agent", "agent.forward")
        ),
        what="router and agent spans at the gRPC receiver",
    )
    (root,) = got.named("hivenet-router", "POST /v1/chat/completions")
    (agent_span,) = got.named("hivenet-agent", "agent.forward")
    assert root.trace_id == agent_span.trace_id == TRACE_ID
    (forward,) = [s for s in got.spans if s.service == "hivenet-router" and s.name == "forward"]
    assert agent_span.parent == forward.span_id
    assert "tracing_endpoint_unusable" not in router.log()
    if form == "protocol-grpc":
        assert all(m.get("x-scope-orgid") == "tenant-a" for m in servicer.metadata)
    assert all(m.get("content-type") is None for m in servicer.metadata)  # grpcio strips it


async def test_a_refusing_or_absent_receiver_is_a_problem_not_a_crash(
    receiver: tuple[Receiver, int],
) -> None:
    servicer, port = receiver
    body = trace_service_pb2.ExportTraceServiceRequest().SerializeToString()
    target = GrpcTarget("127.0.0.1", port, tls=False)
    assert await export(target, body, {}, 5.0) is None
    servicer.refuse = True
    problem = await export(target, body, {}, 5.0)
    assert problem is not None and "grpc-status 14" in problem and "refuses" in problem
    # A big batch crosses HTTP/2's 64 KiB flow-control window.
    servicer.refuse = False
    big = trace_service_pb2.ExportTraceServiceRequest()
    resource = big.resource_spans.add()
    attribute = resource.resource.attributes.add()
    attribute.key, attribute.value.string_value = "service.name", "bulk"
    spans = resource.scope_spans.add()
    for i in range(3000):
        span = spans.spans.add()
        span.name = f"span-{i}-" + "x" * 40
        span.trace_id = bytes(16)
        span.span_id = i.to_bytes(8, "big")
    assert len(big.SerializeToString()) > 200_000
    assert await export(target, big.SerializeToString(), {}, 10.0) is None
    assert len(servicer.got.spans) == 3000


async def test_a_listener_that_is_not_grpc_costs_a_problem_within_the_limit() -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async def http1(stream: trio.SocketStream) -> None:
        await stream.receive_some(1024)
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        for handler, expected in ((silent, "no answer within"), (http1, "")):
            listeners = await nursery.start(trio.serve_tcp, handler, 0)
            port = listeners[0].socket.getsockname()[1]
            with trio.fail_after(5):
                problem = await export(GrpcTarget("127.0.0.1", port, False), b"", {}, 1.0)
            assert problem is not None and expected in problem
        nursery.cancel_scope.cancel()
    closed = await export(GrpcTarget("127.0.0.1", 1, False), b"", {}, 1.0)
    assert closed is not None and "Error" in closed


@pytest.mark.parametrize(
    ("endpoint", "target"),
    [
        ("tempo:4317", GrpcTarget("tempo", 4317, False)),
        ("http://tempo:4317/", GrpcTarget("tempo", 4317, False)),
        ("https://tempo.example", GrpcTarget("tempo.example", 4317, True)),
        ("[::1]:4317", GrpcTarget("::1", 4317, False)),
        ("collector", GrpcTarget("collector", 4317, False)),
    ],
)
def test_grpc_endpoints(endpoint: str, target: GrpcTarget) -> None:
    assert parse_target(endpoint) == target


@pytest.mark.parametrize("endpoint", [":4317", "tempo:port", "tempo:70000", "http://"])
def test_bad_grpc_endpoints_are_named(endpoint: str) -> None:
    with pytest.raises(ValueError, match="OTLP gRPC endpoint"):
        parse_target(endpoint)
