"""The official SDKs against real router and agent processes: every inference endpoint.

One router (client keys required, so the SDKs' own auth headers are what gets checked)
and three simulated agents: chat (`llm`), embeddings and rerank. Answers are compared
with what the sim engine computes for the same input.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from sim.openai import embedding
from tests.fleet import Agent, Fleet, Router, wait_until

CLIENT_KEY = "sdk-client-key"
TENANT = "sdk-tenant"
# A model name with a slash, as Hugging Face names are.
CHAT = "org/chat-model"
EMBED = "embed-model"
RERANK = "rerank-model"


class SdkFleet:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.router: Router = fleet.router(
            env={"HIVENET_ROUTER_API_KEYS": f"{CLIENT_KEY}:{TENANT}"}
        )
        self.chat: Agent = fleet.agent(self.router, CHAT, "--sim-token-latency", "5ms", wait=False)
        self.embed: Agent = fleet.agent(self.router, EMBED, "--capability", "embedding", wait=False)
        self.rerank: Agent = fleet.agent(
            self.router, RERANK, "--capability", "reranker", wait=False
        )
        fleet.join(self.chat, self.embed, self.rerank)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.router.url + "/v1", api_key=CLIENT_KEY, max_retries=0, timeout=30
        )

    def anthropic(self) -> anthropic.Anthropic:
        # The SDK appends /v1/messages itself and sends x-api-key and anthropic-version.
        return anthropic.Anthropic(
            base_url=self.router.url, api_key=CLIENT_KEY, max_retries=0, timeout=30
        )


@pytest.fixture(scope="module")
def sdk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SdkFleet]:
    fleet = Fleet(Path(tmp_path_factory.mktemp("sdk")))
    try:
        yield SdkFleet(fleet)
    finally:
        fleet.close()


def test_openai_chat_non_streaming(sdk: SdkFleet) -> None:
    raw = sdk.openai().chat.completions.with_raw_response.create(
        model=CHAT, messages=[{"role": "user", "content": "alpha beta gamma"}]
    )
    answer = raw.parse()
    assert answer.choices[0].message.content == "Echo: alpha beta gamma"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.model == CHAT
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (3, 4)
    uuid.UUID(raw.headers["x-request-id"])


def test_openai_chat_streaming(sdk: SdkFleet) -> None:
    words = " ".join(f"w{i}" for i in range(10))
    parts: list[str] = []
    finish = None
    usage = None
    stream = sdk.openai().chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": words}],
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert "".join(parts) == f"Echo: {words}"
    assert len(parts) == 11  # one chunk per token, relayed as they come
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == 11


def test_openai_chat_max_tokens_is_forwarded(sdk: SdkFleet) -> None:
    answer = sdk.openai().chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "one two three four"}], max_tokens=2
    )
    assert answer.choices[0].message.content == "Echo: one"
    assert answer.choices[0].finish_reason == "length"


def test_the_clients_headers_reach_the_engine_but_its_credentials(sdk: SdkFleet) -> None:
    """As upstream forwards them; the key for this router, hop-by-hop fields and content
    coding stay here, and the request id is the router's."""
    rid = str(uuid.uuid4())
    sdk.anthropic().messages.create(
        model=CHAT,
        max_tokens=8,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={
            "X-Custom-Tenant": "blue",
            "OpenAI-Organization": "org-7",
            "Cookie": "session=secret",
            "Accept-Encoding": "gzip",
            "X-Request-ID": rid,
        },
    )
    seen = sdk.chat.sim_state()["last_headers"]
    assert seen["x-custom-tenant"] == "blue" and seen["openai-organization"] == "org-7"
    assert seen["anthropic-version"] and seen["user-agent"].startswith("Anthropic/")
    assert seen["x-request-id"] == rid and seen["content-type"] == "application/json"
    for withheld in ("x-api-key", "authorization", "cookie", "accept-encoding"):
        assert withheld not in seen, seen
    assert CLIENT_KEY not in str(seen)


def test_anthropic_messages_non_streaming(sdk: SdkFleet) -> None:
    raw = sdk.anthropic().messages.with_raw_response.create(
        model=CHAT,
        max_tokens=64,
        system="be brief",
        messages=[{"role": "user", "content": "hello world"}],
    )
    message = raw.parse()
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == CHAT
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "Echo: hello world"
    assert message.stop_reason == "end_turn"
    # Prompt tokens count the system prompt too, as the sim does.
    assert (message.usage.input_tokens, message.usage.output_tokens) == (4, 3)
    uuid.UUID(raw.headers["x-request-id"])


