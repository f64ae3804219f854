"""Anthropic count_tokens turned into an engine's `/tokenize` call, and back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol.errors import ErrorCode, RouterError
from protocol.frames import MAX_FRAME_BYTES
from router.http import count_tokens
from router.http.count_tokens import input_tokens, to_tokenize
from tests.test_session import make_peer, request

PAYLOAD: dict[str, Any] = {
    "model": "m",
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ],
    "tools": [
        {
            "name": "weather",
            "description": "Current weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
}


async def test_vllm_gets_the_chat_with_its_tools() -> None:
    req = request(path="/v1/messages/count_tokens")
    to_tokenize(req, PAYLOAD, [make_peer("A", engine="vllm"), make_peer("B", engine="sglang")])
    assert req.path == "/tokenize" and req.stream is False
    assert req.engines == {"vllm", "sim"}
    body = json.loads(req.body)
    assert body["model"] == "m"
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": 'Use the tool.\n{"name": "weather", "input": {"city": "Paris"}}',
        },
        {"role": "user", "content": "Sunny\nThanks"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": PAYLOAD["tools"][0]["input_schema"],
                "description": "Current weather",
            },
        }
    ]


async def test_sglang_alone_gets_the_text() -> None:
    req = request()
    to_tokenize(
        req,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        [make_peer("A", engine="sglang")],
    )
    assert req.engines == {"sglang"}
    assert json.loads(req.body) == {"model": "m", "prompt": "hi"}


async def test_llamacpp_gets_the_text_as_content_and_the_conversation_after_sglang() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = request()
    to_tokenize(req, chat, [make_peer("A", engine="llamacpp"), make_peer("B", engine="sglang")])
    assert req.engines == {"sglang"}
    req = request()
    to_tokenize(req, chat, [make_peer("A", engine="llamacpp"), make_peer("B", engine="ollama")])
    assert req.engines == {"llamacpp"}
    # The text for an agent that sends it as it is; the conversation for one that has
    # the engine template it first (agent/chat_template.py).
    assert json.loads(req.body) == {
        "content": "hi",
        "add_special": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    tool = {"name": "f", "input_schema": {"type": "object"}}
    to_tokenize(
        req, {**chat, "system": "be brief", "tools": [tool]}, [make_peer("A", engine="llamacpp")]
    )
    body = json.loads(req.body)
    assert body["messages"][0] == {"role": "system", "content": "be brief"}
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]


async def test_no_tokenizer_engine_is_refused_naming_the_engines() -> None:
    req = request()
    peers = [make_peer("A", engine="ollama"), make_peer("B", engine="custom")]
    with pytest.raises(RouterError) as caught:
        to_tokenize(req, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, peers)
    assert caught.value.code == ErrorCode.TOKENIZER_UNAVAILABLE
    assert caught.value.http_status == 404
    assert "served by: custom, ollama" in caught.value.message
    assert "(llamacpp, sglang, sim, vllm)" in caught.value.message


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"model": "m"}, "messages: must be a non-empty list"),
        ({"model": "m", "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
    ],
)
async def test_bad_bodies_are_request_invalid(payload: dict, expected: str) -> None:
    with pytest.raises(RouterError) as caught:
        to_tokenize(request(), payload, [make_peer("A", engine="vllm")])
    assert caught.value.code == ErrorCode.REQUEST_INVALID
    assert expected in caught.value.message


def test_the_engine_count_becomes_input_tokens() -> None:
    assert input_tokens(b'{"count": 7, "max_model_len": 4096, "tokens": []}') == {"input_tokens": 7}
    # llama.cpp answers the ids alone.
    assert input_tokens(b'{"tokens": [1, 15043, 3186]}') == {"input_tokens": 3}
    bad_bodies = (b"not json", b"[]", b'{"count": "7"}', b'{"count": true}', b'{"count": [1, 2]}')
    for bad in (*bad_bodies, b'{"tokens": 3}', b"{}"):
        with pytest.raises(RouterError) as caught:
            input_tokens(bad)
        assert caught.value.code == ErrorCode.BACKEND_ERROR
        assert caught.value.source == "backend"


async def test_a_conversation_too_large_to_go_twice_is_counted_as_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The text and the conversation in one frame: past the bound, the text alone.
    assert count_tokens.MAX_TEMPLATED_BYTES < MAX_FRAME_BYTES
    chat = {"model": "m", "messages": [{"role": "user", "content": "eleven char"}]}
    monkeypatch.setattr(count_tokens, "MAX_TEMPLATED_BYTES", 97)  # this body's length
    req = request()
    to_tokenize(req, chat, [make_peer("A", engine="llamacpp")])
    assert "messages" in json.loads(req.body)
    monkeypatch.setattr(count_tokens, "MAX_TEMPLATED_BYTES", 96)
    to_tokenize(req, chat, [make_peer("A", engine="llamacpp")])
    assert json.loads(req.body) == {"content": "eleven char", "add_special": True}
