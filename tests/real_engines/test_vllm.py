"""The router and agents in front of a real vLLM (opt-in: `scripts/test --real-engines`).

One `vllm serve` (its CPU build, ../shared/notes/real-vllm.md) of a tiny random-weight
Llama is shared by every test of this module: it takes 30 to 50 s to start on two cores.
Its KV cache is small (4 sequences, 16 blocks of 128 tokens) so that load shows in its
gauges. Each test starts its own router and two agents (`--engine vllm`, model
discovered) in front of it, and talks to them with the official SDKs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from bench.stalls import Stalls
from tests.fleet import Agent, Fleet, Router, wait_until
from tests.real_engines.vllm_server import (
    SERVED,
    first_then_any,
    gauge,
    messages_stream,
    vllm_server,
)

MAX_NUM_SEQS = 4
REPORT = os.environ.get("HIVENET_REAL_ENGINES_REPORT")
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("HIVENET_VLLM_URL"):
        # One already serving the tiny model with the flags below (while writing tests).
        yield os.environ["HIVENET_VLLM_URL"]
        return
    with vllm_server(
        tmp_path_factory.mktemp("vllm"),
        os.environ["HIVENET_TINY_LLAMA"],
        SERVED,
        *("--max-model-len", "1024", "--max-num-seqs", str(MAX_NUM_SEQS)),
        *("--num-gpu-blocks-override", "16", "--enable-prefix-caching"),
    ) as url:
        yield url


@pytest.fixture(scope="module")
def stalls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stalls]:
    watch = Stalls(tmp_path_factory.mktemp("stalls"))
    try:
        yield watch
    finally:
        watch.close()


def _pair(fleet: Fleet, router: Router, url: str) -> tuple[Agent, Agent]:
    """Two agents on the one engine, model discovered from its /v1/models."""
    agents = [
        fleet.agent(
            router,
            "",
            *("--backend-url", url, "--engine-sample-interval", "200ms", "--capacity", "8"),
            *("--heartbeat-interval", "1s"),
            engine="vllm",
            wait=False,
        )
        for _ in range(2)
    ]
    fleet.join(*agents)
    return agents[0], agents[1]


def _client(router: Router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def _load(url: str, streams: int, tokens: int) -> list[threading.Thread]:
    """`streams` requests straight to the engine, each `tokens` long (ignore_eos)."""
    body = {"model": SERVED, "prompt": "hello there", "max_tokens": tokens, "ignore_eos": True}

    def one() -> None:
        httpx.post(url + "/v1/completions", json=body, timeout=120)

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    return threads


def test_agents_discover_the_model_and_gate_7_reads_the_real_gauges(
    fleet: Fleet, vllm_url: str, tmp_path: Path, stalls: Stalls
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "routing_policy:\n"
        "  exclude_if:\n"
        "    waiting_requests:\n"
        "      gt: 0\n"
        "  strategy: least-loaded\n"
        "  max_tries: 2\n"
    )
    router = fleet.router("--policy-file", str(policy), "--heartbeat-interval", "1s")
    a, b = _pair(fleet, router, vllm_url)
    for agent in (a, b):
        row = router.agent(agent.peer_id)
        assert row["metadata"]["model"] == SERVED and row["metadata"]["engine"] == "vllm"
        assert row["status"]["backend_healthy"] is True
    # The real `vllm:` gauges in the routing table: running, waiting, KV cache (a
    # fraction), preemptions.
    engine = wait_until(
        lambda: (e := router.agent(a.peer_id)["engine"])["kv_cache_utilization"] is not None and e,
        15,
        "engine gauges in the routing table",
    )
    assert engine["running_requests"] == 0 and engine["waiting_requests"] == 0, engine
    assert 0 <= engine["kv_cache_utilization"] <= 1, engine
    assert engine.get("preemptions_total") is not None, engine

    client = _client(router)
    assert client.chat.completions.create(model=SERVED, messages=HELLO, max_tokens=4).choices

    # 32 long requests against 4 sequences: 28 wait, and gate 7 excludes both agents.
    # Each is long (960 tokens, about 4 s on two cores) because vLLM's API server hands
    # requests to its engine only as fast as it gets CPU: on a busy host they trickled
    # in at 1 or 2 a second, and 480-token answers ended as fast, so none waited (seen
    # here: the engine's own gauge at 0 for 45 s, "Running: 1 reqs, Waiting: 0 reqs").
    seen: list[tuple] = []  # what the wait saw, for the failure's message

    def both_waiting() -> bool:
        try:
            rows = [router.agent(x.peer_id)["engine"] for x in (a, b)]
            engine_says = gauge(vllm_url, "vllm:num_requests_waiting")
        except (httpx.HTTPError, OSError) as exc:
            seen.append((round(time.monotonic() - started, 2), type(exc).__name__))
            raise
        seen.append(
            (
                round(time.monotonic() - started, 2),
                engine_says,
                *((r["waiting_requests"], r["age_seconds"]) for r in rows),
            )
        )
        return all((r["waiting_requests"] or 0) > 0 for r in rows)

    # Up to three loads: one whose waiting requests went unseen while the machine
    # stalled (bench/stalls.py; once the first reading came 19.6 s late,
    # the engine's own gauge at 0 from then on) is run again; one unseen without a
    # stall is the router's failure.
    missed = ""
    for _ in range(3):
        seen.clear()
        started = time.monotonic()
        threads = _load(vllm_url, 32, 960)
        try:
            try:
                wait_until(both_waiting, 45, "the engine's waiting requests in the routing table")
            except AssertionError as exc:
                stalled = stalls.during(started, time.monotonic())
                # (seconds, the engine's own gauge, (waiting, age) in each agent's row)
                missed = f"{exc}; seen: {seen[:: max(1, len(seen) // 40)]}; stalls: {stalled}"
                assert stalled, missed
                continue
            with pytest.raises(openai.APIStatusError) as refused:
                client.chat.completions.create(model=SERVED, messages=HELLO, max_tokens=4)
            assert refused.value.status_code == 503, refused.value
            assert "gate[7] exclude_if [waiting_requests=2]" in router.log()
            break
        finally:
            for t in threads:
                t.join(120)
    else:
        raise AssertionError(f"every load was missed during a stall of the machine: {missed}")
    # The load ends: admitted again.
    wait_until(
        lambda: all(router.agent(x.peer_id)["engine"]["waiting_requests"] == 0 for x in (a, b)),
        30,
        "the queue empty in the routing table",
    )
    answer = client.chat.completions.create(model=SERVED, messages=HELLO, max_tokens=4)
    assert answer.usage is not None and answer.usage.completion_tokens == 4


def test_chat_completions_and_count_tokens_with_the_engines_usage(
    fleet: Fleet, vllm_url: str
) -> None:
    router = fleet.router()
    _pair(fleet, router, vllm_url)
    client = _client(router)
    whole = client.chat.completions.create(
        model=SERVED, messages=HELLO, max_tokens=16, temperature=0
    )
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    prompt_tokens = whole.usage.prompt_tokens

    text, usage = "", []
    for chunk in client.chat.completions.create(
        model=SERVED,
        messages=HELLO,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        text += "".join(c.delta.content or "" for c in chunk.choices)
        if chunk.usage is not None and not chunk.choices:
            usage.append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens))
    assert text == whole.choices[0].message.content  # greedy: the same answer
    assert usage == [(prompt_tokens, 16)]

    done = client.completions.create(model=SERVED, prompt="hello there", max_tokens=8)
    assert done.usage is not None and done.usage.completion_tokens == 8
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=SERVED, prompt="hello there", max_tokens=8, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces)

    # count_tokens through the engine's /tokenize: what the engine then bills.
    counter = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    counted = counter.messages.count_tokens(model=SERVED, messages=HELLO)
    assert counted.input_tokens == prompt_tokens


class _Killer:
    """SIGKILLs `agent` when called."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def stop(self, sig: int) -> None:
        self.agent.stop(sig)


