"""llama.cpp's token count of a conversation, chat template included.

llama-server's `/tokenize` takes text (`content`) only, so a count of the messages'
text leaves out the tokens its chat template adds around each message, which a chat
request is billed for (`usage.prompt_tokens`). Its `/apply-template` turns a chat
request's `messages` (and `tools`) into the prompt text it would run; that text,
tokenized with `add_special` as a chat request's prompt is, counts exactly what the
engine bills (the same 54 tokens as the chat completion's `prompt_tokens` on the
test suite's model, tests/real_engines/test_llamacpp.py).

The router sends a count's `/tokenize` body with the text and the conversation both
(router/http/count_tokens.py): `content` for an agent or engine that knows nothing of
this (llama-server ignores the other fields), `messages` and `tools` for this step. A
server without `/apply-template` (an older build), or one that refuses the
conversation, gets the text as before.
"""

from __future__ import annotations

import json
import logging

from agent.engine_http import EnginePool, ReadLimits

log = logging.getLogger("agent")

ENGINES = frozenset({"llamacpp"})
TOKENIZE_PATH = "/tokenize"
TEMPLATE_PATH = "/apply-template"
# The prompt is the conversation with the template's few lines around each turn: an
# answer past this much more than the request is the engine's fault, not read whole.
TEMPLATE_ROOM = 1024 * 1024


def wanted(msg: dict, engine: str) -> bool:
    return engine in ENGINES and msg["path"] == TOKENIZE_PATH and msg["method"] == "POST"


async def templated(engine: EnginePool, body: bytes, limits: ReadLimits | None) -> bytes:
    """The `/tokenize` body to send: the conversation in `body` made the engine's own
    prompt by its `/apply-template`, or `body` as it is where it holds no conversation
    or the engine cannot template it. Raises what `EnginePool.send` raises when the
    engine cannot be reached."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body
    if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
        return body
    chat: dict = {"messages": payload["messages"]}
    if isinstance(payload.get("tools"), list) and payload["tools"]:
        chat["tools"] = payload["tools"]
    headers = {"content-type": "application/json"}
    response = await engine.send("POST", TEMPLATE_PATH, headers, json.dumps(chat).encode(), limits)
    try:
        answer = await response.read_all(2 * len(body) + TEMPLATE_ROOM, limits)
        status = response.status
    finally:
        response.close()
    prompt = _prompt(answer) if status == 200 else None
    if prompt is None:
        # Every count on such a server: debug, not a line per request at info.
        log.debug("chat_template_unavailable status=%d", status)
        return json.dumps({"content": payload.get("content", ""), "add_special": True}).encode()
    return json.dumps({"content": prompt, "add_special": True}).encode()


def _prompt(answer: bytes) -> str | None:
    try:
        value = json.loads(answer)
    except (ValueError, UnicodeDecodeError):
        return None
    prompt = value.get("prompt") if isinstance(value, dict) else None
    return prompt if isinstance(prompt, str) else None
