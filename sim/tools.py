"""Scripted tool calls: the simulated engine calls a tool when the prompt tells it to.

A client that runs tools (Claude Code, OpenCode, an SDK's tool loop) is only tested
when the model asks for a tool. The sim has no model, so the request says which call
to make: the last user turn holds `sim:call NAME {JSON arguments}` and the request
offers a tool named NAME. The answer is then that call, whole or streamed in each API's
shape (OpenAI `tool_calls`, Anthropic `tool_use`), with the finish reason a real engine
gives (`tool_calls`, `tool_use`). The client runs the tool and sends its result back;
a turn that carries a tool result is answered as any other, echoing its words
(`Echo: ...`), so a test sees that the result made the round trip.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sim.generation import content_text

DIRECTIVE = "sim:call"
# The directive, then the tool's name; its JSON arguments follow.
_DIRECTIVE = re.compile(re.escape(DIRECTIVE) + r"\s+([A-Za-z0-9_.:-]{1,128})\s*")
# A token of the arguments' text: a run of non-space characters with the spaces before
# it, so the pieces join back to the exact JSON and each one counts as a token.
_PIECE = re.compile(r"\s*\S+")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as the client will parse it

    def pieces(self) -> list[str]:
        """The arguments in fragments, as an engine streams them (one token each)."""
        return _PIECE.findall(self.arguments) or [self.arguments]


def offered_names(tools: Any) -> set[str]:
    """Tool names in OpenAI's (`{"type": "function", "function": {"name"}}`) or
    Anthropic's (`{"name"}`) list; anything else offers nothing."""
    names: set[str] = set()
    if not isinstance(tools, list):
        return names
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else tool.get("name")
        if isinstance(name, str):
            names.add(name)
    return names


def _tools_off(choice: Any) -> bool:
    """`tool_choice` that forbids a call: OpenAI's "none", Anthropic's {"type": "none"}."""
    return choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none")


def _has_tool_result(message: dict[str, Any]) -> bool:
    if message.get("role") == "tool":
        return True
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") == "tool_result" for part in content
    )


def scripted_call(payload: dict[str, Any]) -> ToolCall | None:
    """The call the request's last turn scripts, or None (answer with text).

    Only a last turn from the user that is not a tool result scripts a call: once the
    client sends the result back, the same directive earlier in the conversation does
    not call the tool again, so a tool loop ends after one round.
    """
    messages = payload.get("messages")
    if not isinstance(messages, list) or _tools_off(payload.get("tool_choice")):
        return None
    # Claude Code puts `system` messages after the user's turn (its environment): the
    # turn that is answered is the last one of another role.
    turns = [m for m in messages if not (isinstance(m, dict) and m.get("role") == "system")]
    last = turns[-1] if turns else None
    if not isinstance(last, dict) or last.get("role") != "user" or _has_tool_result(last):
        return None
    text = content_text(last.get("content"))
    match = _DIRECTIVE.search(text)
    if match is None or match.group(1) not in offered_names(payload.get("tools")):
        return None
    try:
        arguments, _ = json.JSONDecoder().raw_decode(text, match.end())
    except (ValueError, RecursionError):  # RecursionError: arguments nested thousands deep
        return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(match.group(1), json.dumps(arguments))