def _stream(router: Router, limit: int, kill: _Killer | None = None, after: int = 0) -> dict:
    """A greedy stream read whole through the raw SSE; `kill` is SIGKILLed once `after`
    content events have arrived. Returns its text, events and usage chunk."""
    body = {
        "model": SERVED,
        "messages": HELLO,
        "max_tokens": limit,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, chunks, content = "", [], 0
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            chunks.append(data)
            if data == "[DONE]":
                continue
            event = json.loads(data)
            assert "error" not in event, event
            for choice in event["choices"]:
                piece = choice["delta"].get("content") or ""
                text += piece
                content += bool(piece)
            if kill is not None and content == after:
                kill.stop(signal.SIGKILL)
                kill = None
    events = [json.loads(c) for c in chunks[:-1]]
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    assert len({(e["id"], e["created"], e["model"]) for e in events}) == 1
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    usage = [e["usage"] for e in events if not e["choices"]]
    assert len(finishes) == 1 and len(usage) == 1, (finishes, usage)
    return {"text": text, "finish": finishes[0], "usage": usage[0]}


def test_a_stream_continued_after_its_agent_is_killed_is_whole_and_adds_up(
    fleet: Fleet, vllm_url: str, tmp_path: Path
) -> None:
    router = fleet.router("--policy-file", first_then_any(tmp_path))
    _pair_one(fleet, router, vllm_url, "second")
    # About 1 s to generate on two cores, with room in the 1024-token context for the
    # continuation's prompt: the text sent, tokenized again, can take three times the
    # tokens that were generated (each U+FFFD is three bytes, each byte a token of the
    # tiny vocabulary), and a continuation past the context is refused (the stream then
    # ends with the error event, as one nobody can continue).
    limit = 300
    reference = _stream(router, limit, None)
    assert reference["finish"] == "length"
    assert reference["usage"]["completion_tokens"] == limit
    prompt = reference["usage"]["prompt_tokens"]

    same, runs, cut = 0, int(os.environ.get("HIVENET_CONTINUATION_RUNS", "3")), 0
    notes = []
    counter = "hivenet_router_stream_continuations_total"
    for run in range(runs):
        first = _pair_one(fleet, router, vllm_url, "first")
        before = router.metric(counter, outcome="continued")
        try:
            got = _stream(router, limit, _Killer(first), after=1 + run % 3)
        except AssertionError as exc:
            lines = [x for x in router.log().splitlines() if " stream_" in x]
            raise AssertionError(f"run {run}: {exc}\n" + "\n".join(lines[-5:])) from None
        assert not first.alive()
        usage = got["usage"]
        # Usage adds up: the prompt as the engine counted it, and every token sent.
        assert usage["prompt_tokens"] == prompt, usage
        assert usage["completion_tokens"] <= limit, usage
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if got["finish"] == "length":
            assert usage["completion_tokens"] == limit, usage
        if router.metric(counter, outcome="continued") == before:
            continue  # the whole answer had reached the router before the kill
        cut += 1
        if got["text"] == reference["text"]:
            same += 1
        else:
            at = _first_difference(got["text"], reference["text"])
            notes.append(
                f"run {run}: differs from character {at} of {len(reference['text'])}: "
                f"{got['text'][at - 10 : at + 20]!r} against "
                f"{reference['text'][at - 10 : at + 20]!r}"
            )
    # Most kills land mid-answer (after 1 to 3 events); one on a fast idle
    # machine can still come after the router had the whole answer.
    assert cut >= (runs + 1) // 2, (cut, runs)
    summary = (
        f"continuation on real vLLM: {cut} of {runs} streams cut and continued; "
        f"{same} of those {cut} spliced answers equal the greedy one"
    )
    print(summary, *notes, sep="\n")
    if REPORT:
        with open(REPORT, "a") as out:
            print(summary, *notes, sep="\n", file=out)


def test_a_continued_messages_stream_is_counted_by_the_engines_tokenizer(
    fleet: Fleet, vllm_url: str, tmp_path: Path
) -> None:
    """Anthropic's stream carries no running count; vLLM packs tokens into events: the
    router counts the text sent with vLLM's `/tokenize` before it continues, so
    `max_tokens` holds and the usage is the engine's."""
    router = fleet.router("--policy-file", first_then_any(tmp_path))
    _pair_one(fleet, router, vllm_url, "second")
    limit = 300
    reference = _messages_stream(router, limit, None)
    assert reference["stop"] == "max_tokens" and reference["output"] == limit, reference
    cut = 0
    for run in range(3):
        first = _pair_one(fleet, router, vllm_url, "first")
        before = router.metric("hivenet_router_stream_continuations_total", outcome="continued")
        got = _messages_stream(router, limit, first, after=1 + run)
        assert not first.alive()
        assert got["input"] == reference["input"], (got, reference)
        assert got["output"] <= limit, got
        if got["stop"] == "max_tokens":
            assert got["output"] == limit, got
        after = router.metric("hivenet_router_stream_continuations_total", outcome="continued")
        cut += after > before
        print(f"run {run}: continued {after > before}, {got['times']}")
    # As for chat: a kill can land after the router had the whole answer.
    assert cut >= 1, cut
    assert "stream_tokens_uncounted" not in router.log()


def _messages_stream(router: Router, limit: int, kill: Agent | None, after: int = 0) -> dict:
    body = {"model": SERVED, "messages": HELLO, "max_tokens": limit, "temperature": 0}
    return messages_stream(router.url, body, kill, after)


def _first_difference(a: str, b: str) -> int:
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


def _pair_one(fleet: Fleet, router: Router, url: str, region: str) -> Agent:
    return fleet.agent(
        router,
        "",
        *("--backend-url", url, "--engine-sample-interval", "200ms", "--capacity", "8"),
        *("--region", region),
        engine="vllm",
    )


@dataclass
class Left:
    """One stream left after its first chunk: the seconds from sending to that chunk
    and to the close, from the close until the engine's gauge said none run, the tokens
    the engine counted for it, and the request id it was sent with."""

    first: float
    open_for: float
    stopped: float
    tokens: float
    request_id: str


ASKED = 960


def _leave(base: str, vllm_url: str) -> Left:
    """A stream of ASKED tokens, closed as soon as its first chunk has come: nothing
    (no gauge read) between the two, so that a stall of the machine (bench/stalls.py)
    is unlikely to let the answer finish before the close."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    generated = gauge(vllm_url, "vllm:generation_tokens_total")
    request_id = str(uuid.uuid4())
    sent = time.monotonic()
    stream = client.chat.completions.create(
        model=SERVED,
        messages=HELLO,
        max_tokens=ASKED,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-ID": request_id},
    )
    next(iter(stream))
    first = time.monotonic() - sent
    stream.close()
    left = time.monotonic()
    wait_until(lambda: gauge(vllm_url, "vllm:num_requests_running") == 0, 5, "generation stopped")
    stopped = time.monotonic() - left
    time.sleep(1)
    tokens = gauge(vllm_url, "vllm:generation_tokens_total") - generated
    return Left(first, left - sent, stopped, tokens, request_id)


def _left_wrong(router: Router, routed: Left) -> str | None:
    """What is wrong with a routed stream the client left, or None."""
    if routed.first >= 1.0:
        # The first chunk came while the engine was generating, not at the answer's end.
        return f"the first chunk came after {routed.first:.2f} s"
    # The router saw the client leave and ended the request then (499), not at the
    # answer's end: its own part, read from its log.
    line = wait_until(lambda: _finished_line(router, routed.request_id), 5, "the request's end")
    duration = float(line.rpartition("duration_ms=")[2].split()[0]) / 1000
    if " status=499 " not in line or duration > routed.open_for + 0.5:
        return f"the router ended it so: {line}"
    # The agent's close of its engine call stopped the generation: vLLM's running
    # gauge fell to 0 within a second of the client's close (read every few tens of
    # milliseconds), short of the answer's end (a client that left direct got vLLM to
    # count 10 to 862 of the 960 tokens, in twelve runs).
    if routed.stopped >= 1.0:
        return f"the engine stopped {routed.stopped:.2f} s after the client left"
    if routed.tokens >= ASKED:
        return f"the engine generated all {routed.tokens:g} tokens"
    return None


def _long_turns(router: Router) -> dict[str, float]:
    """How many turns of the router's event loop ran past 0.25 s and 1 s (wall clock,
    its own histogram): for a failure's message, a loop held up shows there."""
    counts: dict[str, float] = {}
    for line in router.metrics().splitlines():
        if line.startswith("hivenet_router_event_loop_lag_seconds_"):
            name, _, value = line.rpartition(" ")
            counts[name.partition("_seconds_")[2]] = float(value)
    total = counts.get("count", 0.0)
    return {
        "turns": total,
        "over_0.25s": total - counts.get('bucket{le="0.25"}', total),
        "over_1s": total - counts.get('bucket{le="1.0"}', total),
    }


