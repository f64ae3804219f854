"""Provider fallback: OpenAI <-> Anthropic translation, the SSE replay, and
ProviderClient against local fake providers (tests/provider_fakes.py)."""

from __future__ import annotations

import json
import socket
from typing import Any

import anthropic as anthropic_sdk
import httpx2
import openai as openai_sdk
import pytest
import trio
from openai.types.chat import ChatCompletionChunk

from protocol.errors import ErrorCode, RouterError
from router.policy.schema import ProviderFallback
from router.providers import SERVED_BY_HEADER, ProviderClient
from router.providers.anthropic import (
    DEFAULT_MAX_TOKENS,
    completion_from_message,
    messages_request,
)
from router.providers.anthropic_stream import AnthropicToOpenAI
from router.providers.events import (
    MAX_EVENT_BYTES,
    MAX_KIND,
    EventParser,
    PassThrough,
    ProviderErrorEvent,
    check_error_event,
)
from router.providers.messages import OpenAIToAnthropic
from router.providers.openai import request as openai_request
from router.session import RouteRequest
from tests.provider_fakes import FakeAnthropic, FakeOpenAI

OPENAI_KEY = "sk-test-openai"
ANTHROPIC_KEY = "sk-ant-test"
CLAUDE = ProviderFallback(engine="anthropic", model="claude-test-1")
GPT = ProviderFallback(engine="openai", model="gpt-test-mini")
HELLO = [{"role": "user", "content": "hello"}]


def route_request(payload: dict[str, Any]) -> RouteRequest:
    return RouteRequest(
        request_id="00000000-0000-4000-8000-000000000001",
        model=payload.get("model", "local-model"),
        capability="llm",
        tenant="default",
        method="POST",
        path="/v1/chat/completions",
        headers={"content-type": "application/json"},
        body=json.dumps(payload).encode(),
        stream=bool(payload.get("stream")),
        payload=payload,
    )


def sdk_chunks(body: bytes) -> list[ChatCompletionChunk]:
    """The chunks the official openai SDK reads from an SSE body."""
    return list(_sdk(body).chat.completions.create(model="m", messages=HELLO, stream=True))


def sdk_final(body: bytes) -> Any:
    """The completion the openai SDK's stream helper assembles from an SSE body."""
    with _sdk(body).chat.completions.stream(model="m", messages=HELLO) as stream:
        return stream.get_final_completion()


def _sdk(body: bytes) -> openai_sdk.OpenAI:
    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    transport = httpx2.MockTransport(answer)
    return openai_sdk.OpenAI(
        api_key="unused",
        base_url="http://provider.invalid/v1",
        http_client=httpx2.Client(transport=transport),
    )


def refused_field(exc: pytest.ExceptionInfo[RouterError]) -> str:
    err = exc.value
    assert err.code is ErrorCode.INVALID_PARAMETER
    assert err.source == "router"
    suffix = " is not supported by the anthropic provider fallback"
    assert err.message.endswith(suffix), err.message
    return err.message.removesuffix(suffix)


# OpenAI request ---------------------------------------------------------------------


def test_openai_request_replaces_model_and_sets_streaming() -> None:
    payload = {
        "model": "local-model",
        "messages": HELLO,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 1.5,
        "seed": 7,
    }
    body = openai_request(payload, "gpt-test-mini", "/v1/chat/completions", False)
    assert body == {
        "model": "gpt-test-mini",
        "messages": HELLO,
        "stream": False,
        "temperature": 1.5,
        "seed": 7,
    }
    assert payload["model"] == "local-model"  # the client's payload is left alone
    # A stream is asked for its usage chunk (the tenant's quota needs it).
    plain = {"model": "m", "messages": HELLO, "stream_options": {"other": 1}}
    streamed = openai_request(plain, "gpt-test-mini", "/v1/chat/completions", True)
    assert streamed["stream"] is True
    assert streamed["stream_options"] == {"other": 1, "include_usage": True}
    # The Responses API has no stream_options: its usage is in response.completed.
    answer = openai_request({"model": "m", "input": "x"}, "gpt-test-mini", "/v1/responses", True)
    assert answer == {"model": "gpt-test-mini", "input": "x", "stream": True}


# Anthropic request ------------------------------------------------------------------


def test_system_and_developer_messages_become_top_level_system() -> None:
    body = messages_request(
        {
            "model": "local-model",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]},
                {"role": "user", "content": "hello"},
            ],
        },
        "claude-test-1",
    )
    assert body == {
        "model": "claude-test-1",
        "max_tokens": DEFAULT_MAX_TOKENS,
        "system": "Be brief.\n\nAnswer in French.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
    }


