"""OTLP over gRPC for protocol/otel.py: one unary `TraceService/Export` call per batch,
spoken with the `h2` library on a trio TCP stream.

Why not grpcio, the usual client: it runs its own C-core threads and completion queue,
and a call from trio would block the daemon's one thread unless moved to a worker thread
(`trio.to_thread`) for each export; its channel also keeps background threads alive for
the life of the process, the only threads either daemon would have. A unary gRPC call is
small enough to write here: an HTTP/2 POST of one length-prefixed protobuf message to
`/opentelemetry.proto.collector.trace.v1.TraceService/Export`, whose outcome is the
`grpc-status` in the trailers (or in the headers of a trailers-only answer). `h2` is a
pure protocol state machine (no I/O), the shape protocol/frames.py has: the bytes move
in this module's trio code, so the export is one more trio task and cancel scopes bound
it. A connection is opened per batch (one every `OTEL_BSP_SCHEDULE_DELAY`, 5 s), so no
connection state outlives an export.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import trio

PATH = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
# An answer bigger than this is not an ExportTraceServiceResponse (a few bytes, or a
# partial-success message): the call is ended rather than read on.
MAX_ANSWER_BYTES = 1 << 20
_READ = 65536


@dataclass(frozen=True)
class GrpcTarget:
    host: str
    port: int
    tls: bool

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_target(endpoint: str) -> GrpcTarget:
    """`tempo:4317`, `http://tempo:4317` (plaintext) or `https://tempo:4317` (TLS); a
    path after the port is ignored, as OTLP/gRPC has one fixed path. ValueError names
    what is wrong."""
    text = endpoint.strip()
    tls = text.startswith("https://")
    for scheme in ("https://", "http://", "grpc://"):
        if text.startswith(scheme):
            text = text[len(scheme) :]
            break
    text = text.split("/", 1)[0]
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError(f"OTLP gRPC endpoint {endpoint!r} names no host")
    try:
        port = int(port_text) if port_text else 4317
    except ValueError:
        raise ValueError(f"OTLP gRPC endpoint {endpoint!r}: port {port_text!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"OTLP gRPC endpoint {endpoint!r}: port {port} out of range")
    return GrpcTarget(host, port, tls)


def grpc_message(body: bytes) -> bytes:
    """gRPC's length-prefixed message: not compressed (0), 4-byte big-endian length."""
    return b"\x00" + len(body).to_bytes(4, "big") + body


async def export(
    target: GrpcTarget, body: bytes, headers: dict[str, str], limit_s: float
) -> str | None:
    """Send one ExportTraceServiceRequest; None when the collector took it, else what
    went wrong (for the caller's one warning per outage). `limit_s` bounds the whole
    call, connection included, and is told to the collector as `grpc-timeout`."""
    with trio.move_on_after(limit_s) as scope:
        try:
            return await _call(target, body, headers, limit_s)
        except (OSError, trio.BrokenResourceError, ssl.SSLError) as exc:
            return f"{type(exc).__name__}: {exc}"
        except h2.exceptions.H2Error as exc:
            return f"HTTP/2 error: {exc!r}"
    assert scope.cancelled_caught
    return f"no answer within {limit_s:g}s"


async def _call(
    target: GrpcTarget, body: bytes, headers: dict[str, str], limit_s: float
) -> str | None:
    stream: trio.abc.Stream = await trio.open_tcp_stream(target.host, target.port)
    if target.tls:
        context = ssl.create_default_context()
        context.set_alpn_protocols(["h2"])
        stream = trio.SSLStream(stream, context, server_hostname=target.host)
    async with stream:
        conn = h2.connection.H2Connection(
            # Not validated inbound: grpcio's own grpc-message can end in a space, which
            # h2 would take for a protocol error and lose the status it carries.
            h2.config.H2Configuration(
                client_side=True, header_encoding="utf-8", validate_inbound_headers=False
            )
        )
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        request = [
            (":method", "POST"),
            (":scheme", "https" if target.tls else "http"),
            (":path", PATH),
            (":authority", target.authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("grpc-timeout", f"{max(1, int(limit_s * 1000))}m"),
            *((k, v) for k, v in headers.items() if k not in ("content-type", "te")),
        ]
        conn.send_headers(sid, request)
        answer = _Answer()
        pending = grpc_message(body)
        while True:
            # Send what the flow-control windows allow, then read until they open again
            # or the answer is complete.
            while pending:
                room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if room <= 0:
                    break
                chunk, pending = pending[:room], pending[room:]
                conn.send_data(sid, chunk, end_stream=not pending)
            outgoing = conn.data_to_send()
            if outgoing:
                await stream.send_all(outgoing)
            if answer.ended:
                return answer.problem()
            data = await stream.receive_some(_READ)
            if not data:
                return answer.problem() if answer.ended else "collector closed the connection"
            for event in conn.receive_data(data):
                answer.read(event, conn, sid)
            if answer.size > MAX_ANSWER_BYTES:
                return "collector's answer is too large for an export response"


class _Answer:
    """What the collector said on our stream."""

    def __init__(self) -> None:
        self.status: str | None = None  # HTTP :status
        self.grpc_status: str | None = None
        self.grpc_message = ""
        self.ended = False
        self.size = 0

    def read(self, event: h2.events.Event, conn: h2.connection.H2Connection, sid: int) -> None:
        if getattr(event, "stream_id", sid) != sid:
            return
        if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            for name, value in event.headers:
                self._header(name, value)
            if event.stream_ended is not None:
                self.ended = True
        elif isinstance(event, h2.events.DataReceived):
            self.size += len(event.data)
            conn.acknowledge_received_data(event.flow_controlled_length, sid)
            if event.stream_ended is not None:
                self.ended = True
        elif isinstance(event, h2.events.StreamEnded):
            self.ended = True
        elif isinstance(event, h2.events.StreamReset | h2.events.ConnectionTerminated):
            self.ended = True
            self.grpc_status = self.grpc_status or "reset"

    def _header(self, name: str | bytes, value: str | bytes) -> None:
        name = name.decode("latin-1") if isinstance(name, bytes) else name
        value = value.decode("latin-1") if isinstance(value, bytes) else value
        if name == ":status":
            self.status = value
        elif name == "grpc-status":
            self.grpc_status = value
        elif name == "grpc-message":
            self.grpc_message = value[:200]

    def problem(self) -> str | None:
        if self.status != "200":
            return f"collector answered HTTP {self.status}"
        if self.grpc_status == "0":
            return None
        return f"collector answered grpc-status {self.grpc_status} {self.grpc_message}".rstrip()
