"""Dial the router's WebSocket listener through an HTTP proxy (`CONNECT`).

Some GPU hosts may reach the outside only through their network's HTTP proxy. An HTTP
proxy tunnels any TCP connection after `CONNECT host:port`, so the agent opens that
tunnel and runs the same WebSocket (and, for `/wss`, TLS) handshake over it that it
runs on a direct connection; Noise and the link ride inside unchanged.

py-libp2p 0.8.1 reads `HTTP(S)_PROXY` itself but only knows SOCKS proxies, and its
SOCKS dialer is a stub that always fails, so we replace its WebSocket dial on the
agent's host (the same kind of version-pinned patch as protocol/p2p.py).
"""

from __future__ import annotations

import base64
import functools
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import trio
from libp2p.transport.websocket.connection import P2PWebSocketConnection
from libp2p.transport.websocket.multiaddr_utils import ParsedWebSocketMultiaddr
from libp2p.transport.websocket.proxy_env import get_proxy_from_environment
from libp2p.transport.websocket.transport import WebsocketTransport
from libp2p.utils.multiaddr_utils import extract_host_from_multiaddr, format_host_for_url
from trio_websocket import wrap_client_stream

# A proxy's answer to CONNECT is a status line and a few headers; squid and tinyproxy
# send under 300 bytes. Anything longer is not a proxy we can talk to.
MAX_ANSWER_BYTES = 16 * 1024


class ProxyError(Exception):
    """The proxy could not be reached or refused the tunnel; the message says which."""


@dataclass(frozen=True)
class HttpProxy:
    host: str
    port: int
    authorization: str | None = None

    def __str__(self) -> str:
        return f"http://{format_host_for_url(self.host)}:{self.port}"


def parse_proxy_url(url: str) -> HttpProxy:
    """`http://[user:password@]host[:port]`; ValueError says what is wrong."""
    parts = urlsplit(url.strip())
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(
            f"proxy {url!r} is not an HTTP proxy URL (http://host:port, "
            "optionally http://user:password@host:port)"
        )
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise ValueError(f"proxy {url!r}: {exc}") from None
    authorization = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(pair.encode()).decode()
    return HttpProxy(parts.hostname, port, authorization)


def connect_request(target_host: str, target_port: int, proxy: HttpProxy) -> bytes:
    authority = f"{format_host_for_url(target_host)}:{target_port}"
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if proxy.authorization:
        lines.append(f"Proxy-Authorization: {proxy.authorization}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def check_connect_answer(answer: bytes, proxy: HttpProxy, target: str) -> None:
    """A 2xx status line opens the tunnel; any other answer is the proxy's refusal."""
    status_line = answer.split(b"\r\n", 1)[0].decode("latin-1", "replace")
    fields = status_line.split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/1.") or not fields[1].isdigit():
        raise ProxyError(f"proxy {proxy} answered CONNECT {target} with {status_line[:80]!r}")
    if not 200 <= int(fields[1]) < 300:
        raise ProxyError(f"proxy {proxy} refused CONNECT {target}: {status_line[:120]}")


async def open_tunnel(proxy: HttpProxy, host: str, port: int) -> trio.SocketStream:
    """A TCP stream to host:port through the proxy, ready for the first byte."""
    target = f"{format_host_for_url(host)}:{port}"
    try:
        stream = await trio.open_tcp_stream(proxy.host, proxy.port)
    except OSError as exc:
        raise ProxyError(f"proxy {proxy} unreachable: {exc}") from exc
    try:
        await stream.send_all(connect_request(host, port, proxy))
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = await stream.receive_some(MAX_ANSWER_BYTES)
            if not data:
                raise ProxyError(f"proxy {proxy} closed the connection during CONNECT {target}")
            answer += data
            if len(answer) > MAX_ANSWER_BYTES:
                raise ProxyError(f"proxy {proxy} sent over {MAX_ANSWER_BYTES} bytes to CONNECT")
        head, _, early = answer.partition(b"\r\n\r\n")
        check_connect_answer(head, proxy, target)
        # The agent speaks first in both WebSocket and TLS: a tunnel that talks before
        # it is spoken to is not a tunnel to our router.
        if early:
            raise ProxyError(f"proxy {proxy} sent data before the tunnel to {target} was used")
    except BaseException:
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(stream)
        raise
    return stream


def proxy_from_environment(scheme: str, host: str, port: int) -> HttpProxy | None:
    """HTTPS_PROXY for `wss`, HTTP_PROXY for `ws` (or their lower-case names), unless
    NO_PROXY names the host. A value without a scheme is an HTTP proxy's address, as
    curl, wget and pip take it (`HTTP_PROXY=proxy.corp:3128` is common); ValueError
    says what is wrong with any other."""
    url = get_proxy_from_environment(f"{scheme}://{format_host_for_url(host)}:{port}/")
    if url is None:
        return None
    return parse_proxy_url(url if "://" in url else f"http://{url}")


async def _create_connection(
    original: Any,
    explicit: HttpProxy | None,
    self: WebsocketTransport,
    proto_info: ParsedWebSocketMultiaddr,
    proxy_url: str | None = None,
) -> P2PWebSocketConnection:
    """WebsocketTransport._create_connection with an HTTP proxy in the path."""
    host = extract_host_from_multiaddr(proto_info.rest_multiaddr) or "localhost"
    port = int(proto_info.rest_multiaddr.value_for_protocol("tcp") or "80")
    scheme = "wss" if proto_info.is_wss else "ws"
    proxy = explicit or proxy_from_environment(scheme, host, port)
    if proxy is None:
        return await original(proto_info, proxy_url)
    if self._background_nursery is None:
        raise ProxyError("the WebSocket transport has no background nursery yet")
    with trio.fail_after(self._config.handshake_timeout):
        stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
        stream = await open_tunnel(proxy, host, port)
        try:
            if proto_info.is_wss:
                # The router's certificate is checked as on a direct dial: the system's
                # trust store, or SSL_CERT_FILE; the proxy sees only ciphertext.
                stream = trio.SSLStream(
                    stream,
                    self._default_client_ssl_context(),
                    server_hostname=host,
                    https_compatible=True,
                )
                await stream.do_handshake()
            host_header = host if port in (80, 443) else f"{format_host_for_url(host)}:{port}"
            ws = await wrap_client_stream(
                self._background_nursery,
                stream,
                host_header,
                "/",
                message_queue_size=1024,
                max_message_size=self._config.max_message_size,
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
            raise
    conn = P2PWebSocketConnection(
        ws,
        None,
        is_secure=proto_info.is_wss,
        max_buffered_amount=self._config.max_buffered_amount,
    )
    await self._track_connection(conn)
    return conn


def dial_through_http_proxy(host: Any, proxy_url: str | None) -> int:
    """Make the host's WebSocket dials use `proxy_url`, or else HTTPS_PROXY (for /wss)
    and HTTP_PROXY (for /ws) with NO_PROXY, as curl does. Returns how many transports
    were changed (0: the host has no WebSocket transport)."""
    explicit = parse_proxy_url(proxy_url) if proxy_url else None
    changed = 0
    for transport in host.get_network().transport_manager.get_transports():
        if isinstance(transport, WebsocketTransport):
            original = transport._create_connection
            transport._create_connection = functools.partial(  # type: ignore[method-assign]
                _create_connection, original, explicit, transport
            )
            changed += 1
    return changed
