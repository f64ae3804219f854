"""A small HTTP/1.1 load generator on raw trio sockets.

httpx costs more CPU per request than the router we measure, so the benchmarks use
keep-alive connections with pre-encoded requests and a minimal response parser.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import trio


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    first_chunk: list[float] = field(default_factory=list)
    chunks: int = 0
    errors: int = 0
    elapsed: float = 0.0

    @property
    def count(self) -> int:
        return len(self.latencies)

    @property
    def rps(self) -> float:
        return self.count / self.elapsed if self.elapsed else 0.0

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict:
        return {
            "requests": self.count,
            "errors": self.errors,
            "rps": round(self.rps, 1),
            "p50_ms": round(self.pct(self.latencies, 0.5) * 1000, 3),
            "p99_ms": round(self.pct(self.latencies, 0.99) * 1000, 3),
            "ttfc_p50_ms": round(self.pct(self.first_chunk, 0.5) * 1000, 3)
            if self.first_chunk
            else None,
            "chunks_per_s": round(self.chunks / self.elapsed, 1) if self.first_chunk else None,
        }


def chat_request(
    host: str,
    port: int,
    model: str,
    stream: bool,
    max_tokens: int,
    headers: dict[str, str] | None = None,
) -> bytes:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "benchmark prompt with a few words"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    ).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n{extra}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Conn:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()
        self.closing = False

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        self.buf += data

    async def read_until(self, marker: bytes) -> bytes:
        while (i := self.buf.find(marker)) < 0:
            await self._fill()
        out = bytes(self.buf[: i + len(marker)])
        del self.buf[: i + len(marker)]
        return out

    async def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def response(self, chunk_times: list[float]) -> int:
        """Read one response; returns its status and notes when each body chunk arrived."""
        head = await self.read_until(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        # Servers end keep-alive connections after a number of requests (Hypercorn: 1,000).
        self.closing = b"connection: close" in lower
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.read_until(b"\r\n")).strip().split(b";")[0], 16)
                if size == 0:
                    await self.read_until(b"\r\n")
                    return status
                await self.read_exact(size + 2)
                chunk_times.append(trio.current_time())
        i = lower.find(b"content-length:")
        length = int(lower[i + 15 : lower.find(b"\r\n", i)].strip()) if i >= 0 else 0
        await self.read_exact(length)
        chunk_times.append(trio.current_time())
        return status


async def run_load(
    host: str,
    port: int,
    request: bytes,
    concurrency: int,
    duration: float,
    stream: bool,
    rate: float = 0.0,
) -> Result:
    """`concurrency` keep-alive clients, each sending its next request when its last
    answer came; `rate` > 0 paces them to that many requests/s in all (each waits for
    the next send time), so rows compared run at one load whatever each costs."""
    result = Result()
    stop_at = trio.current_time() + duration
    interval = 1.0 / rate if rate > 0 else 0.0
    next_send = [trio.current_time()]

    async def worker() -> None:
        conn = _Conn(await trio.open_tcp_stream(host, port))
        try:
            while trio.current_time() < stop_at:
                if conn.closing:
                    await conn.stream.aclose()
                    conn = _Conn(await trio.open_tcp_stream(host, port))
                if interval:
                    at = next_send[0]
                    next_send[0] = at + interval
                    await trio.sleep_until(at)
                started = trio.current_time()
                chunk_times: list[float] = []
                await conn.stream.send_all(request)
                status = await conn.response(chunk_times)
                if status != 200:
                    result.errors += 1
                    continue
                result.latencies.append(trio.current_time() - started)
                if stream:
                    result.chunks += len(chunk_times)
                    result.first_chunk.append(chunk_times[0] - started)
        finally:
            await conn.stream.aclose()

    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    result.elapsed = trio.current_time() - began
    return result


async def null_server(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """The cheapest possible HTTP server: measures the generator's own ceiling."""
    body = b'{"ok":true}'
    reply = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )

    async def handle(stream: trio.SocketStream) -> None:
        conn = _Conn(stream)
        try:
            while True:
                head = await conn.read_until(b"\r\n\r\n")
                lower = head.lower()
                i = lower.find(b"content-length:")
                length = int(lower[i + 15 : lower.find(b"\r\n", i)].strip()) if i >= 0 else 0
                await conn.read_exact(length)
                await stream.send_all(reply)
        except (ConnectionError, trio.BrokenResourceError, trio.ClosedResourceError):
            return

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)
