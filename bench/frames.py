"""CPU per link frame: one heartbeat-sized frame sent and received over real libp2p hosts.

    python -m bench.frames [--frames 3000] [--profile out.txt]

Two hosts in one process (the router's and the agent's configuration) on loopback,
one session stream between them. Frames go one at a time, the next only after the
previous one arrived, as an idle fleet's heartbeats do, so every frame pays the whole
path: framing, yamux, Noise, the socket, and the same layers back up on the other side.
The figure is the process's CPU per frame, both sides together.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr

from protocol import messages as m
from protocol.p2p import FramedStream, quiet_libp2p_logging, tune_libp2p

PROTOCOL = TProtocol("/hivenet/bench-frames/1.0.0")


def heartbeat() -> dict:
    engine = {"kv_cache_utilization": 0.25, "num_requests_running": 3.0, "age_s": 0.4}
    hardware = {"gpu_utilization": 0.5, "gpu_memory_utilization": 0.6, "age_s": 0.4}
    return m.heartbeat(time.time(), True, engine, hardware)


async def measure(frames: int, warmup: int) -> float:
    """CPU seconds per frame over `frames` frames, after `warmup` unmeasured ones."""
    tune_libp2p()
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    server = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=listen)
    client = new_host(key_pair=create_new_key_pair(os.urandom(32)), listen_addrs=[])
    arrived = trio.Semaphore(0, max_value=frames + warmup)
    received: list[FramedStream] = []

    async def handler(stream: object) -> None:
        fs = FramedStream(stream)
        received.append(fs)
        await fs.run(lambda _msg: arrived.release())

    server.set_stream_handler(PROTOCOL, handler)
    async with server.run(listen_addrs=listen), client.run(listen_addrs=[]):
        info = info_from_p2p_addr(server.get_addrs()[0])
        await client.connect(info)
        stream = await client.new_stream(info.peer_id, [PROTOCOL])
        fs = FramedStream(stream)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fs.run, lambda _msg: None)
            msg = heartbeat()
            for _ in range(warmup):
                fs.send_nowait(msg)
                await arrived.acquire()
            start = time.process_time()
            for _ in range(frames):
                fs.send_nowait(msg)
                await arrived.acquire()
            spent = time.process_time() - start
            fs.close("done")
            for other in received:
                other.close("done")
            nursery.cancel_scope.cancel()
        await client.close()
        await server.close()
    return spent / frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--profile", help="write a cProfile summary (cumulative) here")
    args = parser.parse_args()
    quiet_libp2p_logging()
    if args.profile:
        profiler = cProfile.Profile(time.process_time)
        per_frame = profiler.runcall(trio.run, measure, args.frames, args.warmup)
        with open(args.profile, "w") as out:
            stats = pstats.Stats(profiler, stream=out)
            stats.sort_stats("tottime").print_stats(40)
    else:
        per_frame = trio.run(measure, args.frames, args.warmup)
    print(f"frames={args.frames} cpu_us_per_frame={per_frame * 1e6:.1f} (both sides)")


if __name__ == "__main__":
    main()
