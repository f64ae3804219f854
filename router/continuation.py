"""Stream continuation, the pure part: what a broken stream had sent, the request that
asks another engine to go on from there, and the rewriting that splices its stream on.

No I/O here (router/continuation_relay.py does it). The client's stream is kept as the
bytes it was sent and read only when it breaks, so a stream that never breaks costs a
list append per chunk: the router's CPU per request is the fleet's bottleneck, and a
break is rare. A reading says why a stream cannot be continued (`Sent.problem`); the
relay then ends it with the error event as before.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from protocol.paths import CHAT as CHAT_PATH
from protocol.paths import MESSAGES as MESSAGES_PATH
from protocol.usage import COMPLETION, PROMPT

# A stream is kept for continuation up to this size: 8 MiB holds a 32k-token OpenAI
# stream (about 150 bytes an event, 4.8 MB); past it the stream ends as before.
MAX_TRANSCRIPT_BYTES = 8 << 20

# Engines that continue a final assistant turn, in the order tried, each with the body
# its API needs. vLLM and SGLang need `continue_final_message` with
# `add_generation_prompt: false` on chat (else they open a new assistant turn); the sim
# checks both as vLLM does. llama.cpp treats a final assistant message as a prefill and
# needs no flag. Anthropic's Messages API prefills a final assistant message by itself.
# Ollama opens a new turn, and a custom server's behaviour is unknown: neither continues.
FLAGGED_ENGINES = frozenset({"vllm", "sglang", "sim"})
PREFILL_ENGINES = frozenset({"llamacpp"})
CONTINUABLE_ENGINES = FLAGGED_ENGINES | PREFILL_ENGINES


@dataclass(slots=True)
class Sent:
    """What the client has of a stream, read from the bytes it was sent."""

    text: str = ""
    # The answer's tokens the client has: the engine's running count where its events
    # carry one (OpenAI's `usage` in every chunk, which the agent asks vLLM, SGLang and
    # the sim for: agent/usage.py), plus one per content event after the last count.
    # vLLM packs several tokens into one event when its reader lags, so counting events
    # alone undercounts (docs/api/client.md, *Stream continuation*).
    tokens: int = 0
    # The prompt's tokens as the engine counted them (the same running usage), which
    # the spliced usage reports: the continuation's prompt holds the text sent too.
    prompt_tokens: int | None = None
    problem: str | None = None  # why it cannot be continued; None: it can
    finished: bool = False  # the answer's end already reached the client
    # ... and so did the stream's last event (`[DONE]`, `message_stop`): the router
    # then has nothing to add, or the client would read that event twice.
    ended: bool = False
    # The answer's opening reached the client (OpenAI: a chunk; Anthropic: message_start):
    # the continuation's own opening is then dropped, else kept.
    started: bool = False
    # OpenAI: the first chunk's identity, which every spliced chunk keeps.
    id: str | None = None
    created: int | None = None
    model: str | None = None
    # Anthropic: the prompt's tokens (message_start), the open text block if any, and
    # the index the next block takes.
    input_tokens: int | None = None
    open_block: int | None = None
    next_block: int = 0


def sse_events(blob: bytes) -> tuple[list[tuple[str | None, str]], bytes]:
    """The whole events of `blob` as (event name, data), and the unfinished rest."""
    end = blob.rfind(b"\n\n")
    rest = blob[end + 2 :] if end >= 0 else blob
    events: list[tuple[str | None, str]] = []
    for block in blob[: end + 2].decode("utf-8", "replace").split("\n\n") if end >= 0 else ():
        name: str | None = None
        data: list[str] = []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if name is not None or data:
            events.append((name, "\n".join(data)))
    return events, rest


def read_sent(path: str, blob: bytes) -> Sent:
    """What `blob`, the bytes a client was sent on `path`, holds of the answer."""
    if path == CHAT_PATH:
        reader = _read_openai
    elif path == MESSAGES_PATH:
        reader = _read_anthropic
    else:
        return Sent(problem=f"{path} streams are not continued")
    events, rest = sse_events(blob)
    if rest.strip():
        # The client holds half an event: nothing spliced after it would parse.
        return Sent(problem="the stream broke inside an event")
    sent = Sent()
    for name, data in events:
        if data == "[DONE]":
            sent.finished = sent.ended = True
            continue
        try:
            event = json.loads(data)
        except ValueError:
            sent.problem = "the stream holds an event that is not JSON"
            return sent
        if isinstance(event, dict):
            reader(sent, name, event)
        if sent.problem is not None:
            return sent
    return sent


def _read_openai(sent: Sent, name: str | None, event: dict[str, Any]) -> None:
    sent.started = True
    if sent.id is None and isinstance(event.get("id"), str):
        sent.id, sent.created, sent.model = event["id"], event.get("created"), event.get("model")
    if "error" in event:
        sent.problem = "the stream already carries an error"
        return
    choices = event.get("choices")
    if not isinstance(choices, list):
        return
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("index", 0) != 0:
            sent.problem = "streams of several choices (n > 1) are not continued"
            return
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("tool_calls") or delta.get("function_call"):
                sent.problem = "tool-call streams are not continued"
                return
            if delta.get("reasoning_content") or delta.get("reasoning"):
                sent.problem = "reasoning streams are not continued"
                return
            content = delta.get("content")
            if isinstance(content, str) and content:
                sent.text += content
                sent.tokens += 1
        if choice.get("finish_reason") is not None:
            sent.finished = True
    usage = event.get("usage")
    timings = event.get("timings")
    if isinstance(usage, dict):
        # A running count includes this event's own tokens.
        completion, prompt = usage.get(COMPLETION), usage.get(PROMPT)
        if _count(completion) and _count(prompt):
            sent.tokens, sent.prompt_tokens = completion, prompt
    elif isinstance(timings, dict):
        # llama.cpp's running counts (`timings_per_token`, agent/usage.py): the tokens
        # generated, and the prompt's as processed plus as found in its cache.
        done, fresh, cached = (
            timings.get("predicted_n"),
            timings.get("prompt_n"),
            timings.get("cache_n", 0),
        )
        if _count(done) and _count(fresh) and _count(cached):
            sent.tokens, sent.prompt_tokens = done, fresh + cached


# A count past this is no engine's (the bound the router puts on an agent's usage).
MAX_COUNT = 2**32


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def _read_anthropic(sent: Sent, name: str | None, event: dict[str, Any]) -> None:
    kind = event.get("type")
    if kind == "message_start":
        sent.started = True
        message = event.get("message")
        usage = message.get("usage") if isinstance(message, dict) else None
        if isinstance(usage, dict) and _count(usage.get("input_tokens")):
            # The client's prompt as the engine counted it, which the spliced usage keeps.
            sent.input_tokens = sent.prompt_tokens = usage["input_tokens"]
    elif kind == "content_block_start":
        block = event.get("content_block")
        if not isinstance(block, dict) or block.get("type") != "text":
            kind_of = block.get("type") if isinstance(block, dict) else block
            sent.problem = f"{kind_of} blocks are not continued (text only)"
            return
        index = event.get("index")
        sent.open_block = index if isinstance(index, int) else sent.next_block
        sent.next_block = sent.open_block + 1
    elif kind == "content_block_delta":
        delta = event.get("delta")
        if isinstance(delta, dict) and delta.get("type") == "text_delta":
            text = delta.get("text")
            if isinstance(text, str) and text:
                sent.text += text
                sent.tokens += 1
    elif kind == "content_block_stop":
        sent.open_block = None
    elif kind == "message_delta":
        sent.finished = True
    elif kind == "message_stop":
        sent.finished = sent.ended = True
    elif kind == "error":
        sent.problem = "the stream already carries an error"


def continuation_body(path: str, payload: dict[str, Any], sent: Sent, flagged: bool) -> dict:
    """The client's request, asking to go on after `sent.text` with what is left of its
    token limit; `flagged`: for an engine that needs `continue_final_message`. With no
    text sent yet it is the client's request as it came: a plain retry."""
    body = copy.copy(payload)
    if not sent.text:
        return body
    messages = list(payload.get("messages") or [])
    messages.append({"role": "assistant", "content": sent.text})
    body["messages"] = messages
    for key in ("max_completion_tokens", "max_tokens"):
        limit = payload.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            body[key] = limit - sent.tokens
    if path == CHAT_PATH and flagged:
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    return body