def _finished_line(router: Router, request_id: str) -> str | None:
    """The router's line for the request's end (its status and duration)."""
    for line in router.log().splitlines():
        if f"req={request_id} " in line and " status=" in line:
            return line
    return None


def test_a_client_that_leaves_stops_the_generation(
    fleet: Fleet, vllm_url: str, stalls: Stalls
) -> None:
    router = fleet.router()
    _pair(fleet, router, vllm_url)
    direct = _leave(vllm_url, vllm_url)
    tries: list[tuple[Left, str | None, list]] = []
    for _ in range(4):
        since = time.monotonic()
        routed = _leave(router.url, vllm_url)
        wrong = _left_wrong(router, routed)
        stalled = stalls.during(since, time.monotonic())
        tries.append((routed, wrong, stalled))
        # A try that went wrong while the machine stalled (bench/stalls.py)
        # is run again; one that went wrong without a stall is the router's failure.
        assert wrong is None or stalled, (wrong, tries, _long_turns(router))
        if wrong is None:
            break
    print(f"client left: direct {direct}, routed {tries}")
    assert wrong is None, ("every try went wrong during a stall of the machine", tries)


def test_prefix_aware_sends_a_prompt_back_to_the_engine_that_cached_it(
    fleet: Fleet, vllm_url: str, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("routing_policy:\n  strategy: prefix-aware\n")
    router = fleet.router("--policy-file", str(policy))
    a, b = _pair(fleet, router, vllm_url)
    client = _client(router)
    # About 300 tokens: two whole 128-token blocks the engine caches.
    rule = "route each request to the agent that knows it."
    system = " ".join(f"rule {i}: {rule}" for i in range(16))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
    before = gauge(vllm_url, "vllm:prefix_cache_hits_total")
    served = []
    for _ in range(3):
        client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2)
        served.append({x.peer_id: _served(router, x) for x in (a, b)})
    # One agent took all three: the prefix tree sent the prompt back where it went.
    last = served[-1]
    assert sorted(last.values()) == [0, 3], served
    hits = gauge(vllm_url, "vllm:prefix_cache_hits_total") - before
    assert hits >= 2 * 256, hits  # the second and third prompts hit 256 cached tokens


