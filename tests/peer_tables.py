"""A routing core's peer table of many agents, built in-process (no link): for tests of
what the router does per agent (its pages, its metrics) at fleet size."""

from __future__ import annotations

from router.peers import AgentMetadata, Peer, PeerTable


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
