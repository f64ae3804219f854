"""Router CPU per agent heartbeat, in process: frame decode, the session's dispatch and
the link's heartbeat handling, plus the per-period passes an idle fleet costs (the
liveness and table sweeps every second, the history store's pass every 5 s).

    python -m bench.heartbeat [--agents 1000] [--periods 20] [--rounds 5]
                              [--kind fleet|gpus] [--against /path/to/other/checkout]

`--agents` sessions are admitted through their hello on one AgentLink, as the tests
build it, with stand-in streams that encode what the router sends. One period is one
heartbeat from every agent, a fifth of them between each of five one-second ticks of
a mock clock; the figure is process CPU per heartbeat over `--periods` periods, after
one period of warm-up. `--profile` prints this build's cProfile of those periods
(whose figure cProfile inflates). `--kind fleet` is what bench.fleet's agents send (two engine and
two hardware values); `--kind gpus` a GPU host's heartbeat: every engine and hardware
field, eight GPU records, host memory and the preemption count.

With `--against DIR` the same measure runs from that checkout too (its `.venv` when it
has one), each round one worker process per build, in alternating order, so both see
the same host load; the report gives each build's per-round figures and median.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
SECRET = b"bench-heartbeat-secret-0123456789abcdef"
TICKS = 5


class _Stream:
    """The parts of FramedStream a router session uses; frames sent are encoded, as
    the real stream does, and dropped."""

    def __init__(self, trio: object, encode: object) -> None:
        self.closed = trio.Event()  # type: ignore[attr-defined]
        self.close_reason = ""
        self.last_tx = 0.0
        self._encode = encode
        self._trio = trio

    def send_nowait(self, msg: dict) -> None:
        self._encode(msg)  # type: ignore[operator]
        self.last_tx = self._trio.current_time()  # type: ignore[attr-defined]

    async def send(self, msg: dict) -> None:
        self.send_nowait(msg)

    def allow_frames(self, max_frame_bytes: int) -> None:
        pass

    def close(self, reason: str) -> None:
        self.close_reason = reason
        self.closed.set()


def heartbeat(kind: str, now: float) -> dict:
    """One heartbeat as the current agent sends it (agent/link.py `Status.heartbeat`
    and `_room`)."""
    if kind == "fleet":
        engine: dict = {"kv_cache_utilization": 0.1, "running_requests": 0.0}
        hardware: dict = {"cpu_usage_percent": 0.2, "memory_used_percent": 0.3}
    else:
        engine = {
            "kv_cache_utilization": 0.42,
            "running_requests": 3.0,
            "waiting_requests": 0.0,
            "avg_ttft_seconds": 0.081,
            "p90_ttft_seconds": 0.2,
            "avg_itl_seconds": 0.012,
            "p90_itl_seconds": 0.03,
            "preemptions_total": 0.0,
        }
        gpus = [
            {
                "index": i,
                "util_percent": 61.0,
                "vram_used_bytes": 70 * 2**30,
                "vram_free_bytes": 10 * 2**30,
                "vram_total_bytes": 80 * 2**30,
                "temperature_c": 55.0,
                "power_watts": 412.5,
            }
            for i in range(8)
        ]
        hardware = {
            "gpu_temperature_c": 55.0,
            "gpu_util_percent": 0.61,
            "gpu_vram_used_percent": 0.875,
            "memory_used_percent": 0.3,
            "cpu_usage_percent": 0.2,
            "memory_used_bytes": 300 * 2**30,
            "memory_available_bytes": 700 * 2**30,
            "memory_total_bytes": 1000 * 2**30,
            "gpus": gpus,
        }
    engine |= {"age": 0.3, "interval": 5.0}
    hardware |= {"age": 1.1, "interval": 5.0}
    return {
        "type": "heartbeat",
        "ts": now,
        "backend_healthy": True,
        "engine": engine,
        "hardware": hardware,
        "elsewhere": 0,
    }


async def _measure(agents: int, periods: int, kind: str, profile: bool = False) -> dict:
    import trio

    from protocol import messages as m
    from protocol.frames import FrameDecoder, encode_frame
    from protocol.tokens import issue_token
    from router.link import AgentLink, AgentSession, LinkSettings
    from router.metrics import RouterMetrics
    from router.peers import PeerTable

    table = PeerTable()
    link = AgentLink(table, RouterMetrics(), LinkSettings(SECRET, 5.0, 15.0, 30.0, "router"))
    store = None
    try:
        from router.lifetime import LifetimeStore
    except ImportError:  # a build from before the history store
        pass
    else:
        store = LifetimeStore(os.path.join(tempfile.mkdtemp(), "history.sqlite3"), table)
        store.load()
    sessions = []
    for i in range(agents):
        peer_id = f"12D3KooWBench{i:08d}"
        session = AgentSession(link, _Stream(trio, encode_frame), peer_id)  # type: ignore[arg-type]
        metadata = {
            "model": f"fleet-model-{i % 10}",
            "capability": "llm",
            "engine": "vllm",
            "capacity": 8,
            "region": "bench",
        }
        session.on_message(m.hello(issue_token(SECRET, peer_id, 3600), metadata))
        sessions.append((session, FrameDecoder()))
    frame = encode_frame(heartbeat(kind, time.time()))
    clock = trio.lowlevel.current_clock()
    per_tick = [sessions[t * agents // TICKS : (t + 1) * agents // TICKS] for t in range(TICKS)]

    async def period() -> None:
        for group in per_tick:
            for session, decoder in group:
                for message in decoder.feed(frame):
                    session.on_message(message)
            clock.jump(1.0)  # type: ignore[attr-defined]
            now = trio.current_time()
            link._liveness(now)
            link._sweep_table(now)
        if store is not None:
            await store.write()

    await period()
    healthy = sum(1 for p in table.all() if p.routable)
    if healthy != agents:
        raise RuntimeError(f"{healthy}/{agents} agents routable after the warm-up")
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    cpu0 = time.process_time()
    for _ in range(periods):
        await period()
    cpu = time.process_time() - cpu0
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    return {"us_per_heartbeat": round(cpu / (periods * agents) * 1e6, 2)}


def worker(args: argparse.Namespace) -> None:
    import trio
    import trio.testing

    result = trio.run(
        _measure,
        args.agents,
        args.periods,
        args.kind,
        args.profile,
        clock=trio.testing.MockClock(rate=0),
    )
    print(json.dumps(result))


def run_build(root: Path, args: argparse.Namespace) -> float:
    venv = root / ".venv" / "bin" / "python"
    python = str(venv) if venv.exists() else sys.executable
    # -P: not this file's folder first on the path, where bench/profile.py would stand
    # in for the standard library's.
    argv = [python, "-P", str(Path(__file__).resolve()), "--worker", "--agents", str(args.agents)]
    argv += ["--periods", str(args.periods), "--kind", args.kind]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{root}: the worker failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])["us_per_heartbeat"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--periods", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kind", choices=("fleet", "gpus"), default="fleet")
    parser.add_argument("--against", type=Path, default=None, help="another checkout")
    parser.add_argument(
        "--profile", action="store_true", help="this build only: cProfile of the periods"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker or args.profile:
        worker(args)
        return
    builds = [("this", HERE)]
    if args.against is not None:
        builds.insert(0, (args.against.name, args.against.resolve()))
    figures: dict[str, list[float]] = {name: [] for name, _ in builds}
    for round_ in range(args.rounds):
        for name, root in builds if round_ % 2 == 0 else reversed(builds):
            figures[name].append(run_build(root, args))
    for name, values in figures.items():
        print(
            f"{name}: {statistics.median(values):.2f} us CPU per heartbeat "
            f"(median of {len(values)}; rounds {', '.join(f'{v:.2f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
