"""The agent against a real llama.cpp `llama-server` (opt-in: `scripts/test --real-engines`).

`scripts/real-engines` builds the server and writes a tiny random-weight model; this
checks what the simulated engine can only imitate: health, model discovery, the metric
names the gates read, and chat answers end to end through router and agent, including
the agent's check of each answer (agent/answers.py) on the engine's real stream.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.fleet import Agent, Fleet, Proc, Router, free_port, wait_until
from tests.real_engines.vllm_server import first_then_any, gauge, messages_stream

ALIAS = "tiny-llama"


@pytest.fixture(scope="module")
def llama_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = Path(tmp_path_factory.mktemp("llama")) / "llama-server.log"
    argv = [
        os.environ["HIVENET_LLAMA_SERVER"],
        *("--model", os.environ["HIVENET_TINY_GGUF"], "--alias", ALIAS),
        *("--host", "127.0.0.1", "--port", str(port), "--metrics"),
        # Two slots of 1,024 tokens: room for a continuation's prompt, which holds the
        # text sent (a random-weight model's text can tokenize to more tokens again).
        *("--ctx-size", "2048", "--parallel", "2", "--threads", "2"),
    ]
    server = Proc("llama-server", argv, dict(os.environ), log).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: httpx.get(url + "/health", timeout=5).status_code == 200,
            120,
            "llama-server healthy",
        )
        yield url
    finally:
        server.stop()


def test_agent_serves_a_real_llama_server(fleet: Fleet, llama_url: str) -> None:
    # The metric names the agent maps onto the gates' fields (agent/engines/llamacpp.py).
    metrics = httpx.get(llama_url + "/metrics", timeout=10).text
    for name in ("llamacpp:requests_processing", "llamacpp:requests_deferred"):
        assert f"\n{name} " in metrics, name

    router = fleet.router()
    # No --model: the agent discovers it from the engine's /v1/models.
    agent = fleet.agent(
        router,
        "",
        "--backend-url",
        llama_url,
        "--engine-sample-interval",
        "200ms",
        engine="llamacpp",
    )
    row = router.wait_agent(agent.peer_id)
    assert row["metadata"]["model"] == ALIAS
    assert row["metadata"]["engine"] == "llamacpp"
    assert row["status"]["backend_healthy"] is True
    engine = wait_until(
        lambda: (e := router.agent(agent.peer_id)["engine"])["running_requests"] is not None and e,
        15,
        "engine metrics in the routing table",
    )
    assert engine["running_requests"] == 0 and engine["waiting_requests"] == 0
    # llama.cpp reports no latency histograms: those fields are unknown, never zero.
    assert engine["avg_ttft_seconds"] is None and engine["p90_itl_seconds"] is None

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello router"}]
    answer = client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=8)
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 8

    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=ALIAS, messages=messages, max_tokens=8, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces)

    # The raw stream as the client gets it: whole events, every one JSON, then [DONE].
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={"model": ALIAS, "messages": messages, "max_tokens": 8, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = [e for e in text.replace("\r\n", "\n").split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        data = "\n".join(
            line[len("data:") :].strip() for line in event.split("\n") if line.startswith("data:")
        )
        assert "error" not in json.loads(data), event

    wait_until(
        lambda: router.agent(agent.peer_id)["status"]["active_requests"] == 0, 10, "slots free"
    )
    assert "malformed_answer" not in agent.log()


def test_anthropic_messages_through_a_real_llama_server(fleet: Fleet, llama_url: str) -> None:
    router = fleet.router()
    agent = fleet.agent(router, ALIAS, "--backend-url", llama_url, engine="llamacpp")
    client = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello agent"}]
    answer = client.messages.create(model=ALIAS, max_tokens=8, messages=messages)
    assert answer.type == "message" and answer.usage.output_tokens >= 1
    with client.messages.stream(model=ALIAS, max_tokens=8, messages=messages) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens >= 1
    assert "malformed_answer" not in agent.log()


def _agent(fleet: Fleet, router: Router, url: str, region: str = "any") -> Agent:
    return fleet.agent(
        router,
        ALIAS,
        *("--backend-url", url, "--engine-sample-interval", "200ms", "--region", region),
        engine="llamacpp",
    )


def _greedy(limit: int) -> dict:
    """The body both APIs' checks send: `limit` greedy tokens, the end of text ignored."""
    return {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": limit,
        "temperature": 0,
        "ignore_eos": True,
    }


def _stream(router: Router, limit: int, kill: Agent | None = None, after: int = 0) -> dict:
    """A greedy chat stream through the raw SSE, every event checked; `kill` is
    SIGKILLed once `after` content events have arrived."""
    body = {**_greedy(limit), "stream": True, "stream_options": {"include_usage": True}}
    out: dict = {"text": "", "finish": None, "usage": None, "done": 0}
    content = 0
    url = router.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] += 1
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            out["usage"] = event.get("usage") or out["usage"]
            for choice in event["choices"]:
                piece = choice["delta"].get("content") or ""
                out["text"] += piece
                content += bool(piece)
                out["finish"] = choice.get("finish_reason") or out["finish"]
            if kill is not None and content == after:
                kill.stop(signal.SIGKILL)
    return out


