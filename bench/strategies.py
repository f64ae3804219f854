"""Ranking strategies on a chat trace whose prompts share prefixes, against vllm-router.

    python -m bench.strategies [--conversations 48] [--turns 10] [--clients 16] [--interleave 3]
                               [--think 0.5] [--prefill shared|slot]

Eight simulated engines with a prefix cache and a prefill cost per uncached token (so
a cache hit shortens the time to first token as on a GPU) serve one trace. Each engine
prefills one prompt at a time (`--prefill shared`, the default), as a GPU's compute is
shared by the prefills it schedules, so the tokens one request misses in the cache
delay the requests behind it on that engine; `--prefill slot` lets every slot prefill on
its own, which no GPU does. The trace: multi-turn
conversations, each opening with one of a few shared system prompts, each turn the
whole history so far plus a new user message, the engine's answer appended as the
next assistant message. Each client keeps a few conversations open and takes their
turns in rotation, so other requests come between two turns of one conversation, as
other users' do. The same trace goes through hivenet with `least-loaded`,
`prefix-aware` and `round-robin`, and through vLLM's router (`vllm-router`, Rust) with
`cache_aware` and `round_robin`, on fresh engines each time, in one run.

Reported per target: the engines' prefix-cache hit rate (`vllm:prefix_cache_hits_total`
over `..._queries_total`, in tokens), time to first token p50/p99 as the client sees it
(streaming), requests per second, and the load spread: the busiest engine's request
count over the mean. Where the hit rate goes is counted from each answer's usage chunk
(`prompt_tokens_details.cached_tokens`), whatever the router: the first turns that
found their system prompt uncached (one per agent a system prompt reaches, at least)
and the later turns that found less than their previous turn's prompt cached (the
conversation moved, or its engine evicted it). Every other token a turn misses is new
(its user message and the answer before it), so these two are all a router can change.

Hivenet's agents declare capacity 16, the engines' concurrency, and the router counts a
stream's slot until its end (`--stream-slot-release end`), as vllm-router counts a
worker's load; at the default (`head`) a stream frees its slot at its first byte and
load-based rankings see an idle fleet.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import psutil
import trio

from bench.peers import setup, venv_bin
from bench.procs import Procs, free_port, wait_http, wait_models

MODEL = "bench-model"
AGENTS = 8
ENGINE_SLOTS = 16
HIVENET_STRATEGIES = ("least-loaded", "prefix-aware", "round-robin")
VLLM_POLICIES = ("cache_aware", "round_robin")
# 2,000 prompt tokens per second of prefill and 500 generated per second: prefill is
# slowed well below a GPU's (10,000+ per second for an 8B model) so that it, not the
# scheduling noise of a loaded two-core machine (100-200 ms at load 10), sets the TTFT.
PREFILL_TOKEN_LATENCY = 0.0005
TOKEN_LATENCY = 0.002
BLOCK_TOKENS = 16
# 2,048 blocks of 16: 32 k tokens per engine, a quarter of what the whole trace holds,
# so an engine that sees every conversation evicts and one that sees its share does not.
CACHE_BLOCKS = 2048
ANSWER_TOKENS = 32
# A system prompt of 300 words and user turns of 150: by the tenth turn the history is
# five sixths of the prompt, and only a router that remembers it saves its prefill.
SYSTEM_WORDS = 300
USER_WORDS = 150
# The bound on the busiest agent's load over the mean.
SPREAD_TARGET = 1.5
WORDS = [f"w{i}" for i in range(5000)]


@dataclass
class Conversation:
    system: str
    users: list[str]


@dataclass
class Outcome:
    name: str
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    per_engine: list[float] = field(default_factory=list)
    missing: str = ""
    usage: int = 0  # answers that carried a usage chunk
    prompt_tokens: int = 0  # over those answers
    reachable: int = 0  # tokens those answers could have found cached (see `account`)
    system_prefills: int = 0  # first turns that found their system prompt uncached
    history_misses: int = 0  # later turns that found less than the turn before cached


def make_trace(conversations: int, turns: int, systems: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    prompts = [text(SYSTEM_WORDS) for _ in range(systems)]
    return [
        Conversation(prompts[i % systems], [text(USER_WORDS) for _ in range(turns)])
        for i in range(conversations)
    ]


@dataclass
class Answer:
    ttft: float  # seconds to the first content delta
    text: str
    prompt_tokens: int | None = None  # from the usage chunk, when one came
    cached_tokens: int | None = None


async def first_token(client: httpx.AsyncClient, url: str, messages: list[dict]) -> Answer:
    """A streamed chat's time to first token, its answer and its usage chunk."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": ANSWER_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    result = Answer(math.nan, "")
    parts: list[str] = []
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if usage := chunk.get("usage"):
                result.prompt_tokens = usage.get("prompt_tokens")
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                )
            if not chunk.get("choices"):
                continue
            delta = chunk["choices"][0].get("delta", {}).get("content")
            if delta:
                if not parts:
                    result.ttft = time.monotonic() - started
                parts.append(delta)
    result.text = "".join(parts)
    return result


