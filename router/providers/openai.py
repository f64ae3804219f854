"""The OpenAI provider: the client's own Chat Completions body, with the policy's model.

Every field the client sent goes through as it is, since OpenAI speaks the client's
format; only the model and the streaming fields change.
"""

from __future__ import annotations

from typing import Any


def chat_request(payload: dict[str, Any], model: str) -> dict[str, Any]:
    body = dict(payload)
    body["model"] = model
    # The provider is called without streaming; the router re-streams the answer itself,
    # and OpenAI refuses stream_options on a call that does not stream.
    body["stream"] = False
    body.pop("stream_options", None)
    return body


def check_completion(answer: object) -> dict[str, Any]:
    """The answer when it has the shape of a `chat.completion`; ValueError otherwise."""
    if not isinstance(answer, dict):
        raise ValueError("the answer is not a JSON object")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValueError("no choices in the answer")
    for choice in choices:
        if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
            raise ValueError("a choice has no message")
    return answer
