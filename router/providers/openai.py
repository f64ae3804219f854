"""The OpenAI provider: the client's own body (chat, completions, responses), with the
policy's model.

Every field the client sent goes through as it is, since OpenAI speaks the client's
format; only the model and the streaming fields change. A stream of chat or legacy
completions is asked for its usage chunk (`stream_options.include_usage`), which the
tenant's token quota needs; the router leaves that chunk out when the client did not
ask for it (router/providers/events.py).
"""

from __future__ import annotations

from typing import Any

from protocol.paths import CHAT, COMPLETIONS

# The endpoints whose streams carry usage only when asked.
USAGE_ON_REQUEST = (CHAT, COMPLETIONS)


def request(payload: dict[str, Any], model: str, path: str, stream: bool) -> dict[str, Any]:
    body = dict(payload)
    body["model"] = model
    body["stream"] = stream
    if not stream:
        # OpenAI refuses stream_options on a call that does not stream.
        body.pop("stream_options", None)
    elif path in USAGE_ON_REQUEST:
        options = payload.get("stream_options")
        body["stream_options"] = {
            **(options if isinstance(options, dict) else {}),
            "include_usage": True,
        }
    return body


def client_asked_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


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


def check_object(answer: object) -> dict[str, Any]:
    """A legacy completion, a response or a message: a JSON object is all that is
    checked (the client's SDK parses the rest)."""
    if not isinstance(answer, dict):
        raise ValueError("the answer is not a JSON object")
    return answer
