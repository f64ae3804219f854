"""Local stand-ins for the OpenAI and Anthropic APIs, for the provider fallback tests.

Each fake is a small HTTP/1.1 server (trio + h11) on 127.0.0.1 and a free port. It
checks what the real API checks first (path, key header, API version, required body
fields), records every request it got, and answers in the provider's documented wire
format, whole or streamed (`"stream": true`, as the provider streams: OpenAI's chunks
and `[DONE]`, Anthropic's named events). Knobs make it fail the ways a provider fails:
an error status, a dropped connection, a slow answer, a body that is not JSON, a stream
that breaks off or ends with the provider's own error event; and `gate` holds a stream
after its first event until the test releases it, so a test can see that event reach
the client before the answer ends.

    fake = FakeOpenAI("sk-test")
    await nursery.start(fake.serve)
    fake.knobs.fail_status = 429
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import h11
import trio


@dataclass
class Recorded:
    method: str
    path: str
    # Lower-cased names.
    headers: dict[str, str]
    # The parsed JSON body; None when it was not JSON.
    body: Any


@dataclass
class Knobs:
    # Answer with this status and the provider's error body.
    fail_status: int | None = None
    # Read the request, then close the connection without answering.
    close_connection: bool = False
    # Seconds to wait before answering.
    delay: float = 0.0
    # Every answer waits until this is set.
    hold: trio.Event | None = None
    # Answer 200 with a body that is not JSON.
    malformed: bool = False
    # Answer 200 with this JSON instead of the generated answer (streamed when asked).
    answer: Any = None
    # A stream waits after its first event until this is set.
    gate: trio.Event | None = None
    # A stream's connection closes after its first event (after the gate).
    break_stream: bool = False
    # A stream sends the provider's own error event in place of its events from this
    # index on (0: in place of all), then ends, as a provider overloaded mid-answer does.
    error_event: int | None = None


@dataclass
class FakeProvider:
    api_key: str
    knobs: Knobs = field(default_factory=Knobs)
    requests: list[Recorded] = field(default_factory=list)
    port: int = 0
    # Set when the router closed a stream's connection while it waited on the gate.
    stream_abandoned: trio.Event = field(default_factory=trio.Event)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._connection, listeners)

    # The provider's own rules, in the subclasses.
    def check(self, request: Recorded) -> tuple[int, str, str] | None:
        """(status, error type, message) when the real API would refuse the request."""
        raise NotImplementedError

    def reply(self, request: Recorded) -> dict[str, Any]:
        raise NotImplementedError

    def error_body(self, kind: str, message: str) -> dict[str, Any]:
        raise NotImplementedError

    def events(self, request: Recorded, answer: dict[str, Any]) -> list[bytes]:
        """The stream of `answer`, event by event, as the provider sends it."""
        raise NotImplementedError

    def error_event(self, request: Recorded) -> bytes:
        """The error event the provider sends when it fails in the middle of a stream."""
        raise NotImplementedError

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                while True:
                    request = await _read_request(conn, stream)
                    if request is None:
                        return
                    self.requests.append(request)
                    if self.knobs.delay:
                        await trio.sleep(self.knobs.delay)
                    if self.knobs.hold is not None:
                        await self.knobs.hold.wait()
                    if self.knobs.close_connection:
                        return
                    status, body = self._answer(request)
                    if (
                        status == 200
                        and isinstance(request.body, dict)
                        and request.body.get("stream")
                    ):
                        await self._stream(conn, stream, request, json.loads(body))
                        return
                    await _send_response(conn, stream, status, body)
                    if conn.our_state is h11.MUST_CLOSE:
                        return
                    conn.start_next_cycle()
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
                return

    async def _stream(
        self, conn: h11.Connection, stream: trio.SocketStream, request: Recorded, answer: Any
    ) -> None:
        headers = [("content-type", "text/event-stream")]
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)))
        events = self.events(request, answer)
        if self.knobs.error_event is not None:
            events = [*events[: self.knobs.error_event], self.error_event(request)]
        for index, event in enumerate(events):
            await stream.send_all(conn.send(h11.Data(data=event)))
            gate = self.knobs.gate if index == 0 else None
            if gate is not None and await self._abandoned_before(gate, stream):
                self.stream_abandoned.set()
                return
            if index == 0 and self.knobs.break_stream:
                return
        await stream.send_all(conn.send(h11.EndOfMessage()))

    async def _abandoned_before(self, gate: trio.Event, stream: trio.SocketStream) -> bool:
        """Wait for `gate`; True when the client closed the connection first."""
        closed = False
        async with trio.open_nursery() as nursery:

            async def opened() -> None:
                await gate.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(opened)
            with contextlib.suppress(trio.BrokenResourceError):
                while await stream.receive_some(65536):
                    pass
            closed = True
            nursery.cancel_scope.cancel()
        return closed

    def _answer(self, request: Recorded) -> tuple[int, bytes]:
        refusal = self.check(request)
        if refusal is not None:
            status, kind, message = refusal
            return status, _dump(self.error_body(kind, message))
        if self.knobs.fail_status is not None:
            status = self.knobs.fail_status
            kind = "rate_limit_error" if status == 429 else "api_error"
            return status, _dump(self.error_body(kind, f"fake failure {status}"))
        if self.knobs.malformed:
            return 200, b'{"id": "broken", "choices": ['
        if self.knobs.answer is not None:
            return 200, _dump(self.knobs.answer)
        return 200, _dump(self.reply(request))


class FakeOpenAI(FakeProvider):
    """`POST /v1/chat/completions` with `Authorization: Bearer <key>`."""

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")

    def check(self, request: Recorded) -> tuple[int, str, str] | None:
        if request.method != "POST" or request.path not in self.PATHS:
            return 404, "invalid_request_error", f"unknown url {request.path}"
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return 401, "invalid_request_error", "Incorrect API key provided"
        body = request.body
        if not isinstance(body, dict):
            return 400, "invalid_request_error", "We could not parse the JSON body"
        if not isinstance(body.get("model"), str):
            return 400, "invalid_request_error", "you must provide a model parameter"
        if body.get("stream_options") is not None and not body.get("stream"):
            return 400, "invalid_request_error", "stream_options is only allowed with stream"
        if request.path == "/v1/completions":
            if not isinstance(body.get("prompt"), str):
                return 400, "invalid_request_error", "prompt must be a string"
        elif request.path == "/v1/responses":
            if body.get("stream_options") is not None:
                return 400, "invalid_request_error", "Unknown parameter: 'stream_options'"
            if not isinstance(body.get("input"), str):
                return 400, "invalid_request_error", "input must be a string"
        elif not isinstance(body.get("messages"), list) or not body["messages"]:
            return 400, "invalid_request_error", "messages must be a non-empty array"
        return None

    def reply(self, request: Recorded) -> dict[str, Any]:
        body = request.body
        if request.path == "/v1/completions":
            return _completion(body, f"echo: {body['prompt']}")
        if request.path == "/v1/responses":
            return _response(body, f"echo: {body['input']}")
        text = f"echo: {_last_text(body['messages'])}"
        prompt = sum(len(str(m.get("content", ""))) for m in body["messages"])
        return {
            "id": f"chatcmpl-fake-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "system_fingerprint": "fp_fake",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": len(text),
                "total_tokens": prompt + len(text),
            },
        }

    def error_body(self, kind: str, message: str) -> dict[str, Any]:
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}

    def error_event(self, request: Recorded) -> bytes:
        message = "The server had an error while processing your request."
        if request.path == "/v1/responses":
            event = {"type": "error", "code": "server_error", "message": message, "param": None}
            return _named("error", event)
        return _data(self.error_body("server_error", message))

    def events(self, request: Recorded, answer: dict[str, Any]) -> list[bytes]:
        if request.path == "/v1/responses":
            return _response_events(answer)
        options = request.body.get("stream_options") or {}
        usage = answer.get("usage") if options.get("include_usage") else None
        if request.path == "/v1/completions":
            return _completion_events(answer, usage)
        return _chat_events(answer, usage)


class FakeAnthropic(FakeProvider):
    """`POST /v1/messages` with `x-api-key` and `anthropic-version`."""

    @property
    def base_url(self) -> str:
        return self.root

    def check(self, request: Recorded) -> tuple[int, str, str] | None:
        if request.method != "POST" or request.path != "/v1/messages":
            return 404, "not_found_error", f"unknown url {request.path}"
        if request.headers.get("x-api-key") != self.api_key:
            return 401, "authentication_error", "invalid x-api-key"
        if not request.headers.get("anthropic-version"):
            return 400, "invalid_request_error", "anthropic-version: header is required"
        body = request.body
        if not isinstance(body, dict):
            return 400, "invalid_request_error", "the body is not JSON"
        if not isinstance(body.get("model"), str):
            return 400, "invalid_request_error", "model: Field required"
        if isinstance(body.get("max_tokens"), bool) or not isinstance(body.get("max_tokens"), int):
            return 400, "invalid_request_error", "max_tokens: Field required"
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return 400, "invalid_request_error", "messages: at least one message is required"
        for index, message in enumerate(messages):
            if message.get("role") not in ("user", "assistant"):
                return 400, "invalid_request_error", f"messages.{index}.role: unexpected role"
        return None

    def reply(self, request: Recorded) -> dict[str, Any]:
        body = request.body
        text = f"echo: {_last_text(body['messages'])}"
        return {
            "id": f"msg_fake_{len(self.requests)}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 11, "output_tokens": len(text)},
        }

    def error_body(self, kind: str, message: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": kind, "message": message}}

    def error_event(self, request: Recorded) -> bytes:
        return _named("error", self.error_body("overloaded_error", "Overloaded"))

    def events(self, request: Recorded, answer: dict[str, Any]) -> list[bytes]:
        usage = answer.get("usage", {})
        start = {**answer, "content": [], "stop_reason": None}
        # Input (with the cache's counts) at the start, output at the end, as Anthropic does.
        start["usage"] = {**usage, "output_tokens": 1}
        out = [_named("message_start", {"type": "message_start", "message": start})]
        for index, block in enumerate(answer["content"]):
            if block["type"] == "text":
                opened, deltas = (
                    {"type": "text", "text": ""},
                    [{"type": "text_delta", "text": piece} for piece in _pieces(block["text"])],
                )
            else:
                opened = {**block, "input": {}}
                deltas = [
                    {"type": "input_json_delta", "partial_json": piece}
                    for piece in _halves(json.dumps(block["input"]))
                ]
            out.append(
                _named(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": opened},
                )
            )
            out.append(_named("ping", {"type": "ping"}))
            for delta in deltas:
                out.append(
                    _named(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": delta},
                    )
                )
            out.append(_named("content_block_stop", {"type": "content_block_stop", "index": index}))
        delta = {"stop_reason": answer["stop_reason"], "stop_sequence": None}
        end_usage = {"output_tokens": usage.get("output_tokens", 0)}
        out.append(
            _named("message_delta", {"type": "message_delta", "delta": delta, "usage": end_usage})
        )
        out.append(_named("message_stop", {"type": "message_stop"}))
        return out


def _last_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last message, from a string or from text parts/blocks."""
    content = messages[-1].get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _dump(value: Any) -> bytes:
    return json.dumps(value).encode()


