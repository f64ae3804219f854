"""Time one routing decision (gates 1-7 and least-loaded ranking) for one model.

    python -m bench.decision [--repeat 7]

The pool is the worst realistic case for the happy path: every agent serves the model,
is healthy and matches, so each one passes the static gates, and any may be walked
through the others, including three exclude_if rules that read the universal, engine
and hardware metric sources (least-loaded walks an agent through them only when it is
lighter than its choice so far). About one agent in ten is excluded by a rule; loads
are random, so the lighter agents are spread over the pool. The last two columns time
pools that drain, which adds the pass that explains why: every agent over a gate 7
threshold, and every agent full (gate 6, what a request waiting in the capacity queue
re-evaluates).

The prefix-aware rows rank the same pool with `strategy: prefix-aware` for an 8k-token
prompt (32,768 characters, 4 per token) that continues a conversation one agent was
sent, against a tree holding 2,000 other prompts spread over the pool. Each decision
reads a fresh request, so the time includes cutting and hashing its prompt once.

Pools are tuples, as PeerTable hands them out, so the static gates' verdicts (3 and 4)
are worked out once per pool, as in the router. Each cell is warmed up, then timed
`--repeat` times over about 0.2 s of CPU each; the median is printed, in µs per decision and
per agent (flat from 100 to 10,000 agents when the cost is linear). The header names
the Python build and the CPU, which the figures depend on as much as on the code.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import replace

from router.peers import AgentMetadata, Peer, UniversalStats
from router.policy.gates import evaluate
from router.policy.rank import Ranking, RankRequest
from router.policy.schema import Step, load_policy

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
POLICY = """
routing_policy:
  match:
    region: EU-France
    engine: vllm
    tags: [production]
  exclude_if:
    kv_cache_utilization: {gt: 0.85}
    success_rate: {lt: 0.95}
    gpu_temperature_c: {gt: 82}
  strategy: least-loaded