def account(outcome: Outcome, answer: Answer, previous: int | None) -> None:
    """Count a turn that missed what a router could have found cached: its system prompt
    (a first turn, `previous` None) or the previous turn's prompt of `previous` tokens;
    an engine caches whole blocks only."""
    if answer.prompt_tokens is None or answer.cached_tokens is None:
        return
    reachable = (SYSTEM_WORDS if previous is None else previous) // BLOCK_TOKENS * BLOCK_TOKENS
    outcome.usage += 1
    outcome.prompt_tokens += answer.prompt_tokens
    outcome.reachable += reachable
    if answer.cached_tokens < reachable:
        if previous is None:
            outcome.system_prefills += 1
        else:
            outcome.history_misses += 1


async def play(
    port: int,
    trace: list[Conversation],
    clients: int,
    interleave: int,
    think: float,
    outcome: Outcome,
) -> None:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    pending = iter(trace)

    async def client_loop(client: httpx.AsyncClient, seed: int) -> None:
        # A client keeps `interleave` conversations open and takes their turns in rotation,
        # pausing between requests as a user reads an answer or a tool runs, so other
        # users' requests take the slot its last one freed; with no pause, a closed loop
        # hands that slot straight back to it and any load ranking follows it by accident.
        rng = random.Random(seed)
        while batch := list(itertools.islice(pending, interleave)):
            chats = [[{"role": "system", "content": c.system}] for c in batch]
            previous: list[int | None] = [None] * len(batch)  # last prompt_tokens
            for index in range(max(len(c.users) for c in batch)):
                for slot, (conversation, messages) in enumerate(zip(batch, chats, strict=True)):
                    if index >= len(conversation.users) or messages[-1].get("failed"):
                        continue
                    messages.append({"role": "user", "content": conversation.users[index]})
                    try:
                        answer = await first_token(client, url, messages)
                    except (httpx.HTTPError, RuntimeError, KeyError, ValueError):
                        outcome.errors += 1
                        messages.append({"role": "assistant", "content": "", "failed": True})
                        continue
                    outcome.ttft.append(answer.ttft)
                    account(outcome, answer, previous[slot])
                    previous[slot] = answer.prompt_tokens
                    messages.append({"role": "assistant", "content": answer.text})
                    if think > 0:
                        await trio.sleep(rng.expovariate(1 / think))

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=120, limits=limits) as client, trio.open_nursery() as n:
        for seed in range(clients):
            n.start_soon(client_loop, client, seed)
    outcome.elapsed = time.monotonic() - started


