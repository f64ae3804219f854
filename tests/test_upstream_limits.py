"""The Go router's connection and forward limits (issue 19): `--p2p-max-conns-per-ip`
against one address opening connection after connection, and `--max-concurrent` with
`--queue-size` as plain objects."""

from __future__ import annotations

from typing import Any

import multiaddr
import pytest
import trio
import trio.testing

from protocol.errors import ErrorCode, RouterError
from router.forward_limit import QUEUE_FULL_WAIT, ForwardLimit
from router.p2p_host import PerSourceLimit
from tests.fleet import Fleet


@pytest.mark.parametrize(
    ("address", "source"),
    [
        ("/ip4/203.0.113.7/tcp/4001", "203.0.113.7/32"),
        ("/ip6/2001:db8:1:2ff:aaaa::1/tcp/4001", "2001:db8:1:200::/56"),
        ("/ip6/2001:db8:1:2aa::9/tcp/4001/ws", "2001:db8:1:200::/56"),
        ("/dns4/example.com/tcp/4001", None),
    ],
)
def test_sources_are_an_ipv4_address_or_an_ipv6_56(address: str, source: str | None) -> None:
    assert PerSourceLimit.source(multiaddr.Multiaddr(address)) == source


def test_a_source_takes_up_to_its_limit_and_gives_back() -> None:
    limit = PerSourceLimit(2)
    assert limit.take("a") and limit.take("a") and not limit.take("a")
    assert limit.take("b")
    limit.give("a")
    assert limit.take("a")
    for _ in range(3):
        limit.give("a")
    assert "a" not in limit.live


def test_connections_past_the_per_ip_limit_are_refused(fleet: Fleet) -> None:
    router = fleet.router("--p2p-max-conns-per-ip", "1")
    first = fleet.agent(router, "m1")
    second = fleet.agent(router, "m1", wait=False)
    router.wait_log(r"p2p_connection_refused source=127\.0\.0\.1/32 limit=1")
    assert [a["peer_id"] for a in router.agents()] == [first.peer_id]
    # The slot comes back with the connection: the second agent joins once the first
    # has left (its reconnect backoff is capped at 5 s).
    first.stop()
    router.wait_agent(second.peer_id, timeout=30)


async def test_forwards_past_max_concurrent_wait_and_past_queue_size_are_refused(
    autojump_clock: Any,
) -> None:
    limit = ForwardLimit(1, 1)
    release = trio.Event()
    entered: list[int] = []

    async def forward(n: int) -> None:
        async with limit.slot():
            entered.append(n)
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(forward, 1)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(forward, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert entered == [1] and limit.waiting == 1
        # Past the queue, a request waits QUEUE_FULL_WAIT for a place, then is refused.
        started = trio.current_time()
        with pytest.raises(RouterError) as caught:
            async with limit.slot():
                pass
        assert trio.current_time() - started == pytest.approx(QUEUE_FULL_WAIT)
        assert caught.value.code == ErrorCode.QUEUE_FULL and caught.value.http_status == 503
        assert caught.value.retry_after == 1.0 and "--queue-size 1" in caught.value.message
        assert "1/1 in flight, 1/1 waiting" in repr(limit)
        # One that finds a place within the wait goes on: the queue moves after 1 s.
        nursery.start_soon(forward, 3)
        await trio.sleep(1)
        release.set()
    assert entered == [1, 2, 3] and limit.waiting == 0


async def test_without_a_queue_a_request_waits_for_a_slot_as_long(autojump_clock: Any) -> None:
    limit = ForwardLimit(1, 0)
    held = trio.Event()
    async with trio.open_nursery() as nursery:

        async def hold(seconds: float) -> None:
            async with limit.slot():
                held.set()
                await trio.sleep(seconds)

        nursery.start_soon(hold, 2.0)
        await held.wait()
        async with limit.slot():  # the slot frees after 2 s, within the wait
            assert trio.current_time() == pytest.approx(2.0)
        nursery.start_soon(hold, 60.0)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RouterError):
            async with limit.slot():
                pass
        assert trio.current_time() == pytest.approx(2.0 + QUEUE_FULL_WAIT)
        nursery.cancel_scope.cancel()


async def test_no_max_concurrent_means_no_limit(autojump_clock: Any) -> None:
    limit = ForwardLimit(0, 1)
    async with limit.slot(), limit.slot():
        pass
    assert repr(limit) == "<ForwardLimit off>"


async def test_a_request_that_leaves_while_past_the_queue_takes_no_place(
    autojump_clock: Any,
) -> None:
    """A client gone while it waited for a place (its deadline, its disconnect) leaves
    the counts as they were: the next request still gets its place and its slot."""
    limit = ForwardLimit(1, 1)
    release = trio.Event()

    async def hold() -> None:
        async with limit.slot():
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold)
        nursery.start_soon(hold)  # the one place in the queue
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(1):
            async with limit.slot():
                pytest.fail("a slot past a full queue")
        assert limit.waiting == 1
        release.set()
    async with limit.slot():
        assert limit.waiting == 0
