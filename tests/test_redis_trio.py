"""The trio-native Redis client (router/redis_trio.py): real redis-server for what it
does, a fake one speaking broken RESP from a trio socket for what a hostile or hung
server does to it. Every failure is a StoreError within the call's deadline, and the
next call connects again."""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from router.redis_trio import (
    _NOTHING,
    MAX_BULK,
    MAX_LINE,
    ProtocolError,
    RedisTrio,
    ReplyError,
    RespParser,
    Script,
    StoreError,
    encode,
)
from tests.redis_server import RedisServer

TIMEOUT = 0.5


def parse_all(data: bytes) -> list[object]:
    parser = RespParser()
    out: list[object] = []
    for i in range(len(data)):  # byte by byte: every reply split everywhere
        parser.feed(data[i : i + 1])
        while (value := parser.get()) is not _NOTHING:
            out.append(value)
    return out


def test_the_parser_reads_every_reply_type_split_anywhere() -> None:
    data = (
        b"+OK\r\n:-42\r\n$3\r\nabc\r\n$-1\r\n*2\r\n$1\r\nx\r\n*1\r\n:7\r\n*-1\r\n"
        b"$0\r\n\r\n-ERR no\r\n"
    )
    got = parse_all(data)
    assert got[:7] == [b"OK", -42, b"abc", None, [b"x", [7]], None, b""]
    assert isinstance(got[7], ReplyError) and got[7].args == ("ERR no",)
    assert encode(("EVALSHA", "ab", 1, 0.5, b"\x00")) == (
        b"*5\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n1\r\n$3\r\n0.5\r\n$1\r\n\x00\r\n"
    )


@pytest.mark.parametrize(
    "data",
    [
        b"?what\r\n",  # no RESP type
        b"$abc\r\n",  # a length that is no number
        b":1_000\r\n",
        b"$" + str(MAX_BULK + 1).encode() + b"\r\n",
        b"$3\r\nabcdef\r\n",  # longer than its length
        b"*-2\r\n",
        b"*1\r\n" * 10 + b":1\r\n",  # nested too deep
        b"+" + b"x" * (MAX_LINE + 10),  # a line that never ends
    ],
)
def test_the_parser_refuses_what_is_not_resp(data: bytes) -> None:
    parser = RespParser()
    parser.feed(data)
    with pytest.raises(ProtocolError):
        parser.get()


class FakeRedis:
    """A trio socket server answering each command with what `answer` returns for the
    n-th command (None: never answer)."""

    def __init__(self, answer: Callable[[int, bytes], bytes | None]) -> None:
        self.answer = answer
        self.commands = 0
        self.connections = 0
        self.port = 0

    async def serve(self, nursery: trio.Nursery) -> None:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, self.handle, 0, host="127.0.0.1")
        )
        self.port = listeners[0].socket.getsockname()[1]

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        parser = RespParser()
        try:
            async for data in stream:
                parser.feed(data)
                while isinstance(command := parser.get(), list):
                    self.commands += 1
                    reply = self.answer(self.commands, command[0])
                    if reply is not None:
                        await stream.send_all(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def with_fake(
    answer: Callable[[int, bytes], bytes | None],
) -> Callable[[Callable[[FakeRedis, RedisTrio], Awaitable[None]]], None]:
    def run(body: Callable[[FakeRedis, RedisTrio], Awaitable[None]]) -> None:
        async def main() -> None:
            fake = FakeRedis(answer)
            async with trio.open_nursery() as nursery:
                await fake.serve(nursery)
                client = RedisTrio(f"redis://127.0.0.1:{fake.port}/0", TIMEOUT)
                await body(fake, client)
                client.close()
                nursery.cancel_scope.cancel()

        trio.run(main)

    return run


HOSTILE = [
    b"?garbage\r\n",
    b"$999999999999\r\n",
    b"$5\r\nab",  # half a reply, then nothing: the deadline
    b"*99999999\r\n",
    b"+" + b"A" * (MAX_LINE + 1),
    b":1\r\n:2\r\n",  # a reply nobody asked for
]


@pytest.mark.parametrize("bad", HOSTILE)
def test_a_hostile_reply_fails_the_call_and_the_next_call_connects_again(bad: bytes) -> None:
    def answer(n: int, name: bytes) -> bytes | None:
        return bad if n == 1 else b"+PONG\r\n"

    async def body(fake: FakeRedis, client: RedisTrio) -> None:
        with trio.fail_after(5 * TIMEOUT):
            if bad.startswith(b":1"):
                # The first reply is the call's; the one after it breaks the connection.
                assert await client.call("PING") == 1
                await trio.sleep(0.05)
            else:
                with pytest.raises(StoreError):
                    await client.call("PING")
        assert await client.call("PING") == b"PONG"
        assert fake.connections == 2

    with_fake(answer)(body)


def test_a_server_that_never_answers_fails_the_call_in_time() -> None:
    def answer(n: int, name: bytes) -> bytes | None:
        return None if name == b"PING" else b":7\r\n"

    async def body(fake: FakeRedis, client: RedisTrio) -> None:
        started = trio.current_time()
        with trio.fail_after(10 * TIMEOUT):  # a hang here is the bug
            async with trio.open_nursery() as n:
                for _ in range(2):  # both calls in flight fail with the connection
                    n.start_soon(expect_store_error, client)
        assert trio.current_time() - started >= TIMEOUT * 0.9
        assert await client.call("INCR", "x") == 7  # on a fresh connection
        assert fake.connections == 2

    with_fake(answer)(body)


async def expect_store_error(client: RedisTrio) -> None:
    with pytest.raises(StoreError, match="no answer"):
        await client.call("PING")


def test_nothing_listening_is_a_store_error() -> None:
    async def main() -> None:
        sock = trio.socket.socket()
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        client = RedisTrio(f"redis://127.0.0.1:{port}/0", TIMEOUT)
        with pytest.raises(StoreError):
            await client.call("PING")

    trio.run(main)


async def test_real_redis_pipelines_in_order_and_survives_a_restart(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, dict(os.environ)).start()
    client = RedisTrio(server.url, 2.0)
    try:
        # 200 concurrent calls share the connection: each gets its own reply.
        got: list[int] = []

        async def incr() -> None:
            got.append(await client.call("INCR", "n"))

        async with trio.open_nursery() as nursery:
            for _ in range(200):
                nursery.start_soon(incr)
        assert sorted(got) == list(range(1, 201))

        # A caller cancelled while waiting: its reply is read and dropped, in order.
        with trio.move_on_after(0):
            await client.call("SET", "k", "cancelled")
        assert await client.call("GET", "k") in (b"cancelled", None)
        assert await client.call("ECHO", "after") == b"after"

        # An error reply is the caller's error; the connection stays.
        with pytest.raises(ReplyError, match=r"WRONGTYPE|ERR"):
            await client.call("LPUSH", "n", "x")
        assert await client.call("INCR", "n") == 201

        # Scripts by SHA; a Redis that forgot them (restart, failover) gets the source.
        script = Script("return tonumber(ARGV[1]) + 1")
        assert await client.evalsha(script, [], [41]) == 42
        await client.call("SCRIPT", "FLUSH")
        assert await client.evalsha(script, [], [1]) == 2

        # Redis restarts: the call in between fails, the next one connects again.
        connection = client._conn
        server.kill()
        with pytest.raises(StoreError):
            await client.call("PING")
        server.start()
        assert await client.call("PING") == b"PONG"
        assert client._conn is not connection
        assert await client.evalsha(script, [], [2]) == 3  # its script cache was empty
    finally:
        client.close()
        server.stop()