def _served(router: Router, agent: Agent) -> int:
    return int(router.agent(agent.peer_id)["universal"]["successful_requests_total"])


def test_engine_errors_reach_the_client_and_are_not_charged_to_the_agent(
    fleet: Fleet, vllm_url: str
) -> None:
    router = fleet.router()
    a, b = _pair(fleet, router, vllm_url)
    client = _client(router)
    messages = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    # A model no agent serves: 404 in each protocol. (An agent that announces a model
    # its engine lacks gets the engine's 404, which is that agent's fault: another
    # agent may serve the model, so it is a retried backend_error: docs/reference/errors.md.)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="not-served", messages=HELLO, max_tokens=4)
    assert "not-served" in str(missing.value)
    with pytest.raises(anthropic.NotFoundError):
        messages.messages.create(model="not-served", messages=HELLO, max_tokens=4)
    # More than the context: the engine's 400, in OpenAI's shape and in Anthropic's.
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model=SERVED, messages=HELLO, max_tokens=4096)
    assert "context" in str(long.value).lower() or "max" in str(long.value).lower()
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages.messages.create(model=SERVED, messages=HELLO, max_tokens=4096)
    assert refused.value.body["type"] == "error", refused.value.body
    for agent in (a, b):
        row = router.agent(agent.peer_id)
        assert row["status"]["healthy"] is True, row
        assert row["universal"]["consecutive_failures"] == 0, row
        assert row["universal"]["failed_requests_total"] == 0, row


