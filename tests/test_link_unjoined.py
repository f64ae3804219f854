"""Strangers before their hello, against a real router: a Noise handshake is all they
have passed, so they may hold a hello-sized frame and no more, on a few streams per
connection and per source address (router/unjoined.py)."""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import httpx
import psutil
import pytest
import trio

from protocol import messages as m
from protocol.frames import HELLO_FRAME_BYTES, encode_frame
from protocol.tokens import issue_token
from router.remote_addr import format_endpoint, remote_endpoint
from router.unjoined import Unjoined, UnjoinedLimits, source_of
from tests.fleet import SECRET, Fleet, Router, wait_until
from tests.link_peers import stranger
from tests.test_link import METADATA, first_reply, raw_session

MIB = 1024 * 1024


async def read_until_reset(stream: Any) -> None:
    with trio.fail_after(30), pytest.raises(Exception):  # noqa: B017 - the router resets it
        while True:
            await stream.read(65536)


async def write_quietly(stream: Any, data: bytes) -> None:
    """Write as an attacker does: a refused stream's writes fail, and that is the point."""
    with trio.move_on_after(20), contextlib.suppress(Exception):
        for i in range(0, len(data), 256 * 1024):
            await stream.write(data[i : i + 256 * 1024])


async def agent_joins(router: Router) -> None:
    async with raw_session(router) as (stream, peer_id):
        token = issue_token(SECRET.encode(), peer_id, 60)
        await stream.write(encode_frame(m.hello(token, METADATA)))
        assert (await first_reply(stream))["type"] == m.WELCOME


async def chat(router: Router) -> httpx.Response:
    return await trio.to_thread.run_sync(
        lambda: httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "ok"}]},
            timeout=20,
        )
    )


async def test_a_frame_over_the_hello_bound_is_refused_at_its_length(fleet: Fleet) -> None:
    # Before: a stranger's frame of up to 16 MiB was read and held until the hello
    # timeout ("no hello within 10s"); now its 4-byte length is enough to end it.
    router = fleet.router()
    async with raw_session(router) as (stream, _):
        await stream.write(struct.pack(">I", HELLO_FRAME_BYTES + 1) + b"x" * 1000)
        await read_until_reset(stream)
    async with raw_session(router) as (stream, _):
        # A hello-sized frame is read (and refused for what it holds, not its size).
        await stream.write(struct.pack(">I", HELLO_FRAME_BYTES) + b"\xc1" * HELLO_FRAME_BYTES)
        await read_until_reset(stream)
    log = router.log()
    assert f"oversized frame: {HELLO_FRAME_BYTES + 1} bytes > limit {HELLO_FRAME_BYTES}" in log
    assert "malformed frame" in log
    assert "no hello within" not in log
    # A joined agent is trusted with large frames (a 10 MiB request body needs them).
    await agent_joins(router)


async def open_and_write(open_stream: Any, nursery: trio.Nursery, data: bytes) -> None:
    """One more stream with `data` written on it; a stream the router resets at once
    may fail already while it is being opened."""
    try:
        stream = await open_stream()
    except Exception:  # refused: what the test counts is the router's log
        return
    nursery.start_soon(write_quietly, stream, data)


def wait_log_count(router: Router, text: str, count: int) -> None:
    wait_until(lambda: router.log().count(text) >= count, 20, f"{count} x {text!r}")


async def test_unjoined_sessions_are_capped_per_connection(fleet: Fleet) -> None:
    # Before: any number of streams on one connection, each holding a partial frame
    # until the hello timeout.
    router = fleet.router()
    fleet.agent(router, "m1")
    partial = struct.pack(">I", 60_000) + b"x" * 30_000  # a frame that never completes
    async with trio.open_nursery() as nursery, stranger(router) as open_stream:
        for _ in range(10):
            await open_and_write(open_stream, nursery, partial)
        await trio.to_thread.run_sync(
            wait_log_count, router, "4 unjoined sessions on this connection already", 6
        )
        # While the attack holds its four, agents on other connections join and serve.
        await agent_joins(router)
        reply = await chat(router)
        assert reply.status_code == 200, reply.text
        nursery.cancel_scope.cancel()
    assert router.log().count("session_refused_before_hello") == 6
    assert router.metric("hivenet_router_agent_sessions_refused_total") == 6