def test_roles_and_content_parts() -> None:
    body = messages_request(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "c"},
                {"role": "user", "content": "d", "name": "alice"},
                {"role": "user", "content": "e"},
            ]
        },
        "claude-test-1",
    )
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}]},
        # Anthropic wants alternating turns: consecutive user messages merge.
        {"role": "user", "content": [{"type": "text", "text": "d"}, {"type": "text", "text": "e"}]},
    ]
    assert "system" not in body


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, DEFAULT_MAX_TOKENS),
        ({"max_tokens": 100}, 100),
        ({"max_completion_tokens": 200}, 200),
        ({"max_tokens": 100, "max_completion_tokens": 200}, 200),
        ({"max_tokens": None}, DEFAULT_MAX_TOKENS),
    ],
)
def test_max_tokens(fields: dict[str, Any], expected: int) -> None:
    assert messages_request({"messages": HELLO, **fields}, "c")["max_tokens"] == expected


@pytest.mark.parametrize("value", [0, -1, "100", 1.5, True])
def test_max_tokens_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(RouterError) as exc:
        messages_request({"messages": HELLO, "max_tokens": value}, "c")
    assert exc.value.code is ErrorCode.INVALID_PARAMETER


@pytest.mark.parametrize(
    ("stop", "expected"),
    [("END", ["END"]), (["a", "b"], ["a", "b"]), ([], None)],
)
def test_stop_becomes_stop_sequences(stop: object, expected: list[str] | None) -> None:
    body = messages_request({"messages": HELLO, "stop": stop}, "c")
    assert body.get("stop_sequences") == expected


def test_sampling_and_user() -> None:
    body = messages_request(
        {"messages": HELLO, "temperature": 0.3, "top_p": 0.9, "user": "u-42"}, "c"
    )
    assert body["temperature"] == 0.3
    assert body["top_p"] == 0.9
    assert body["metadata"] == {"user_id": "u-42"}


def test_temperature_above_anthropic_range_is_refused() -> None:
    with pytest.raises(RouterError) as exc:
        messages_request({"messages": HELLO, "temperature": 1.5}, "c")
    assert refused_field(exc) == "temperature above 1"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tools() -> None:
    bare = {"type": "function", "function": {"name": "now"}}
    body = messages_request({"messages": HELLO, "tools": [WEATHER_TOOL, bare]}, "c")
    assert body["tools"] == [
        {
            "name": "weather",
            "description": "Weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
        {"name": "now", "input_schema": {"type": "object", "properties": {}}},
    ]
    assert "tool_choice" not in body


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("auto", {"type": "auto"}),
        ("none", {"type": "none"}),
        ("required", {"type": "any"}),
        (
            {"type": "function", "function": {"name": "weather"}},
            {"type": "tool", "name": "weather"},
        ),
    ],
)
def test_tool_choice(choice: object, expected: dict[str, Any]) -> None:
    body = messages_request(
        {"messages": HELLO, "tools": [WEATHER_TOOL], "tool_choice": choice}, "c"
    )
    assert body["tool_choice"] == expected


def test_tool_choice_without_tools_is_left_out() -> None:
    assert "tool_choice" not in messages_request({"messages": HELLO, "tool_choice": "none"}, "c")


def test_parallel_tool_calls_false_disables_parallel_tool_use() -> None:
    body = messages_request(
        {"messages": HELLO, "tools": [WEATHER_TOOL], "parallel_tool_calls": False}, "c"
    )
    assert body["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    body = messages_request(
        {
            "messages": HELLO,
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
        "c",
    )
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}


def test_tool_calls_and_tool_results() -> None:
    body = messages_request(
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {
                    "role": "tool",
                    "tool_call_id": "call_2",
                    "content": [{"type": "text", "text": "rain"}],
                },
                {"role": "user", "content": "Thanks"},
            ],
            "tools": [WEATHER_TOOL],
        },
        "c",
    )
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "call_2", "name": "weather", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "call_2", "content": "rain"},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]


def test_tool_call_arguments_must_be_a_json_object() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
    messages = [*HELLO, {"role": "assistant", "tool_calls": [call]}]
    with pytest.raises(RouterError) as exc:
        messages_request({"messages": messages}, "c")
    assert exc.value.code is ErrorCode.INVALID_PARAMETER
    assert "arguments" in exc.value.message


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"seed": 1}, "seed"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"top_k": 40}, "top_k"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type 'custom'"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
            "tools[0].function.strict",
        ),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "allowed_tools"}},
            "tool_choice 'allowed_tools'",
        ),
    ],
)
def test_fields_the_adapter_cannot_carry_are_refused(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(RouterError) as exc:
        messages_request({"messages": HELLO, **fields}, "c")
    assert refused_field(exc) == field


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}],
            },
            "image content (messages[0].content[0])",
        ),
        (
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "listen"},
                    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                ],
            },
            "audio content (messages[0].content[1])",
        ),
        (
            {"role": "user", "content": [{"type": "file", "file": {}}]},
            "file content (messages[0].content[0])",
        ),
        ({"role": "function", "name": "f", "content": "1"}, "messages[0].role 'function'"),
        ({"role": "assistant", "content": "x", "audio": {"id": "a1"}}, "messages[0].audio"),
    ],
)
def test_message_content_the_adapter_cannot_carry_is_refused(
    message: dict[str, Any], field: str
) -> None:
    with pytest.raises(RouterError) as exc:
        messages_request({"messages": [message]}, "c")
    assert refused_field(exc) == field


