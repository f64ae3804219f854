"""A routing core's peer table of many agents, built in-process (no link), and a count of
the loop turns a page's building leaves to other tasks: for tests of what the router
does per agent (its pages, its metrics) at fleet size."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from router.peers import AgentMetadata, Peer, PeerTable

T = TypeVar("T")


def many_agents(count: int) -> PeerTable:
    """`count` agents over seven models, four slots each, none ever heard from."""

    async def send(msg: dict) -> None:
        pass

    table = PeerTable()
    for i in range(count):
        table.add(
            Peer(
                peer_id=f"12D3KooWPeer{i:04d}",
                metadata=AgentMetadata(
                    model=f"m{i % 7}", capability="llm", engine="sim", capacity=4
                ),
                send=send,
                connected_at=0.0,
                last_seen=0.0,
            )
        )
    return table


async def turns_during(work: Callable[[], Awaitable[T]]) -> tuple[T, int]:
    """`work()`'s result, and how many times another task ran while it did: a page built
    in steps lets it run between them; one built in a single turn, not at all."""
    turns = 0
    done = False

    async def other() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await trio.lowlevel.checkpoint()
        before = turns
        result = await work()
        done = True
    return result, turns - before