async def test_unjoined_sessions_are_capped_per_address(fleet: Fleet) -> None:
    # Before: any number of connections (peer IDs cost nothing) from one address.
    router = fleet.router("--max-unjoined-per-ip", "8")
    fleet.agent(router, "m1")
    partial = struct.pack(">I", 60_000) + b"x" * 30_000
    async with trio.open_nursery() as nursery:
        openers = [await nursery.start(hold_connection, router) for _ in range(5)]
        for open_stream in openers:
            for _ in range(2):
                await open_and_write(open_stream, nursery, partial)
        await trio.to_thread.run_sync(
            wait_log_count, router, "8 unjoined sessions from 127.0.0.1 already", 2
        )
        # Joined agents do not count: the one already in serves on.
        assert (await chat(router)).status_code == 200
        nursery.cancel_scope.cancel()
    assert router.log().count("session_refused_before_hello") == 2
    # The strangers gone, their address is free again.
    await trio.to_thread.run_sync(wait_log_count, router, "session_closed_before_join", 8)
    await agent_joins(router)


async def test_strangers_cannot_grow_the_routers_memory(fleet: Fleet) -> None:
    # Before: 36 streams of strangers, each sending 2 MiB of a 16 MiB frame, took the
    # router's memory up by more than 72 MiB until the hello timeout.
    router = fleet.router()
    fleet.agent(router, "m1")
    proc = psutil.Process(router.popen.pid)
    before = proc.memory_info().rss
    body = struct.pack(">I", 16 * MIB - 1) + b"z" * (2 * MIB)
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as writers:
            for _ in range(6):
                opener = await nursery.start(hold_connection, router)
                for _ in range(6):
                    writers.start_soon(write_quietly, await opener(), body)
        # Every write has ended (sent, or refused): what the router holds, it holds now.
        after = proc.memory_info().rss
        await agent_joins(router)
        assert (await chat(router)).status_code == 200
        nursery.cancel_scope.cancel()
    assert after - before < 32 * MIB, (before, after)
    log = router.log()
    # Each stream was refused at its frame's length or, over a count, before any read.
    oversized = log.count("oversized frame: 16777215 bytes > limit 65536")
    assert oversized + log.count("session_refused_before_hello") == 36
    assert router.alive()


async def hold_connection(
    router: Router, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
) -> None:
    async with stranger(router) as open_stream:
        task_status.started(open_stream)
        await trio.sleep_forever()


def test_sessions_count_per_connection_address_and_in_all() -> None:
    unjoined = Unjoined(UnjoinedLimits(per_connection=2, per_address=3, total=4))
    assert unjoined.enter(1, "10.0.0.1") is None
    assert unjoined.enter(1, "10.0.0.1") is None
    assert unjoined.enter(1, "10.0.0.1") == "2 unjoined sessions on this connection already"
    assert unjoined.enter(2, "10.0.0.1") is None
    assert unjoined.enter(3, "10.0.0.1") == "3 unjoined sessions from 10.0.0.1 already"
    assert unjoined.enter(4, "10.0.0.2") is None
    assert unjoined.enter(5, "10.0.0.3") == "4 unjoined sessions in all already"
    unjoined.leave(1, "10.0.0.1")
    assert unjoined.enter(5, "10.0.0.3") is None
    for conn, source in ((1, "10.0.0.1"), (2, "10.0.0.1"), (4, "10.0.0.2"), (5, "10.0.0.3")):
        unjoined.leave(conn, source)
    assert unjoined.total == 0
    assert repr(unjoined) == "<Unjoined 0 sessions on 0 connections from 0 addresses>"


def test_an_ipv6_host_counts_as_its_64() -> None:
    assert source_of(("2001:db8:1:2:aaaa::1", 9000)) == "2001:db8:1:2::/64"
    assert source_of(("2001:db8:1:2:ffff::9", 9000)) == "2001:db8:1:2::/64"
    assert source_of(("::ffff:192.0.2.7", 9000)) == "192.0.2.7"
    assert source_of(("192.0.2.7", 9000)) == "192.0.2.7"
    assert source_of(None) == "unknown"


def test_a_websocket_agent_is_counted_under_its_own_address() -> None:
    """py-libp2p's WebSocket connection reports no remote address; the per-address limit
    must still see the real one, or every `/ws` agent would share one bucket."""

    class Endpoint:
        address, port = "192.0.2.9", 4711

    class WsConn:
        remote = Endpoint()

    class Transport:
        _ws_connection = WsConn()

    class Muxed:
        secured_conn = Transport()

        def get_remote_address(self) -> None:
            return None

    class Stream:
        muxed_conn = Muxed()

    endpoint = remote_endpoint(Stream())
    assert endpoint == ("192.0.2.9", 4711)
    assert source_of(endpoint) == "192.0.2.9"
    assert format_endpoint(endpoint) == "192.0.2.9:4711"
    assert format_endpoint(("2001:db8::1", 9000)) == "[2001:db8::1]:9000"
    assert format_endpoint(None) == ""