def test_no_op_values_and_router_owned_fields_are_accepted() -> None:
    body = messages_request(
        {
            "model": "local-model",
            "messages": HELLO,
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "logprobs": False,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
            "response_format": {"type": "text"},
            "modalities": ["text"],
            "store": False,
            "metadata": {"team": "a"},
            "service_tier": "auto",
            "seed": None,
            "top_logprobs": None,
        },
        "claude-test-1",
    )
    assert body == {
        "model": "claude-test-1",
        "max_tokens": DEFAULT_MAX_TOKENS,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
    }


@pytest.mark.parametrize("messages", [None, [], "hello"])
def test_messages_are_required(messages: object) -> None:
    with pytest.raises(RouterError) as exc:
        messages_request({"messages": messages}, "c")
    assert exc.value.code is ErrorCode.REQUEST_INVALID


# Anthropic answer -------------------------------------------------------------------


def anthropic_message(content: list[dict[str, Any]], stop_reason: str) -> dict[str, Any]:
    return {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-test-1-20250101",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 5},
    }


def test_answer_text_and_usage() -> None:
    answer = anthropic_message(
        [{"type": "text", "text": "Hello"}, {"type": "text", "text": " world"}], "end_turn"
    )
    completion = completion_from_message(answer, "claude-test-1")
    assert completion["id"] == "msg_01"
    assert completion["object"] == "chat.completion"
    assert isinstance(completion["created"], int)
    assert completion["model"] == "claude-test-1-20250101"
    assert completion["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello world", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert completion["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 5,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_answer_cached_prompt_tokens_count_as_prompt_tokens() -> None:
    answer = anthropic_message([{"type": "text", "text": "x"}], "end_turn")
    answer["usage"] = {
        "input_tokens": 10,
        "cache_creation_input_tokens": 3,
        "cache_read_input_tokens": 100,
        "output_tokens": 2,
    }
    usage = completion_from_message(answer, "c")["usage"]
    assert usage["prompt_tokens"] == 113
    assert usage["total_tokens"] == 115
    assert usage["prompt_tokens_details"] == {"cached_tokens": 100}


def test_answer_tool_use_becomes_tool_calls() -> None:
    answer = anthropic_message(
        [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
        ],
        "tool_use",
    )
    choice = completion_from_message(answer, "c")["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    [call] = choice["message"]["tool_calls"]
    assert call["id"] == "toolu_1"
    assert call["type"] == "function"
    assert call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_answer_with_only_tool_use_has_null_content() -> None:
    answer = anthropic_message(
        [{"type": "tool_use", "id": "toolu_1", "name": "now", "input": {}}], "tool_use"
    )
    message = completion_from_message(answer, "c")["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"][0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize(
    ("stop_reason", "finish_reason"),
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("refusal", "content_filter"),
    ],
)
def test_finish_reasons(stop_reason: str, finish_reason: str) -> None:
    answer = anthropic_message([{"type": "text", "text": "x"}], stop_reason)
    assert completion_from_message(answer, "c")["choices"][0]["finish_reason"] == finish_reason


@pytest.mark.parametrize(
    "answer",
    [[], {"id": "msg"}, {"content": "text"}, {"content": [{"type": "text"}]}, {"content": [1]}],
)
def test_malformed_answers(answer: object) -> None:
    with pytest.raises(ValueError):
        completion_from_message(answer, "c")


# SSE replay -------------------------------------------------------------------------


def completion(message: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "gpt-test-mini",
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    }


# ProviderClient against the fakes ---------------------------------------------------


@pytest.fixture
async def openai_fake(nursery: trio.Nursery) -> FakeOpenAI:
    fake = FakeOpenAI(OPENAI_KEY)
    await nursery.start(fake.serve)
    return fake


@pytest.fixture
async def anthropic_fake(nursery: trio.Nursery) -> FakeAnthropic:
    fake = FakeAnthropic(ANTHROPIC_KEY)
    await nursery.start(fake.serve)
    return fake


def client_for(
    openai_fake: FakeOpenAI | None = None,
    anthropic_fake: FakeAnthropic | None = None,
    timeout: float = 10.0,
) -> ProviderClient:
    return ProviderClient(
        openai_api_key=OPENAI_KEY if openai_fake else "",
        anthropic_api_key=ANTHROPIC_KEY if anthropic_fake else "",
        openai_base_url=openai_fake.base_url if openai_fake else "http://unused.invalid/v1",
        anthropic_base_url=anthropic_fake.base_url if anthropic_fake else "http://unused.invalid",
        timeout=timeout,
    )


async def call(client: ProviderClient, provider: ProviderFallback, payload: dict[str, Any]) -> Any:
    try:
        return await client(provider, route_request(payload))
    finally:
        await client.aclose()


async def call_streaming(
    client: ProviderClient, provider: ProviderFallback, payload: dict[str, Any], path: str = ""
) -> tuple[Any, bytes]:
    """The served answer and every byte of its stream, read to the end."""
    try:
        req = route_request(payload)
        if path:
            req.path = path
        served = await client(provider, req)
        assert served.stream is not None
        body = served.body
        try:
            while (chunk := await served.stream.next()) is not None:
                body += chunk
        finally:
            await served.stream.aclose()
        return served, body
    finally:
        await client.aclose()


def test_available_follows_the_configured_keys() -> None:
    client = ProviderClient(openai_api_key="sk", anthropic_api_key="")
    assert client.available("openai")
    assert not client.available("anthropic")
    assert not client.available("mistral")


async def test_unconfigured_engine_is_an_error() -> None:
    client = ProviderClient(openai_api_key="sk", anthropic_api_key="")
    with pytest.raises(RouterError) as exc:
        await call(client, CLAUDE, {"model": "m", "messages": HELLO})
    assert exc.value.code is ErrorCode.BACKEND_ERROR


async def test_openai_non_streaming(openai_fake: FakeOpenAI) -> None:
    payload = {"model": "local-model", "messages": HELLO, "temperature": 0.2}
    served = await call(client_for(openai_fake), GPT, payload)
    [got] = openai_fake.requests
    assert got.headers["authorization"] == f"Bearer {OPENAI_KEY}"
    assert got.body == {
        "model": "gpt-test-mini",
        "messages": HELLO,
        "temperature": 0.2,
        "stream": False,
    }
    assert served.status == 200
    assert served.engine == "openai"
    assert served.content_type == "application/json"
    assert served.headers[SERVED_BY_HEADER] == "provider:openai"
    answer = json.loads(served.body)
    assert answer["model"] == "gpt-test-mini"
    assert answer["choices"][0]["message"]["content"] == "echo: hello"
    assert answer["processed_by"] == "provider:openai"  # upstream's mark in the body


async def test_openai_streaming_client(openai_fake: FakeOpenAI) -> None:
    payload = {
        "model": "local-model",
        "messages": HELLO,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    served, body = await call_streaming(client_for(openai_fake), GPT, payload)
    [got] = openai_fake.requests
    assert got.body["stream"] is True
    assert got.body["stream_options"] == {"include_usage": True}
    assert served.content_type == "text/event-stream"
    assert served.headers[SERVED_BY_HEADER] == "provider:openai"
    chunks = sdk_chunks(body)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo: hello"
    assert chunks[-1].usage is not None
    assert chunks[-1].model == "gpt-test-mini"


async def test_anthropic_non_streaming(anthropic_fake: FakeAnthropic) -> None:
    payload = {
        "model": "local-model",
        "messages": [{"role": "system", "content": "Be brief."}, *HELLO],
        "max_tokens": 64,
        "stop": "END",
    }
    served = await call(client_for(anthropic_fake=anthropic_fake), CLAUDE, payload)
    [got] = anthropic_fake.requests
    assert got.path == "/v1/messages"
    assert got.headers["x-api-key"] == ANTHROPIC_KEY
    assert got.headers["anthropic-version"] == "2023-06-01"
    assert got.headers["content-type"] == "application/json"
    assert got.body == {
        "model": "claude-test-1",
        "max_tokens": 64,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "stop_sequences": ["END"],
    }
    assert served.content_type == "application/json"
    assert served.engine == "anthropic"
    assert served.headers[SERVED_BY_HEADER] == "provider:anthropic"
    answer = json.loads(served.body)
    assert answer["object"] == "chat.completion"
    assert answer["model"] == "claude-test-1"
    assert answer["choices"][0]["message"]["content"] == "echo: hello"
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["processed_by"] == "provider:anthropic"
    assert answer["usage"]["prompt_tokens"] == 11


async def test_anthropic_tool_use_to_a_streaming_client(anthropic_fake: FakeAnthropic) -> None:
    anthropic_fake.knobs.answer = anthropic_message(
        [{"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}],
        "tool_use",
    )
    payload = {
        "model": "local-model",
        "messages": HELLO,
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "stream": True,
    }
    served, body = await call_streaming(client_for(anthropic_fake=anthropic_fake), CLAUDE, payload)
    [got] = anthropic_fake.requests
    assert got.body["stream"] is True
    assert got.body["tool_choice"] == {"type": "any"}
    assert served.content_type == "text/event-stream"
    final = sdk_final(body)
    [tool_call] = final.choices[0].message.tool_calls
    assert (tool_call.id, tool_call.function.name) == ("toolu_1", "weather")
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
    assert final.choices[0].finish_reason == "tool_calls"


async def test_refusal_happens_before_the_provider_is_called(
    anthropic_fake: FakeAnthropic,
) -> None:
    payload = {"model": "m", "messages": HELLO, "n": 3}
    with pytest.raises(RouterError) as exc:
        await call(client_for(anthropic_fake=anthropic_fake), CLAUDE, payload)
    assert refused_field(exc) == "n"
    assert exc.value.http_status == 400
    assert anthropic_fake.requests == []


async def test_provider_down() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = ProviderClient(OPENAI_KEY, "", openai_base_url=f"http://127.0.0.1:{port}/v1")
    with pytest.raises(RouterError) as exc:
        await call(client, GPT, {"model": "m", "messages": HELLO})
    err = exc.value
    assert (err.code, err.source, err.http_status) == (ErrorCode.BACKEND_ERROR, "backend", 502)
    assert err.message.startswith("openai provider unreachable")


@pytest.mark.parametrize(
    ("status", "code", "http_status"),
    [
        # Busy: INTERFACE.md's 429/503 rule for a backend's answers.
        (429, ErrorCode.BACKEND_UNAVAILABLE, 503),
        (503, ErrorCode.BACKEND_UNAVAILABLE, 503),
        (500, ErrorCode.BACKEND_ERROR, 502),
        # The router's key refused: not the client's fault, nor a busy provider.
        (401, ErrorCode.BACKEND_ERROR, 502),
    ],
)
async def test_provider_error_statuses(
    openai_fake: FakeOpenAI, status: int, code: ErrorCode, http_status: int
) -> None:
    openai_fake.knobs.fail_status = status
    with pytest.raises(RouterError) as exc:
        await call(client_for(openai_fake), GPT, {"model": "m", "messages": HELLO})
    err = exc.value
    assert (err.code, err.source, err.http_status) == (code, "backend", http_status)
    assert err.message == f"openai provider answered HTTP {status}: fake failure {status}"


@pytest.mark.parametrize("status", [429, 529])
async def test_anthropic_error_body_is_quoted(anthropic_fake: FakeAnthropic, status: int) -> None:
    # 529 is Anthropic's "overloaded": busy, as a 503.
    anthropic_fake.knobs.fail_status = status
    with pytest.raises(RouterError) as exc:
        await call(client_for(anthropic_fake=anthropic_fake), CLAUDE, {"messages": HELLO})
    assert exc.value.code is ErrorCode.BACKEND_UNAVAILABLE
    assert exc.value.message == f"anthropic provider answered HTTP {status}: fake failure {status}"


async def test_provider_400_is_the_clients_error(openai_fake: FakeOpenAI) -> None:
    openai_fake.knobs.fail_status = 400
    with pytest.raises(RouterError) as exc:
        await call(client_for(openai_fake), GPT, {"model": "m", "messages": HELLO})
    err = exc.value
    assert (err.code, err.source, err.http_status) == (ErrorCode.INVALID_PARAMETER, "backend", 400)


async def test_connection_closed_without_an_answer(openai_fake: FakeOpenAI) -> None:
    openai_fake.knobs.close_connection = True
    with pytest.raises(RouterError) as exc:
        await call(client_for(openai_fake), GPT, {"model": "m", "messages": HELLO})
    assert exc.value.code is ErrorCode.BACKEND_ERROR
    assert exc.value.message.startswith("openai provider connection failed")


@pytest.mark.parametrize("engine", ["openai", "anthropic"])
async def test_malformed_answer(
    openai_fake: FakeOpenAI, anthropic_fake: FakeAnthropic, engine: str
) -> None:
    fake = openai_fake if engine == "openai" else anthropic_fake
    fake.knobs.malformed = True
    provider = GPT if engine == "openai" else CLAUDE
    with pytest.raises(RouterError) as exc:
        await call(client_for(openai_fake, anthropic_fake), provider, {"messages": HELLO})
    assert exc.value.code is ErrorCode.BACKEND_ERROR
    assert exc.value.message.startswith(f"{engine} provider answered malformed JSON")


async def test_answer_of_the_wrong_shape(openai_fake: FakeOpenAI) -> None:
    openai_fake.knobs.answer = {"object": "list", "data": []}
    with pytest.raises(RouterError) as exc:
        await call(client_for(openai_fake), GPT, {"model": "m", "messages": HELLO})
    assert exc.value.code is ErrorCode.BACKEND_ERROR
    assert "no choices" in exc.value.message


async def test_provider_slower_than_its_timeout(openai_fake: FakeOpenAI) -> None:
    openai_fake.knobs.delay = 5
    started = trio.current_time()
    with pytest.raises(RouterError) as exc:
        await call(client_for(openai_fake, timeout=0.3), GPT, {"model": "m", "messages": HELLO})
    assert trio.current_time() - started < 2
    err = exc.value
    assert (err.code, err.source, err.http_status) == (ErrorCode.BACKEND_ERROR, "backend", 502)
    assert err.message == "openai provider timed out after 0.3s"


async def test_request_deadline_before_the_provider_timeout(openai_fake: FakeOpenAI) -> None:
    openai_fake.knobs.delay = 5
    client = client_for(openai_fake, timeout=30)
    # The request's own deadline wins: the caller's scope sees the cancellation and
    # answers request_timeout itself, so no provider error may be raised.
    with trio.move_on_after(0.3) as scope:
        await call(client, GPT, {"model": "m", "messages": HELLO})
    assert scope.cancelled_caught


async def test_one_client_serves_several_calls(openai_fake: FakeOpenAI) -> None:
    client = client_for(openai_fake)
    try:
        for _ in range(3):
            await client(GPT, route_request({"model": "m", "messages": HELLO}))
    finally:
        await client.aclose()
    assert len(openai_fake.requests) == 3


# Streaming: each event relayed as it arrives, translated both ways ------------------


def _anthropic_sdk(body: bytes) -> anthropic_sdk.Anthropic:
    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return anthropic_sdk.Anthropic(
        api_key="unused",
        base_url="http://provider.invalid",
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
    )


def anthropic_final(body: bytes) -> Any:
    """The message the anthropic SDK's stream helper assembles from an SSE body."""
    with _anthropic_sdk(body).messages.stream(model="m", max_tokens=10, messages=HELLO) as stream:
        return stream.get_final_message()


CLAUDE_HELLO = {"model": "local-model", "max_tokens": 64, "messages": HELLO}


@pytest.mark.parametrize(("provider", "path"), [(GPT, ""), (CLAUDE, ""), (GPT, "/v1/messages")])
async def test_first_event_reaches_the_client_before_the_provider_finishes(
    openai_fake: FakeOpenAI,
    anthropic_fake: FakeAnthropic,
    provider: ProviderFallback,
    path: str,
) -> None:
    fake: FakeOpenAI | FakeAnthropic = openai_fake if provider is GPT else anthropic_fake
    fake.knobs.gate = trio.Event()
    client = client_for(openai_fake, anthropic_fake)
    payload = {**CLAUDE_HELLO, "stream": True}
    req = route_request(payload)
    req.path = path or req.path
    try:
        # The fake holds the rest of its answer until the gate opens: the call returns
        # with the first event while the provider is still answering.
        with trio.fail_after(10):
            served = await client(provider, req)
        assert served.stream is not None
        if path == "/v1/messages":
            assert served.body.startswith(b"event: message_start\n")
        else:
            assert b"assistant" in served.body and b"echo" not in served.body
        fake.knobs.gate.set()
        body = served.body
        while (chunk := await served.stream.next()) is not None:
            body += chunk
        await served.stream.aclose()
    finally:
        await client.aclose()
    if path == "/v1/messages":
        assert anthropic_final(body).content[0].text == "echo: hello"
    else:
        text = "".join(c.choices[0].delta.content or "" for c in sdk_chunks(body) if c.choices)
        assert text == "echo: hello"
    assert served.stream.usage is not None and served.stream.usage["completion_tokens"] > 0


async def test_anthropic_stream_tool_calls_and_usage_for_an_openai_client(
    anthropic_fake: FakeAnthropic,
) -> None:
    anthropic_fake.knobs.answer = {
        **anthropic_message(
            [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "weather",
                    "input": {"city": "Paris"},
                },
                {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}},
            ],
            "tool_use",
        ),
        "usage": {"input_tokens": 20, "cache_read_input_tokens": 5, "output_tokens": 9},
    }
    payload = {
        "model": "local-model",
        "messages": HELLO,
        "tools": [WEATHER_TOOL],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    served, body = await call_streaming(client_for(anthropic_fake=anthropic_fake), CLAUDE, payload)
    final = sdk_final(body)
    choice = final.choices[0]
    assert choice.message.content == "Let me look."
    assert [
        (c.id, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ] == [
        ("toolu_1", "weather", {"city": "Paris"}),
        ("toolu_2", "now", {}),
    ]
    assert choice.finish_reason == "tool_calls"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (25, 9)
    assert served.stream.usage == {"prompt_tokens": 25, "completion_tokens": 9}
    # The arguments came in fragments, as Anthropic sent them.
    fragments = [
        call.function.arguments
        for chunk in sdk_chunks(body)
        for choice in chunk.choices
        for call in choice.delta.tool_calls or []
        if call.function and call.function.arguments
    ]
    assert fragments == ['{"city":', ' "Paris"}', "{", "}"]
    without = {**payload, "stream_options": None}
    anthropic_fake.knobs.answer = anthropic_message([{"type": "text", "text": "x"}], "end_turn")
    _, body = await call_streaming(client_for(anthropic_fake=anthropic_fake), CLAUDE, without)
    assert b'"usage"' not in body  # not asked for, not sent


async def test_openai_stream_tool_calls_and_usage_for_an_anthropic_client(
    openai_fake: FakeOpenAI,
) -> None:
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
        },
    ]
    answer = completion(
        {"role": "assistant", "content": "Checking.", "tool_calls": calls}, "tool_calls"
    )
    answer["usage"]["prompt_tokens_details"] = {"cached_tokens": 3}
    openai_fake.knobs.answer = answer
    payload = {
        **CLAUDE_HELLO,
        "system": "Be brief.",
        "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "stream": True,
    }
    served, body = await call_streaming(client_for(openai_fake), GPT, payload, "/v1/messages")
    [got] = openai_fake.requests
    assert got.path == "/v1/chat/completions"
    assert got.body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert got.body["tool_choice"] == "required"
    assert got.body["stream_options"] == {"include_usage": True}
    message = anthropic_final(body)
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Checking."
    assert (message.content[1].id, message.content[1].name) == ("call_1", "weather")
    assert message.content[1].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (1, 2)
    assert message.usage.cache_read_input_tokens == 3
    assert served.stream.usage == {"prompt_tokens": 4, "completion_tokens": 2}


async def test_an_anthropic_client_and_an_openai_provider_without_streaming(
    openai_fake: FakeOpenAI,
) -> None:
    payload = {**CLAUDE_HELLO, "stop_sequences": ["END"], "metadata": {"user_id": "u1"}}
    req = route_request(payload)
    req.path = "/v1/messages"
    client = client_for(openai_fake)
    try:
        served = await client(GPT, req)
    finally:
        await client.aclose()
    [got] = openai_fake.requests
    assert got.body["stop"] == ["END"] and got.body["user"] == "u1"
    assert "stream" not in got.body
    message = json.loads(served.body)
    assert message["type"] == "message"
    assert message["content"] == [{"type": "text", "text": "echo: hello"}]
    assert message["stop_reason"] == "end_turn"


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"top_k": 5}, "top_k"),
        ({"thinking": {"type": "enabled"}}, "thinking"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
    ],
)
async def test_messages_fields_the_openai_provider_cannot_carry_are_refused(
    openai_fake: FakeOpenAI, payload: dict[str, Any], field: str
) -> None:
    req = route_request({**CLAUDE_HELLO, **payload})
    req.path = "/v1/messages"
    with pytest.raises(RouterError) as refused:
        await client_for(openai_fake)(GPT, req)
    assert refused.value.code is ErrorCode.INVALID_PARAMETER
    assert field in refused.value.message
    assert not openai_fake.requests  # refused before anything was sent


async def test_anthropic_to_anthropic_is_a_pass_through(anthropic_fake: FakeAnthropic) -> None:
    payload = {**CLAUDE_HELLO, "top_k": 5, "stream": True}
    _, body = await call_streaming(
        client_for(anthropic_fake=anthropic_fake), CLAUDE, payload, "/v1/messages"
    )
    [got] = anthropic_fake.requests
    assert got.body == {**payload, "model": "claude-test-1"}
    assert anthropic_final(body).content[0].text == "echo: hello"


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_and_responses_go_to_the_openai_provider(
    openai_fake: FakeOpenAI, stream: bool
) -> None:
    for path, payload in (
        ("/v1/completions", {"model": "m", "prompt": "say hi"}),
        ("/v1/responses", {"model": "m", "input": "say hi"}),
    ):
        payload = {**payload, "stream": stream}
        if stream:
            served, body = await call_streaming(client_for(openai_fake), GPT, payload, path)
            assert served.stream.usage is not None
            assert b"echo:" in body
            if path == "/v1/completions":
                assert b'"usage"' not in body  # asked by the router, left out
        else:
            req = route_request(payload)
            req.path = path
            client = client_for(openai_fake)
            try:
                served = await client(GPT, req)
            finally:
                await client.aclose()
            assert b"echo: say hi" in served.body
        assert openai_fake.requests[-1].path == path
        assert openai_fake.requests[-1].body["model"] == "gpt-test-mini"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses"])
async def test_completions_and_responses_to_anthropic_are_a_clear_error(
    anthropic_fake: FakeAnthropic, path: str
) -> None:
    req = route_request({"model": "m", "prompt": "x", "input": "x"})
    req.path = path
    with pytest.raises(RouterError) as refused:
        await client_for(anthropic_fake=anthropic_fake)(CLAUDE, req)
    assert refused.value.code is ErrorCode.ENDPOINT_NOT_SUPPORTED
    assert refused.value.http_status == 404
    assert path in refused.value.message
    assert not anthropic_fake.requests


async def test_stream_errors_before_and_after_the_first_event(openai_fake: FakeOpenAI) -> None:
    payload = {"model": "m", "messages": HELLO, "stream": True}
    # Before: the call fails as a whole (the HTTP layer answers with its error).
    openai_fake.knobs.fail_status = 503
    with pytest.raises(RouterError) as before:
        await call_streaming(client_for(openai_fake), GPT, payload)
    assert before.value.code is ErrorCode.BACKEND_UNAVAILABLE
    assert "HTTP 503" in before.value.message
    openai_fake.knobs.fail_status = None
    # After: the stream's next read fails, to be told as an error event.
    openai_fake.knobs.break_stream = True
    with pytest.raises(RouterError) as after:
        await call_streaming(client_for(openai_fake), GPT, payload)
    assert after.value.code is ErrorCode.BACKEND_ERROR
    assert "stream" in after.value.message


# Each client endpoint's smallest streamed body, as its SDK sends it.
_STREAMED = {
    "/v1/chat/completions": {"model": "m", "messages": HELLO, "stream": True},
    "/v1/messages": {"model": "m", "messages": HELLO, "max_tokens": 16, "stream": True},
    "/v1/responses": {"model": "m", "input": "hello", "stream": True},
}


@pytest.mark.parametrize(
    ("engine", "path", "code"),
    [
        ("openai", "/v1/chat/completions", ErrorCode.BACKEND_ERROR),
        ("openai", "/v1/messages", ErrorCode.BACKEND_ERROR),
        ("openai", "/v1/responses", ErrorCode.BACKEND_ERROR),
        # Anthropic's overloaded_error: busy, as its 529 status would say.
        ("anthropic", "/v1/chat/completions", ErrorCode.BACKEND_UNAVAILABLE),
        ("anthropic", "/v1/messages", ErrorCode.BACKEND_UNAVAILABLE),
    ],
)
async def test_the_providers_own_error_event_fails_the_stream(
    openai_fake: FakeOpenAI,
    anthropic_fake: FakeAnthropic,
    engine: str,
    path: str,
    code: ErrorCode,
) -> None:
    """Not relayed as it came (it has neither `code` nor `source`, and the client's
    stream would pass for a success): the stream fails with a RouterError, which the
    HTTP layer tells as its own error event."""
    fake = openai_fake if engine == "openai" else anthropic_fake
    provider = GPT if engine == "openai" else CLAUDE
    client = client_for(openai_fake, anthropic_fake)
    req = route_request(_STREAMED[path])
    req.path = path
    try:
        fake.knobs.error_event = 1
        served = await client(provider, req)
        assert served.stream is not None
        body = served.body
        with pytest.raises(RouterError) as after:
            while (chunk := await served.stream.next()) is not None:
                body += chunk
        await served.stream.aclose()
        err = after.value
        assert (err.code, err.source) == (code, "backend")
        assert err.message.startswith(f"{engine} provider stream failed: ")
        assert ("Overloaded" if engine == "anthropic" else "had an error") in err.message
        assert b"error" not in body, body
        # In place of the first event: the call fails as a whole, with the same code.
        fake.knobs.error_event = 0
        with pytest.raises(RouterError) as before:
            await client(provider, req)
        assert (before.value.code, before.value.source) == (code, "backend")
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "events",
    [
        b"data: not json\n\n",
        b"data: [1, 2]\n\n",
        b'data: {"choices": [{"delta": {"tool_calls": [{"index": [1]}]}}]}\n\ndata: [DONE',
        b'event: message_start\ndata: {"type": "message_start"',
    ],
)
def test_hostile_provider_events_are_errors_not_crashes(events: bytes) -> None:
    for translator in (AnthropicToOpenAI("m", True), OpenAIToAnthropic("m"), PassThrough(True)):
        parser = EventParser()
        with pytest.raises(ValueError):
            for name, data in parser.feed(events):
                translator.event(name, data)
            if parser.pending():
                raise ValueError("broke off")
            translator.end()