def test_anthropic_messages_streaming(sdk: SdkFleet) -> None:
    events: list[str] = []
    with sdk.anthropic().messages.stream(
        model=CHAT, max_tokens=64, messages=[{"role": "user", "content": "one two three"}]
    ) as stream:
        text = ""
        for event in stream:
            events.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
        final = stream.get_final_message()
    assert text == "Echo: one two three"
    assert final.content[0].text == "Echo: one two three"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 4
    # The engine's events pass through in order.
    raw_types = [e for e in events if e != "text"]
    assert raw_types[0] == "message_start"
    assert raw_types[-1] == "message_stop"
    assert raw_types.count("content_block_delta") == 4
    assert "message_delta" in raw_types


def test_anthropic_messages_max_tokens_stop_reason(sdk: SdkFleet) -> None:
    message = sdk.anthropic().messages.create(
        model=CHAT, max_tokens=2, messages=[{"role": "user", "content": "a b c d e"}]
    )
    assert message.content[0].text == "Echo: a"
    assert message.stop_reason == "max_tokens"


def test_the_anthropic_sdk_reads_the_request_id(sdk: SdkFleet) -> None:
    """Anthropic's header is `request-id`, the only one its SDK reads: without it a
    caller has no ID to find the router's log lines with."""
    client = sdk.anthropic()
    hello: Any = [{"role": "user", "content": "hello"}]
    given = str(uuid.uuid4())
    raw = client.messages.with_raw_response.create(
        model=CHAT, max_tokens=8, messages=hello, extra_headers={"x-request-id": given}
    )
    assert raw.request_id == raw.headers["x-request-id"] == given
    assert raw.parse()._request_id == given
    with client.messages.stream(model=CHAT, max_tokens=8, messages=hello) as stream:
        stream.get_final_message()
        uuid.UUID(stream.request_id or "")
        assert stream.request_id == stream.response.headers["x-request-id"]
    counted = client.messages.with_raw_response.count_tokens(model=CHAT, messages=hello)
    assert counted.request_id == counted.headers["x-request-id"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="absent", max_tokens=8, messages=hello)
    assert missing.value.request_id == missing.value.response.headers["x-request-id"]
    assert missing.value.request_id is not None


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, abs_tol=1e-6) for x, y in zip(a, b, strict=True)
    )


def test_openai_embeddings(sdk: SdkFleet) -> None:
    client = sdk.openai()
    # Left unset, the SDK asks for base64 and decodes it itself; floats when asked.
    for extra in ({}, {"encoding_format": "float"}):
        result = client.embeddings.create(model=EMBED, input=["first text", "second"], **extra)
        assert result.model == EMBED
        assert [d.index for d in result.data] == [0, 1]
        assert _close(result.data[0].embedding, embedding(b"first text", 8))
        assert _close(result.data[1].embedding, embedding(b"second", 8))
        assert result.usage.prompt_tokens == 3
    sized = client.embeddings.create(model=EMBED, input="x", dimensions=16, encoding_format="float")
    assert _close(sized.data[0].embedding, embedding(b"x", 16))


def test_rerank_with_httpx(sdk: SdkFleet) -> None:
    # The openai SDK has no rerank call; this is vLLM's /v1/rerank shape.
    r = httpx.post(
        sdk.router.url + "/v1/rerank",
        headers={"Authorization": f"Bearer {CLIENT_KEY}"},
        json={
            "model": RERANK,
            "query": "red fox",
            "documents": ["a red fox", "blue sky", {"text": "Fox"}],
            "top_n": 2,
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == RERANK
    assert [(x["index"], x["relevance_score"]) for x in body["results"]] == [(0, 1.0), (2, 0.5)]
    assert body["results"][0]["document"] == {"text": "a red fox"}


def test_models_through_the_openai_sdk(sdk: SdkFleet) -> None:
    client = sdk.openai()
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {CHAT, EMBED, RERANK}
    card = client.models.retrieve(CHAT)  # a slash in the name: /v1/models/org/chat-model
    assert card.id == CHAT
    extra = card.model_extra or {}
    assert extra["capability"] == "llm"
    assert extra["agents"]["total"] == 1
    assert extra["agents"]["engines"] == ["sim"]
    assert (models[EMBED].model_extra or {})["capability"] == "embedding"
    assert (models[RERANK].model_extra or {})["capability"] == "reranker"


def test_sdk_requests_are_counted_under_the_key_tenant(sdk: SdkFleet) -> None:
    sdk.openai().chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "x"}])
    sdk.anthropic().messages.create(
        model=CHAT, max_tokens=8, messages=[{"role": "user", "content": "x"}]
    )
    router = sdk.router
    for endpoint in ("/v1/chat/completions", "/v1/messages"):
        wait_until(
            lambda e=endpoint: (
                router.metric(
                    "hivenet_router_http_requests_total", endpoint=e, status="200", tenant=TENANT
                )
                >= 1
            ),
            10,
            f"{endpoint} counted for {TENANT}",
        )
    assert f"tenant={TENANT}" in router.log()
    # Every answer released its slot.
    wait_until(
        lambda: all(a["status"]["active_requests"] == 0 for a in router.agents()),
        10,
        "slots released",
    )