def test_a_stream_continued_after_its_agent_is_killed_adds_up(
    fleet: Fleet, llama_url: str, tmp_path: Path
) -> None:
    """llama.cpp continues an assistant turn as a prefill: the client's stream, whose
    agent is SIGKILLed mid-answer, is whole and well formed, and its usage adds up."""
    router = fleet.router("--policy-file", first_then_any(tmp_path))
    _agent(fleet, router, llama_url, "second")
    limit = 300
    reference = _stream(router, limit)
    assert reference["finish"] == "length" and reference["done"] == 1, reference
    assert reference["usage"]["completion_tokens"] == limit, reference["usage"]
    runs = _killed(
        fleet, router, llama_url, lambda kill, after: _stream(router, limit, kill, after)
    )
    for got, _ in runs:
        assert got["done"] == 1 and got["finish"] == "length", got
        usage = got["usage"]
        # The client's prompt as llama.cpp counted it in the first part's `timings`
        # (the agent asks for `timings_per_token`), not the continuation's, which holds
        # the text sent tokenized again (12 tokens more in one run here).
        assert usage["prompt_tokens"] == reference["usage"]["prompt_tokens"], usage
        assert usage["completion_tokens"] == limit, usage
        assert usage["total_tokens"] == usage["prompt_tokens"] + limit, usage


def _killed(
    fleet: Fleet, router: Router, url: str, stream: Callable[[Agent, int], dict]
) -> list[tuple[dict, bool]]:
    """Three streams (`stream(agent, after)`), each on a new agent of the `first` region
    SIGKILLed after 1, 2, then 3 content events; each outcome and whether the router
    continued it. A kill can land after the router had the whole answer; most land
    mid-answer, and one at least must have been continued."""
    counter = "hivenet_router_stream_continuations_total"
    runs = []
    for run in range(3):
        first = _agent(fleet, router, url, "first")
        before = router.metric(counter, outcome="continued")
        got = stream(first, 1 + run)
        assert not first.alive()
        runs.append((got, router.metric(counter, outcome="continued") > before))
    assert any(continued for _, continued in runs), router.log()[-3000:]
    return runs


def test_a_client_that_leaves_stops_the_generation(fleet: Fleet, llama_url: str) -> None:
    router = fleet.router()
    _agent(fleet, router, llama_url)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    predicted = gauge(llama_url, "llamacpp:tokens_predicted_total")
    stream = client.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=900,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    left = time.monotonic()
    wait_until(
        lambda: gauge(llama_url, "llamacpp:requests_processing") == 0, 5, "generation stopped"
    )
    stopped = time.monotonic() - left
    time.sleep(1)
    tokens = gauge(llama_url, "llamacpp:tokens_predicted_total") - predicted
    # Stopped within a second, not finished: fewer than the 900 tokens asked for.
    assert stopped < 1.0, stopped
    assert tokens < 900, tokens


def test_engine_errors_reach_the_client_and_are_not_charged(fleet: Fleet, llama_url: str) -> None:
    router = fleet.router()
    agent = _agent(fleet, router, llama_url)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    messages = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    # More than a slot's context: llama.cpp's 400, in each client's protocol.
    long = [{"role": "user", "content": "hello " * 3000}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=ALIAS, messages=long, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages.messages.create(model=ALIAS, messages=long, max_tokens=4)
    assert refused.value.body["type"] == "error", refused.value.body
    row = router.agent(agent.peer_id)
    assert row["status"]["healthy"] is True, row
    assert row["universal"]["consecutive_failures"] == 0, row
    assert row["universal"]["failed_requests_total"] == 0, row


def test_llama_cpps_tokenizer_counts_prompts_and_continued_messages_streams(
    fleet: Fleet, llama_url: str, tmp_path: Path
) -> None:
    """llama-server's `/tokenize` takes `content` and answers the ids: count_tokens is
    its count of the conversation as its own `/apply-template` makes it the prompt,
    what a chat request of it is billed (`prompt_tokens`), and a `/v1/messages` stream
    (no running count in its events) whose agent is SIGKILLed is counted by it before
    it is continued, so `max_tokens` holds."""
    router = fleet.router("--policy-file", first_then_any(tmp_path))
    _agent(fleet, router, llama_url, "second")
    claude = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    hello = [{"role": "user", "content": "hello there"}]
    counted = claude.messages.count_tokens(
        model=ALIAS, system="be brief", messages=hello
    ).input_tokens
    chat = [{"role": "system", "content": "be brief"}, *hello]
    billed = httpx.post(
        llama_url + "/v1/chat/completions", json={"messages": chat, "max_tokens": 1}, timeout=30
    ).json()["usage"]["prompt_tokens"]
    text = httpx.post(
        llama_url + "/tokenize",
        json={"content": "be brief\nhello there", "add_special": True},
        timeout=10,
    ).json()["tokens"]
    # The template's tokens are counted: more than the text's alone.
    assert counted == billed > len(text), (counted, billed, text)
    limit = 300
    runs = _killed(
        fleet, router, llama_url, lambda kill, after: _messages_stream(router, limit, kill, after)
    )
    for got, _ in runs:
        assert got["output"] is not None and got["output"] <= limit, got
        if got["stop"] == "max_tokens":
            assert got["output"] == limit, got
    log = router.log()
    assert log.count("stream_tokens_counted") == sum(c for _, c in runs), log[-3000:]
    assert "stream_tokens_uncounted" not in log


def _messages_stream(router: Router, limit: int, kill: Agent, after: int) -> dict:
    return messages_stream(router.url, _greedy(limit), kill, after)