def _data(value: Any) -> bytes:
    return b"data: " + (value if isinstance(value, bytes) else _dump(value)) + b"\n\n"


def _named(kind: str, value: Any) -> bytes:
    return f"event: {kind}\n".encode() + _data(value)


def _pieces(text: str) -> list[str]:
    """Text in word-sized pieces, as a model streams it."""
    words = text.split(" ")
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def _halves(text: str) -> list[str]:
    middle = len(text) // 2
    return [text[:middle], text[middle:]]


def _chat_events(answer: dict[str, Any], usage: Any) -> list[bytes]:
    base = {k: answer[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _data({**base, "choices": [choice]})

    message = answer["choices"][0]["message"]
    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": piece}) for piece in _pieces(message.get("content") or "")]
    for index, call in enumerate(message.get("tool_calls") or []):
        first, second = _halves(call["function"]["arguments"])
        function = {"name": call["function"]["name"], "arguments": first}
        opened = {"index": index, "id": call["id"], "type": "function", "function": function}
        out.append(chunk({"tool_calls": [opened]}))
        out.append(chunk({"tool_calls": [{"index": index, "function": {"arguments": second}}]}))
    out.append(chunk({}, answer["choices"][0]["finish_reason"]))
    if usage is not None:
        out.append(_data({**base, "choices": [], "usage": usage}))
    return [*out, _data(b"[DONE]")]


def _completion(body: dict[str, Any], text: str) -> dict[str, Any]:
    return {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body["model"],
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }


def _completion_events(answer: dict[str, Any], usage: Any) -> list[bytes]:
    base = {k: answer[k] for k in ("id", "object", "created", "model")}
    out = [
        _data({**base, "choices": [{"index": 0, "text": piece, "finish_reason": None}]})
        for piece in _pieces(answer["choices"][0]["text"])
    ]
    out.append(_data({**base, "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}))
    if usage is not None:
        out.append(_data({**base, "choices": [], "usage": usage}))
    return [*out, _data(b"[DONE]")]


def _response(body: dict[str, Any], text: str) -> dict[str, Any]:
    item = {
        "type": "message",
        "id": "msg_fake",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    return {
        "id": "resp_fake",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "model": body["model"],
        "output": [item],
        "usage": {"input_tokens": 5, "output_tokens": 6, "total_tokens": 11},
    }


def _response_events(answer: dict[str, Any]) -> list[bytes]:
    text = answer["output"][0]["content"][0]["text"]
    created = {**answer, "status": "in_progress", "output": [], "usage": None}
    out = [_named("response.created", {"type": "response.created", "response": created})]
    for piece in _pieces(text):
        delta = {
            "type": "response.output_text.delta",
            "item_id": "msg_fake",
            "output_index": 0,
            "content_index": 0,
            "delta": piece,
        }
        out.append(_named(delta["type"], delta))
    out.append(_named("response.completed", {"type": "response.completed", "response": answer}))
    return out


async def _read_request(conn: h11.Connection, stream: trio.SocketStream) -> Recorded | None:
    request: h11.Request | None = None
    data = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            data += event.data
        elif isinstance(event, h11.EndOfMessage) and request is not None:
            try:
                body = json.loads(data)
            except ValueError:
                body = None
            return Recorded(
                method=request.method.decode(),
                path=request.target.decode(),
                headers={k.decode().lower(): v.decode() for k, v in request.headers},
                body=body,
            )
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def _send_response(
    conn: h11.Connection, stream: trio.SocketStream, status: int, body: bytes
) -> None:
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    out = conn.send(h11.Response(status_code=status, headers=headers))
    out += conn.send(h11.Data(data=body))
    out += conn.send(h11.EndOfMessage())
    await stream.send_all(out)
