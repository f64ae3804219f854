"""The agent against a real llama.cpp `llama-server` (opt-in: `scripts/test --real-engines`).

`scripts/real-engines` builds the server and writes a tiny random-weight model; this
checks what the simulated engine can only imitate: health, model discovery, the metric
names the gates read, and chat answers end to end through router and agent, including
the agent's check of each answer (agent/answers.py) on the engine's real stream.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.fleet import Fleet, Proc, free_port, wait_until

ALIAS = "tiny-llama"


@pytest.fixture(scope="module")
def llama_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = Path(tmp_path_factory.mktemp("llama")) / "llama-server.log"
    argv = [
        os.environ["HIVENET_LLAMA_SERVER"],
        *("--model", os.environ["HIVENET_TINY_GGUF"], "--alias", ALIAS),
        *("--host", "127.0.0.1", "--port", str(port), "--metrics"),
        *("--ctx-size", "1024", "--parallel", "2", "--threads", "2"),
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
