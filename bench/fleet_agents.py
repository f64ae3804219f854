"""Many agent sessions in one process, for the fleet benchmark.

Each session is a real libp2p host with its own identity, dialling the router and
running the agent's own session code (hello, heartbeats with engine and hardware
values, link pings); requests are not sent to these agents.

    python -m bench.fleet_agents --router MULTIADDR --count 250
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.config import ConnectionConfig
from libp2p.peer.peerinfo import info_from_p2p_addr

from agent.engine_http import EnginePool, EngineTimeouts
from agent.link import RouterSession, Status, hello_for
from protocol.messages import PROTOCOL_ID
from protocol.p2p import peer_id_of, quiet_libp2p_logging, tune_libp2p
from protocol.secrets import load_secret


async def one_agent(address: str, secret: bytes, index: int, heartbeat: float) -> None:
    key_pair = create_new_key_pair(os.urandom(32))
    peer_id = str(peer_id_of(key_pair))
    host = new_host(
        key_pair=key_pair,
        listen_addrs=[],
        connection_config=ConnectionConfig(max_connections_per_peer=1),
    )
    info = info_from_p2p_addr(multiaddr.Multiaddr(address))
    status = Status(backend_healthy=True, changed=trio.Event())
    status.engine = {"kv_cache_utilization": 0.1, "running_requests": 0.0}
    status.hardware = {"cpu_usage_percent": 0.2, "memory_used_percent": 0.3}
    metadata = {
        "model": f"fleet-model-{index % 10}",
        "capability": "llm",
        "engine": "vllm",
        "capacity": 8,
        "region": "bench",
    }
    engine = EnginePool("http://127.0.0.1:9", EngineTimeouts(5.0, 5.0), 1)
    async with host.run(listen_addrs=[]), engine:
        await trio.sleep(random.uniform(0, 2))
        while True:
            try:
                host.get_network().unblock_peer(info.peer_id)
                await host.connect(info)
                stream = await host.new_stream(info.peer_id, [PROTOCOL_ID])
                session = RouterSession(
                    stream,
                    hello_for(secret, peer_id, metadata),
                    status,
                    engine,
                    heartbeat,
                    60.0,
                )
                await session.run()
            except Exception as exc:  # the benchmark keeps its sessions up, and says why
                cause = getattr(exc.__cause__, "exceptions", exc.__cause__)
                print(f"agent {index}: {exc!r} cause={cause!r}", file=sys.stderr, flush=True)
                await trio.sleep(1)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--router", required=True)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--heartbeat-interval", type=float, default=5.0)
    args = parser.parse_args()
    quiet_libp2p_logging()
    tune_libp2p()
    secret = load_secret(None)
    async with trio.open_nursery() as nursery:
        for i in range(args.count):
            nursery.start_soon(one_agent, args.router, secret, i, args.heartbeat_interval)
            await trio.sleep(0.01)


if __name__ == "__main__":
    trio.run(main)