def test_the_real_engine_benchmark_runs(vllm_url: str) -> None:
    """docs/benchmarks/real-engine.md's command, short: both paths answer, no errors."""
    argv = [sys.executable, "-m", "bench.real_engine", "--engine-url", vllm_url]
    argv += ["--model", SERVED, "--duration", "2", "--concurrency", "1,4", "--tokens", "16"]
    argv += ["--rounds", "2", "--router-cpus", "0", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert [row["concurrency"] for row in rows] == [1, 4], rows
    for row in rows:
        assert row["errors"] == 0, row
        assert row["direct_tokens_per_s"] > 0 and row["routed_tokens_per_s"] > 0, row
        # The seconds the machine stalled in each run, direct and routed.
        assert len(row["stalled_s"]) == 2 and min(row["stalled_s"]) >= 0, row
    # The page's other arrivals: clients spread over a stream's length, with pauses.
    argv[argv.index("--rounds") + 1] = "1"
    done = subprocess.run(
        [*argv, "--staggered", "--think", "0.02"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for row in json.loads(done.stdout):
        assert row["errors"] == 0, row
        assert row["direct_tokens_per_s"] > 0 and row["routed_tokens_per_s"] > 0, row
        assert all(ms > 0 for ms in row["ttft_ms"]["p50"]), row