async def test_a_stream_whose_first_event_never_comes_times_out(openai_fake: FakeOpenAI) -> None:
    openai_fake.knobs.delay = 5
    payload = {"model": "m", "messages": HELLO, "stream": True}
    with pytest.raises(RouterError) as exc:
        await call_streaming(client_for(openai_fake, timeout=0.3), GPT, payload)
    err = exc.value
    assert (err.code, err.source, err.http_status) == (ErrorCode.BACKEND_ERROR, "backend", 502)
    assert err.message == "openai provider sent no event within 0.3s"


def test_a_provider_event_too_large_or_too_deep_is_refused() -> None:
    parser = EventParser()
    with pytest.raises(ValueError, match="longer than"):
        parser.feed(b"data: " + b"x" * (MAX_EVENT_BYTES + 1))
    line = b"data: " + b"x" * (MAX_EVENT_BYTES // 4) + b"\n"
    with pytest.raises(ValueError, match="an event larger than"):
        EventParser().feed(line * 5)
    with pytest.raises(ValueError, match="nested too deeply"):
        PassThrough(False).event(None, "[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize(
    ("event", "kind", "message"),
    [
        ({"error": {"type": "t" * 10_000, "message": "m"}}, "t" * MAX_KIND, "m"),
        ({"type": "error", "error": {"type": 5, "message": ["x"]}}, "error", "no message"),
        ({"type": "error", "code": None}, "error", "no message"),
        ({"error": {}}, "error", "no message"),
    ],
    ids=["long-type", "wrong-types", "responses-no-code", "empty"],
)
def test_a_providers_error_event_of_any_shape_is_named_within_bounds(
    event: dict, kind: str, message: str
) -> None:
    with pytest.raises(ProviderErrorEvent) as raised:
        check_error_event(event)
    assert (raised.value.kind, raised.value.message) == (kind, message)