def tokens_left(payload: dict[str, Any], sent: Sent) -> int | None:
    """What is left of the request's token limit (None: it set none)."""
    for key in ("max_completion_tokens", "max_tokens"):
        limit = payload.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            return limit - sent.tokens
    return None


def merged_usage(usage: dict[str, int] | None, sent: Sent) -> dict[str, int] | None:
    """The engine's usage of a continuation, as the client's whole answer: the tokens
    already sent move from the prompt (where the continuation read them) to the output."""
    if usage is None:
        return None
    return {PROMPT: prompt_of(usage[PROMPT], sent), COMPLETION: usage[COMPLETION] + sent.tokens}


def prompt_of(continued_prompt: int, sent: Sent) -> int:
    """The client's prompt tokens, from a continuation's: the engine's own count of the
    first part's where it gave one; else the continuation's less the tokens sent (the
    text sent is part of its prompt, tokenized again: only about the same count)."""
    if sent.prompt_tokens is not None:
        return sent.prompt_tokens
    return max(0, continued_prompt - sent.tokens)


def closing(path: str, sent: Sent, finish: str) -> bytes:
    """The end of a stream whose answer was whole when it broke, or whose token limit is
    spent: a finish chunk (OpenAI) or the closing events (Anthropic); nothing when the
    stream's last event already reached the client."""
    if sent.ended:
        return b""
    if path == CHAT_PATH:
        chunk: dict[str, Any] = {"id": sent.id, "object": "chat.completion.chunk"}
        chunk |= {"created": sent.created, "model": sent.model}
        chunk["choices"] = [{"index": 0, "delta": {}, "finish_reason": finish}]
        done = b"" if sent.finished else _data(chunk)
        return done + b"data: [DONE]\n\n"
    out = b""
    if sent.open_block is not None:
        stop_block = {"type": "content_block_stop", "index": sent.open_block}
        out += _event("content_block_stop", stop_block)
    if not sent.finished:
        stop = "max_tokens" if finish == "length" else "end_turn"
        delta = {"stop_reason": stop, "stop_sequence": None}
        usage = {"output_tokens": sent.tokens}
        out += _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
    return out + _event("message_stop", {"type": "message_stop"})