def engine_counters(port: int) -> tuple[float, float, float]:
    """(prefix-cache hits, queries, requests) from one engine's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in (
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total",
            "vllm:time_to_first_token_seconds_count",
        ):
            values[name] = float(rest.rsplit(" ", 1)[1])
    return (
        values.get("vllm:prefix_cache_hits_total", 0.0),
        values.get("vllm:prefix_cache_queries_total", 0.0),
        values.get("vllm:time_to_first_token_seconds_count", 0.0),
    )


def start_engines(procs: Procs, prefill: str) -> list[int]:
    ports = [free_port() for _ in range(AGENTS)]
    shared = ["--prefill-shared"] if prefill == "shared" else []
    for port in ports:
        procs.spawn(
            f"sim-{port}",
            [
                sys.executable,
                "-m",
                "sim",
                "--model",
                MODEL,
                "--port",
                str(port),
                "--capacity",
                str(ENGINE_SLOTS),
                "--token-latency",
                str(TOKEN_LATENCY),
                "--prefill-token-latency",
                str(PREFILL_TOKEN_LATENCY),
                "--prefix-block-tokens",
                str(BLOCK_TOKENS),
                "--prefix-cache-blocks",
                str(CACHE_BLOCKS),
                *shared,
            ],
        )
    for port in ports:
        wait_http(f"http://127.0.0.1:{port}/health")
    return ports


def start_hivenet(procs: Procs, engines: list[int], strategy: str, params: str) -> int:
    policy = procs.dir / f"policy-{strategy}.yaml"
    text = f"routing_policy:\n  match: {{}}\n  strategy: {strategy}\n"
    if strategy == "prefix-aware" and params:
        text += f"  strategy_params: {{{params}}}\n"
    policy.write_text(text)
    http, metrics, p2p = free_port(), free_port(), free_port()
    _, addr = procs.router(
        http,
        metrics,
        p2p,
        "--policy-file",
        str(policy),
        "--queue-depth",
        "1024",
        "--stream-slot-release",
        "end",
    )
    for port in engines:
        procs.agent(addr, MODEL, f"http://127.0.0.1:{port}", "--capacity", str(ENGINE_SLOTS))
    wait_models(f"http://127.0.0.1:{http}", MODEL, len(engines), timeout=60)
    return http


def start_vllm_router(procs: Procs, engines: list[int], policy: str) -> tuple[int, str]:
    if why := setup("vllm-router"):
        return 0, why
    port = free_port()
    procs.spawn(
        f"vllm-router-{policy}",
        [
            str(venv_bin("vllm-router", "vllm-router")),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *(f"http://127.0.0.1:{p}" for p in engines),
            "--policy",
            policy,
            "--log-level",
            "warning",
        ],
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=90)
    except RuntimeError:
        return 0, "did not start"
    return port, ""


Start = Callable[[Procs, list[int]], tuple[int, str]]


def run_target(
    name: str,
    start: Start,
    trace: list[Conversation],
    clients: int,
    interleave: int,
    think: float,
    prefill: str,
) -> Outcome:
    outcome = Outcome(name)
    procs = Procs()
    try:
        engines = start_engines(procs, prefill)
        port, missing = start(procs, engines)
        if missing:
            outcome.missing = missing
            return outcome
        trio.run(play, port, trace, clients, interleave, think, outcome)
        for engine in engines:
            hits, queries, requests = engine_counters(engine)
            outcome.hits += hits
            outcome.queries += queries
            outcome.per_engine.append(requests)
    finally:
        procs.close()
    return outcome


def pct(values: list[float], q: float) -> float:
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--systems", type=int, default=4, help="distinct system prompts")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients")
    parser.add_argument(
        "--interleave", type=int, default=3, help="conversations a client takes turns in"
    )
    parser.add_argument(
        "--think",
        type=float,
        default=0.5,
        help="mean seconds a client pauses after each answer (exponential; 0: none)",
    )
    parser.add_argument(
        "--prefill",
        choices=("shared", "slot"),
        default="shared",
        help="engines prefill one prompt at a time (a GPU) or every slot on its own",
    )
    parser.add_argument("--only", default="", help="comma-separated target names")
    parser.add_argument(
        "--prefix-params",
        default="",
        help="prefix-aware's strategy_params, e.g. 'balance_threshold: 0.5'",
    )
    args = parser.parse_args()
    trace = make_trace(args.conversations, args.turns, args.systems, seed=25)
    targets = [
        (
            f"hivenet {s}",
            lambda procs, engines, s=s: (start_hivenet(procs, engines, s, args.prefix_params), ""),
        )
        for s in HIVENET_STRATEGIES
    ] + [
        (f"vllm-router {p}", lambda procs, engines, p=p: start_vllm_router(procs, engines, p))
        for p in VLLM_POLICIES
    ]
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    began = time.monotonic()
    load = psutil.getloadavg()[0]
    outcomes = [
        run_target(name, start, trace, args.clients, args.interleave, args.think, args.prefill)
        for name, start in targets
        if not only or name in only
    ]
    report(outcomes, args, time.monotonic() - began, load)


def report(outcomes: list[Outcome], args: argparse.Namespace, took: float, load: float) -> None:
    print(
        f"machine: {platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, load average {load:.2f} at the start; "
        f"{AGENTS} engines x {ENGINE_SLOTS} slots, {args.conversations} conversations x "
        f"{args.turns} turns, {args.systems} system prompts, {args.clients} clients taking "
        f"turns in {args.interleave} conversations each, pausing {args.think:g} s on "
        f"average after each answer, prefill {args.prefill}; "
        f"run took {took:.0f}s"
    )
    print()
    print(
        "| via | cache hit rate | TTFT p50 ms | TTFT p99 ms | req/s | busiest/mean load "
        "| system prompt prefills | history misses |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for o in outcomes:
        if o.missing:
            print(f"| {o.name} | - | - | - | - | {o.missing} | - | - |")
            continue
        hit = o.hits / o.queries if o.queries else 0.0
        mean = sum(o.per_engine) / len(o.per_engine) if o.per_engine else 0.0
        spread = max(o.per_engine) / mean if mean else math.nan
        errors = f", {o.errors} errors" if o.errors else ""
        rps = len(o.ttft) / o.elapsed if o.elapsed else 0.0
        # Turns without a usage chunk (a router that drops stream_options) are not counted.
        counted = "" if o.usage == len(o.ttft) else f" ({o.usage} of {len(o.ttft)} turns)"
        print(
            f"| {o.name} | {hit:.1%} | {pct(o.ttft, 0.5) * 1000:.0f} "
            f"| {pct(o.ttft, 0.99) * 1000:.0f} | {rps:.1f}{errors} | {spread:.2f} "
            f"| {o.system_prefills}{counted} | {o.history_misses} |"
        )
    if full := next((o for o in outcomes if o.usage and o.usage == len(o.ttft)), None):
        system = SYSTEM_WORDS // BLOCK_TOKENS * BLOCK_TOKENS
        # A conversation that stays where it started loads its agent by its turns, so an
        # agent within SPREAD_TARGET of the mean holds at most this many conversations,
        # and each system prompt's conversations need this many agents at least.
        per_agent = math.floor(SPREAD_TARGET * args.conversations / AGENTS)
        per_system = math.ceil(args.conversations / args.systems)
        least = args.systems * math.ceil(per_system / per_agent) if per_agent else 0
        best = full.reachable / full.prompt_tokens
        cost = system / full.prompt_tokens
        print()
        print(
            f"Every turn finding its previous prompt cached, a first turn its system prompt: "
            f"{best:.2%}. Each system prompt prefill costs {cost * 100:.3f} points ({system} of "
            f"{full.prompt_tokens} prompt tokens): {best - args.systems * cost:.2%} at the "
            f"fewest ({args.systems}, one agent per system prompt), {best - least * cost:.2%} "
            f"at the fewest with no agent above {SPREAD_TARGET:g}x the mean "
            f"({least}: {per_system} conversations per system prompt, {per_agent} per agent)."
        )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