"""
SIZES = (10, 100, 1_000, 10_000)
PREFIX_SIZES = (100, 10_000)
PROMPT_CHARS = 32_768  # 8k tokens
TREE_PROMPTS = 2_000
NOW = 1_000.0


async def _send(message: dict) -> None:
    del message


def make_pool(
    size: int, rng: random.Random, *, all_excluded: bool = False, all_full: bool = False
) -> tuple[Peer, ...]:
    metadata = AgentMetadata(
        model=MODEL,
        capability="llm",
        engine="vllm",
        capacity=32,
        region="EU-France",
        tags=("production", "high-memory"),
    )
    pool = []
    for i in range(size):
        kv = 0.95 if all_excluded else rng.choice((0.2, 0.4, 0.6, 0.8, 0.9))
        peer = Peer(
            peer_id=f"12D3KooW{i:08d}",
            metadata=metadata,
            send=_send,
            connected_at=0.0,
            last_seen=NOW,
            active=32 if all_full else rng.randrange(0, 32),
            engine={"kv_cache_utilization": kv, "waiting_requests": 0.0},
            hardware={"gpu_temperature_c": rng.uniform(50, 80)},
            engine_at=NOW - 0.2,
            hardware_at=NOW - 1.0,
            stats=UniversalStats(successes=990, failures=rng.randrange(0, 40), srtt_ms=120.0),
        )
        pool.append(peer)
    return tuple(pool)


def median_us(call: Callable[[], object], repeat: int) -> float:
    """Median CPU microseconds per call over `repeat` timings of ~0.2 s, after a warm-up
    (which also sizes the timings: timeit's autorange). Process CPU time, not wall
    time, so another process taking the core between two calls is not counted."""
    timer = timeit.Timer(call, timer=time.process_time)
    number, _ = timer.autorange()
    number = max(1, number)
    return statistics.median(timer.repeat(repeat=repeat, number=number)) / number * 1e6


def time_decision(pool: tuple[Peer, ...], step: Step, repeat: int) -> float:
    failed: frozenset[str] = frozenset()
    return median_us(lambda: evaluate(pool, step, "llm", failed, NOW), repeat)


def prefix_setup(pool: tuple[Peer, ...], step: Step, rng: random.Random) -> tuple[Ranking, dict]:
    """A ranking whose tree knows 2,000 prompts, and the payload of a returning one."""
    ranking = Ranking()
    system = "".join(rng.choice("abcdefgh ") for _ in range(2_000))

    def payload(history: str) -> dict:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": history}]
        return {"model": MODEL, "messages": messages}

    for i in range(TREE_PROMPTS):
        other = payload(f"{i} " * 200)
        ranking.chosen(
            step.strategy, step.strategy_params, pool[i % len(pool)], RankRequest(MODEL, other)
        )
    history = "".join(rng.choice("abcdefgh ") for _ in range(PROMPT_CHARS - len(system)))
    earlier = payload(history[: len(history) * 3 // 4])
    ranking.chosen(
        step.strategy, step.strategy_params, pool[len(pool) // 2], RankRequest(MODEL, earlier)
    )
    return ranking, payload(history)


def time_prefix_decision(
    pool: tuple[Peer, ...], step: Step, ranking: Ranking, payload: dict, repeat: int
) -> float:
    failed: frozenset[str] = frozenset()
    return median_us(
        lambda: evaluate(pool, step, "llm", failed, NOW, ranking, RankRequest(MODEL, payload)),
        repeat,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7, help="timings per cell (median)")
    args = parser.parse_args()
    repeat = args.repeat
    step = load_policy(POLICY).routing_policy
    rng = random.Random(7)
    print(
        f"Python {platform.python_version()} ({platform.python_implementation()}, "
        f"{' '.join(platform.python_build())}, {platform.python_compiler()}), "
        f"{sys.executable}; CPU {cpu_model()}; median of {repeat}"
    )
    print()
    print(
        "agents  µs/decision  µs/agent  survivors  gate 7 drain µs  µs/agent"
        "  gate 6 drain µs  µs/agent"
    )
    for size in SIZES:
        pool = make_pool(size, rng)
        excluded = make_pool(size, rng, all_excluded=True)
        full = make_pool(size, rng, all_full=True)
        result = evaluate(pool, step, "llm", frozenset(), NOW)
        assert result.best is not None
        # Least-loaded checks only the agents that could be its choice; another
        # strategy ranks every survivor, so its pass counts them.
        counted = evaluate(pool, replace(step, strategy="round-robin"), "llm", frozenset(), NOW)
        assert evaluate(excluded, step, "llm", frozenset(), NOW).drain is not None
        assert evaluate(full, step, "llm", frozenset(), NOW).waitable
        us = time_decision(pool, step, repeat)
        drained7 = time_decision(excluded, step, repeat)
        drained6 = time_decision(full, step, repeat)
        print(
            f"{size:>6}  {us:>11.1f}  {us / size:>8.3f}  {counted.survivors:>9}"
            f"  {drained7:>15.1f}  {drained7 / size:>8.3f}"
            f"  {drained6:>15.1f}  {drained6 / size:>8.3f}"
        )
    prefix = load_policy(POLICY.replace("least-loaded", "prefix-aware")).routing_policy
    print()
    print("prefix-aware, 8k-token prompt")
    print("agents  µs/decision  µs/agent  tree nodes")
    for size in PREFIX_SIZES:
        pool = make_pool(size, rng)
        ranking, payload = prefix_setup(pool, prefix, rng)
        best = evaluate(pool, prefix, "llm", frozenset(), NOW, ranking, RankRequest(MODEL, payload))
        assert best.best is not None
        unit = ranking.unit("prefix-aware")
        nodes = len(unit.tree(MODEL, prefix.strategy_params.block_chars))  # type: ignore[attr-defined]
        us = time_prefix_decision(pool, prefix, ranking, payload, repeat)
        print(f"{size:>6}  {us:>11.1f}  {us / size:>8.3f}  {nodes:>10}")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