@dataclass(eq=False, slots=True)
class Splice:
    """Rewrites a continuation's stream so the client sees one stream.

    OpenAI: every chunk takes the first part's id, created and model; the role-only
    first delta is dropped (the client had one); the usage chunk counts both parts.
    Anthropic: `message_start` is dropped (the client had one); the first text block
    joins the block left open, or takes the next index; `message_delta`'s output
    tokens count both parts.
    """

    path: str
    sent: Sent
    _rest: bytes = b""
    _first: bool = True
    _index_map: dict[int, int] = field(default_factory=dict)

    def feed(self, chunk: bytes) -> bytes:
        """The client's bytes for a chunk of the continuation (whole events only)."""
        events, self._rest = sse_events(self._rest + chunk)
        out = []
        for name, data in events:
            piece = self._chat(data) if self.path == CHAT_PATH else self._messages(name, data)
            if piece:
                out.append(piece)
        return b"".join(out)

    def _chat(self, data: str) -> bytes:
        if data == "[DONE]":
            return b"data: [DONE]\n\n"
        event = _json_object(data)
        if event is None:
            return b""
        sent = self.sent
        if sent.id is not None:
            event["id"] = sent.id
        if sent.created is not None:
            event["created"] = sent.created
        if sent.model is not None:
            event["model"] = sent.model
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get(PROMPT), int):
            prompt = prompt_of(usage[PROMPT], sent)
            completion = int(usage.get(COMPLETION) or 0) + sent.tokens
            usage |= {PROMPT: prompt, COMPLETION: completion, "total_tokens": prompt + completion}
        choices = event.get("choices")
        if self._first and not sent.started:
            self._first = False  # the client has no role delta yet: this one is it
        if self._first and isinstance(choices, list) and choices:
            choice = choices[0]
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and "role" in delta:
                self._first = False
                del delta["role"]
                if not delta.get("content") and choice.get("finish_reason") is None:
                    return b""
        return _data(event)

    def _messages(self, name: str | None, data: str) -> bytes:
        event = _json_object(data)
        if event is None:
            return b""
        kind = event.get("type")
        if kind == "message_start" and self.sent.started:
            return b""
        index = event.get("index")
        if kind == "content_block_start" and isinstance(index, int):
            if not self._index_map and self.sent.open_block is not None:
                # The continuation's first block goes on in the block the client has open.
                self._index_map[index] = self.sent.open_block
                return b""
            joined = self.sent.open_block is not None
            self._index_map[index] = self.sent.next_block + len(self._index_map) - joined
        if isinstance(index, int):
            event["index"] = self._index_map.get(index, index)
        if kind == "message_delta":
            usage = event.get("usage")
            if isinstance(usage, dict):
                usage["output_tokens"] = int(usage.get("output_tokens") or 0) + self.sent.tokens
                if "input_tokens" in usage and self.sent.input_tokens is not None:
                    usage["input_tokens"] = self.sent.input_tokens
        return _event(name or str(kind), event)


def _json_object(data: str) -> dict[str, Any] | None:
    """An event's JSON object; anything else is dropped from the spliced stream."""
    try:
        event = json.loads(data)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def _data(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _event(name: str, event: dict[str, Any]) -> bytes:
    return f"event: {name}\n".encode() + _data(event)
