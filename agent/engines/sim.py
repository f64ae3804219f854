"""The simulated engine: a small vLLM look-alike that answers deterministically.

It speaks the HTTP API of a real engine (OpenAI chat/completions/embeddings, vLLM
rerank and `/tokenize`, Anthropic messages, `/health`, `/v1/models`, vLLM-named
`/metrics`), so the
agent and router meet it exactly as they meet vLLM. Answers are a function of the
prompt; timing (TTFT, per-token latency), failures and stalls are set at start or at run
time through `/sim/state`. Benchmarks use it as the baseline engine, so the request path
does no logging and builds its stream chunks from pre-encoded pieces.

Run standalone: `python -m agent.engines.sim --model m --port 8000 [--token-latency 0.01]`.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import contextlib
import hashlib
import itertools
import json
import logging
import math
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from agent.engines.base import EngineAdapter
from agent.engines.vllm import VLLM_METRICS

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Receive, Send], Awaitable[None]]


class SimAdapter(EngineAdapter):
    """The agent starts the sim itself and passes its URL; it exposes vLLM's names."""

    name = "sim"
    metric_names = VLLM_METRICS


ADAPTER = SimAdapter()

JSON_TYPE = b"application/json"
TEXT_TYPE = b"text/plain; charset=utf-8"
METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
SSE_DONE = b"data: [DONE]\n\n"

# vLLM's own bucket bounds, so P90s read from the sim look like a real engine's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip

# Legacy completions default to 16 tokens in OpenAI's API and in vLLM.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Bounds the work one request can ask for; real embedding models stay far below.
MAX_EMBEDDING_DIM = 65536


@dataclass
class SimState:
    """Run-time knobs (settable through `POST /sim/state`) and counters."""

    token_latency: float
    ttft: float
    kv_cache_utilization: float | None = None  # None: follows the load
    healthy: bool = True
    # Anything but 200 makes `/metrics` fail with that status (an engine restarting).
    metrics_status: int = 200
    fail_status: int = 500
    fail_body: Any = None  # JSON value; a str is sent verbatim as text/plain
    fail_count: int = 0
    # When set, the failures are a 200 with a broken body of this shape (MALFORMED).
    malformed: str | None = None
    # A stream stops after this many tokens and hangs; a non-streamed answer never comes.
    stall_after_tokens: int | None = None
    requests_total: int = 0
    cancelled_total: int = 0
    in_flight: int = 0


def _number(low: float, high: float = math.inf) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("must be a number")
        if not low <= value <= high:
            raise ValueError(f"must be in [{low}, {high}]")
        return float(value)

    return check


def _integer(low: int, high: int | None = None) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("must be an integer")
        if value < low or (high is not None and value > high):
            raise ValueError(f"must be in [{low}, {high if high is not None else 'inf'}]")
        return value

    return check


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


_SETTERS: dict[str, Callable[[Any], Any]] = {
    "kv_cache_utilization": _optional(_number(0.0, 1.0)),
    "healthy": _boolean,
    "metrics_status": _integer(100, 599),
    "fail_status": _integer(100, 599),
    "fail_body": lambda value: value,
    "fail_count": _integer(0),
    "malformed": lambda value: _malformed_shape(value),
    "token_latency": _number(0.0),
    "ttft": _number(0.0),
    "stall_after_tokens": _optional(_integer(0)),
}


HTML_TYPE = b"text/html; charset=utf-8"
_CUT_EVENT = b'data: {"id":"chatcmpl-cut","object":"chat.completion.chunk","choi'
# The broken answers an engine or a proxy in front of it has been seen to give with a 200:
# shape -> (content type, body). "sse_bad_later" starts with one good event (chosen per
# protocol when sent) so that the break comes after bytes went to the client.
MALFORMED: dict[str, tuple[bytes, bytes]] = {
    "garbage": (JSON_TYPE, b"\x00\x17garbage{not json"),
    "empty": (JSON_TYPE, b""),
    "html": (HTML_TYPE, b"<html><body><h1>502 Bad Gateway</h1></body></html>\n"),
    "not_object": (JSON_TYPE, b'["not", "an", "object"]'),
    "sse_cut": (SSE_HEADERS[0][1], _CUT_EVENT),
    "sse_bad_data": (SSE_HEADERS[0][1], b"data: upstream hiccup, not json\n\n" + SSE_DONE),
    "sse_bad_later": (SSE_HEADERS[0][1], b"data: upstream hiccup, not json\n\n"),
}


def _malformed_shape(value: Any) -> str | None:
    if value is not None and value not in MALFORMED:
        raise ValueError(f"must be null or one of {', '.join(MALFORMED)}")
    return value


class _RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def _openai_error(error: _RequestError) -> bytes:
    return _dumps(
        {
            "object": "error",
            "message": error.message,
            "type": error.kind,
            "param": None,
            "code": error.status,
        }
    )


def _anthropic_error(error: _RequestError) -> bytes:
    kind = "not_found_error" if error.status == 404 else "invalid_request_error"
    return _dumps({"type": "error", "error": {"type": kind, "message": error.message}})


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class _Histogram:
    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.count = 0
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le is inclusive).
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.count += times
        self.total += value * times

    def render(self, name: str, labels: str, out: list[str]) -> None:
        cumulative = 0
        for bound, count in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            cumulative += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(cumulative)}')
        out.append(f"{name}_count{{{labels}}} {float(self.count)}")
        out.append(f"{name}_sum{{{labels}}} {self.total!r}")


class _Exchange:
    """One response; `done` is set before the last body message is handed over.

    Hypercorn reports `http.disconnect` while that last message is being sent; the flag
    tells the watcher that the client got the whole answer and did not leave early.
    """

    __slots__ = ("_send", "done")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.done = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, data: bytes) -> None:
        self.done = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def reply(self, status: int, body: bytes, content_type: bytes = JSON_TYPE) -> None:
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
        await self.start(status, headers)
        await self.finish(body)


@dataclass(slots=True)
class _Job:
    """A generation: the answer as it is streamed, one piece per token."""

    pieces: list[str]
    prompt_tokens: int
    finish: str  # "stop" or "length" (OpenAI's names)
    started: float


Run = Callable[[_Exchange], Awaitable[None]]


def _words(text: str) -> list[str]:
    return text.split()


def _content_text(content: Any) -> str:
    """Text of an OpenAI or Anthropic message content: a string or a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _answer(words: list[str], limit: int | None, ignore_eos: bool) -> tuple[list[str], str]:
    """Deterministic answer pieces for the prompt words, and the finish reason."""
    answer = ["Echo:", *words]
    if ignore_eos and limit is not None:
        # vLLM's ignore_eos generates until max_tokens: benchmarks use it for fixed lengths.
        answer = list(itertools.islice(itertools.cycle(answer), limit))
        finish = "length"
    elif limit is not None and len(answer) > limit:
        answer = answer[:limit]
        finish = "length"
    else:
        finish = "stop"
    return [answer[0], *(" " + w for w in answer[1:])] if answer else [], finish


def _embedding(key: bytes, dim: int) -> list[float]:
    raw = struct.unpack(f"<{dim}H", hashlib.shake_256(key).digest(2 * dim))
    vector = [v / 32767.5 - 1.0 for v in raw]
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def _sse_event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _dumps(data) + b"\n\n"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class SimEngine:
    """The ASGI app; `state` holds the run-time knobs and counters."""

    def __init__(
        self,
        model: str,
        *,
        token_latency: float,
        ttft: float,
        max_context: int,
        capacity: int,
        embedding_dim: int,
    ) -> None:
        if capacity <= 0 or max_context <= 0 or embedding_dim <= 0:
            raise ValueError("capacity, max_context and embedding_dim must be positive")
        self.model = model
        self.max_context = max_context
        self.capacity = capacity
        self.embedding_dim = embedding_dim
        self.state = SimState(token_latency=token_latency, ttft=ttft)
        # The engine's scheduler: at most `capacity` requests run, the rest wait.
        self._slots = trio.Semaphore(capacity)
        self._ids = itertools.count(1)
        self._ttft = _Histogram(TTFT_BUCKETS)
        self._itl = _Histogram(ITL_BUCKETS)
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._model_json = _dumps(model)
        self._labels = f'engine="0",model_name="{_escape_label(model)}"'
        self._models_body = _dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "vllm",
                        "root": model,
                        "parent": None,
                        "max_model_len": max_context,
                    }
                ],
            }
        )
        openai = partial(self._inference, render_error=_openai_error)
        self._routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            "/metrics": {"GET": self._metrics},
            "/sim/state": {"GET": self._get_state, "POST": self._set_state},
            "/v1/chat/completions": {"POST": partial(openai, prepare=self._prepare_chat)},
            "/v1/completions": {"POST": partial(openai, prepare=self._prepare_completion)},
            "/v1/embeddings": {"POST": partial(openai, prepare=self._prepare_embeddings)},
            "/v1/rerank": {"POST": partial(openai, prepare=self._prepare_rerank)},
            "/tokenize": {"POST": partial(openai, prepare=self._prepare_tokenize)},
            "/v1/messages": {
                "POST": partial(
                    self._inference, render_error=_anthropic_error, prepare=self._prepare_messages
                )
            },
        }

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        methods = self._routes.get(scope["path"])
        if methods is None:
            await _Exchange(send).reply(404, b'{"detail":"Not Found"}')
            return
        handler = methods.get(scope["method"])
        if handler is None:
            await _Exchange(send).reply(405, b'{"detail":"Method Not Allowed"}')
            return
        await handler(receive, send)

    # -- plain endpoints --------------------------------------------------------------

    async def _health(self, receive: Receive, send: Send) -> None:
        await _Exchange(send).reply(200 if self.state.healthy else 503, b"", TEXT_TYPE)

    async def _models(self, receive: Receive, send: Send) -> None:
        await _Exchange(send).reply(200, self._models_body)

    async def _metrics(self, receive: Receive, send: Send) -> None:
        status = self.state.metrics_status
        if status != 200:
            await _Exchange(send).reply(status, b"metrics unavailable\n", TEXT_TYPE)
            return
        await _Exchange(send).reply(200, self.render_metrics().encode(), METRICS_TYPE)

    async def _get_state(self, receive: Receive, send: Send) -> None:
        await _Exchange(send).reply(200, _dumps(asdict(self.state)))

    async def _set_state(self, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        if body is None:
            return
        try:
            self.update_state(json.loads(body or b"{}"))
        except ValueError as exc:
            await _Exchange(send).reply(400, _dumps({"detail": str(exc)}))
            return
        await _Exchange(send).reply(200, _dumps(asdict(self.state)))

    def update_state(self, changes: Any) -> None:
        """Apply `/sim/state` changes all or nothing; ValueError names the bad key."""
        if not isinstance(changes, dict):
            raise ValueError("expected a JSON object")
        checked: dict[str, Any] = {}
        for key, value in changes.items():
            setter = _SETTERS.get(key)
            if setter is None:
                raise ValueError(f"unknown setting {key!r}; settable: {', '.join(_SETTERS)}")
            try:
                checked[key] = setter(value)
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
        for key, value in checked.items():
            setattr(self.state, key, value)

    def render_metrics(self) -> str:
        running = self.capacity - self._slots.value
        waiting = self.state.in_flight - running
        kv = self.state.kv_cache_utilization
        if kv is None:
            kv = running / self.capacity
        labels = self._labels
        out = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {float(kv)!r}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(self._prompt_tokens)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(self._generation_tokens)}",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
        ]
        self._ttft.render("vllm:time_to_first_token_seconds", labels, out)
        out += [
            "# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.",
            "# TYPE vllm:inter_token_latency_seconds histogram",
        ]
        self._itl.render("vllm:inter_token_latency_seconds", labels, out)
        out.append("")
        return "\n".join(out)

    # -- inference --------------------------------------------------------------------

    async def _inference(
        self,
        receive: Receive,
        send: Send,
        *,
        prepare: Callable[[dict[str, Any], float], Run],
        render_error: Callable[[_RequestError], bytes],
    ) -> None:
        started = time.monotonic()
        body = await _read_body(receive)
        if body is None:
            return
        state = self.state
        state.requests_total += 1
        exchange = _Exchange(send)
        if state.fail_count > 0:
            state.fail_count -= 1
            await self._reply_failure(exchange, render_error is _anthropic_error)
            return
        try:
            payload = json.loads(body)
        except ValueError as exc:
            await exchange.reply(400, render_error(_RequestError(400, f"invalid JSON: {exc}")))
            return
        try:
            if not isinstance(payload, dict):
                raise _RequestError(400, "the request body must be a JSON object")
            model = payload.get("model")
            if model is not None and model != self.model:
                raise _RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")
            run = prepare(payload, started)
        except _RequestError as exc:
            await exchange.reply(exc.status, render_error(exc))
            return
        state.in_flight += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, exchange, nursery.cancel_scope)
                await run(exchange)
                nursery.cancel_scope.cancel()
        finally:
            state.in_flight -= 1

    async def _watch_disconnect(
        self, receive: Receive, exchange: _Exchange, scope: trio.CancelScope
    ) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not exchange.done:
            self.state.cancelled_total += 1
            scope.cancel()

    async def _reply_failure(self, exchange: _Exchange, anthropic: bool) -> None:
        if self.state.malformed is not None:
            await self._reply_malformed(exchange, self.state.malformed, anthropic)
            return
        status, body = self.state.fail_status, self.state.fail_body
        if isinstance(body, str):
            await exchange.reply(status, body.encode(), TEXT_TYPE)
        elif body is None:
            error = _RequestError(status, "simulated failure", "InternalServerError")
            await exchange.reply(status, _openai_error(error))
        else:
            await exchange.reply(status, _dumps(body))

    async def _reply_malformed(self, exchange: _Exchange, shape: str, anthropic: bool) -> None:
        content_type, body = MALFORMED[shape]
        if shape == "sse_bad_later":
            first = (
                _sse_event("ping", {"type": "ping"})
                if anthropic
                else b'data: {"id":"chatcmpl-bad","object":"chat.completion.chunk","created":0,'
                b'"model":%s,"choices":[{"index":0,"delta":{"role":"assistant","content":'
                b'"Echo:"},"logprobs":null,"finish_reason":null}]}\n\n' % self._model_json
            )
            # Two writes a token apart: the good event leaves before the broken one.
            await exchange.start(200, [(b"content-type", content_type)])
            await exchange.chunk(first)
            await trio.sleep(self.state.token_latency)
            await exchange.finish(body)
            return
        await exchange.reply(200, body, content_type)

    def _check_context(self, prompt_tokens: int, max_tokens: int | None) -> None:
        # vLLM's wording: clients and the router recognise a context overflow by it.
        limit = self.max_context
        if prompt_tokens > limit:
            raise _RequestError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens} tokens in the messages, Please reduce the "
                "length of the messages.",
            )
        if max_tokens is not None and prompt_tokens + max_tokens > limit:
            raise _RequestError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
            )

    def _job(
        self,
        words: list[str],
        prompt_tokens: int,
        max_tokens: int | None,
        payload: dict[str, Any],
        started: float,
    ) -> _Job:
        self._check_context(prompt_tokens, max_tokens)
        limit = max_tokens if max_tokens is not None else self.max_context - prompt_tokens
        pieces, finish = _answer(words, limit, payload.get("ignore_eos") is True)
        return _Job(pieces, prompt_tokens, finish, started)

    async def _generate(
        self, job: _Job, emit: Callable[[int, str], Awaitable[None]] | None
    ) -> None:
        """Prefill then decode, observing the TTFT and ITL a client of this engine sees."""
        state = self.state
        self._prompt_tokens += job.prompt_tokens
        if state.ttft > 0:
            await trio.sleep(state.ttft)
        last = time.monotonic()
        self._ttft.observe(last - job.started)
        pieces = job.pieces
        if emit is None:
            stall = state.stall_after_tokens
            if stall is not None and stall < len(pieces):
                await trio.sleep_forever()
            gaps = len(pieces) - 1
            if gaps > 0:
                if state.token_latency > 0:
                    await trio.sleep(state.token_latency * gaps)
                # One sleep for the whole decode: its gaps are spread evenly.
                self._itl.observe((time.monotonic() - last) / gaps, gaps)
            self._generation_tokens += len(pieces)
            return
        for index, piece in enumerate(pieces):
            if index:
                if state.token_latency > 0:
                    await trio.sleep(state.token_latency)
                now = time.monotonic()
                self._itl.observe(now - last)
                last = now
            stall = state.stall_after_tokens
            if stall is not None and index >= stall:
                await trio.sleep_forever()
            await emit(index, piece)
            self._generation_tokens += 1

    # OpenAI chat -------------------------------------------------------------------

    def _prepare_chat(self, payload: dict[str, Any], started: float) -> Run:
        prompt_tokens, last_user = _conversation(payload.get("messages"))
        max_tokens = _max_tokens(payload, "max_completion_tokens", "max_tokens")
        job = self._job(last_user, prompt_tokens, max_tokens, payload, started)
        if payload.get("stream") is True:
            return partial(self._chat_stream, job, _include_usage(payload))
        return partial(self._chat_full, job)

    def _usage(self, job: _Job) -> dict[str, int]:
        completion = len(job.pieces)
        return {
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion,
        }

    async def _chat_full(self, job: _Job, exchange: _Exchange) -> None:
        async with self._slots:
            await self._generate(job, None)
        body = {
            "id": f"chatcmpl-sim{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(job.pieces)},
                    "logprobs": None,
                    "finish_reason": job.finish,
                }
            ],
            "usage": self._usage(job),
        }
        await exchange.reply(200, _dumps(body))

    async def _chat_stream(self, job: _Job, include_usage: bool, exchange: _Exchange) -> None:
        request_id = f"chatcmpl-sim{next(self._ids)}"
        head = (
            b'data: {"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s,'
            b'"choices":[{"index":0,"delta":{'
        ) % (request_id.encode(), int(time.time()), self._model_json)
        open_tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        role = head + b'"role":"assistant","content":""' + open_tail

        async def emit(index: int, piece: str) -> None:
            data = head + b'"content":' + _dumps(piece) + open_tail
            await exchange.chunk(role + data if index == 0 else data)

        await exchange.start(200, SSE_HEADERS)
        async with self._slots:
            await self._generate(job, emit)
        end = head + b'},"logprobs":null,"finish_reason":"%s"}]}\n\n' % job.finish.encode()
        await self._finish_stream(
            exchange, end, request_id, "chat.completion.chunk", job, include_usage
        )

    async def _finish_stream(
        self,
        exchange: _Exchange,
        end: bytes,
        request_id: str,
        kind: str,
        job: _Job,
        include_usage: bool,
    ) -> None:
        """The last chunk, the usage chunk when asked for (`stream_options`), `[DONE]`."""
        if include_usage:
            usage = {
                "id": request_id,
                "object": kind,
                "created": int(time.time()),
                "model": self.model,
                "choices": [],
                "usage": self._usage(job),
            }
            end += b"data: " + _dumps(usage) + b"\n\n"
        await exchange.finish(end + SSE_DONE)

    # OpenAI completions ------------------------------------------------------------

    def _prepare_completion(self, payload: dict[str, Any], started: float) -> Run:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise _RequestError(400, "`prompt` must be a string (one prompt per request)")
        words = _words(prompt)
        max_tokens = _max_tokens(payload, "max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS
        job = self._job(words, len(words), max_tokens, payload, started)
        if payload.get("stream") is True:
            return partial(self._completion_stream, job, _include_usage(payload))
        return partial(self._completion_full, job)

    async def _completion_full(self, job: _Job, exchange: _Exchange) -> None:
        async with self._slots:
            await self._generate(job, None)
        body = {
            "id": f"cmpl-sim{next(self._ids)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(job.pieces),
                    "logprobs": None,
                    "finish_reason": job.finish,
                }
            ],
            "usage": self._usage(job),
        }
        await exchange.reply(200, _dumps(body))

    async def _completion_stream(self, job: _Job, include_usage: bool, exchange: _Exchange) -> None:
        request_id = f"cmpl-sim{next(self._ids)}"
        head = (
            b'data: {"id":"%s","object":"text_completion","created":%d,"model":%s,'
            b'"choices":[{"index":0,"text":'
        ) % (request_id.encode(), int(time.time()), self._model_json)

        async def emit(index: int, piece: str) -> None:
            await exchange.chunk(
                head + _dumps(piece) + b',"logprobs":null,"finish_reason":null}]}\n\n'
            )

        await exchange.start(200, SSE_HEADERS)
        async with self._slots:
            await self._generate(job, emit)
        end = head + b'"","logprobs":null,"finish_reason":"%s"}]}\n\n' % job.finish.encode()
        await self._finish_stream(exchange, end, request_id, "text_completion", job, include_usage)

    # Anthropic messages ------------------------------------------------------------

    def _prepare_messages(self, payload: dict[str, Any], started: float) -> Run:
        max_tokens = _max_tokens(payload, "max_tokens")
        if max_tokens is None:
            # Required by Anthropic's API, unlike OpenAI's.
            raise _RequestError(400, "max_tokens: Field required")
        system_tokens = len(_words(_content_text(payload.get("system"))))
        prompt_tokens, last_user = _conversation(payload.get("messages"), system_tokens)
        job = self._job(last_user, prompt_tokens, max_tokens, payload, started)
        if payload.get("stream") is True:
            return partial(self._messages_stream, job)
        return partial(self._messages_full, job)

    @staticmethod
    def _stop_reason(job: _Job) -> str:
        return "max_tokens" if job.finish == "length" else "end_turn"

    async def _messages_full(self, job: _Job, exchange: _Exchange) -> None:
        async with self._slots:
            await self._generate(job, None)
        body = {
            "id": f"msg_sim{next(self._ids)}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [{"type": "text", "text": "".join(job.pieces)}],
            "stop_reason": self._stop_reason(job),
            "stop_sequence": None,
            "usage": {"input_tokens": job.prompt_tokens, "output_tokens": len(job.pieces)},
        }
        await exchange.reply(200, _dumps(body))

    async def _messages_stream(self, job: _Job, exchange: _Exchange) -> None:
        message = {
            "id": f"msg_sim{next(self._ids)}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": job.prompt_tokens, "output_tokens": 0},
        }
        delta_head = (
            b"event: content_block_delta\ndata: "
            b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":'
        )

        async def emit(index: int, piece: str) -> None:
            await exchange.chunk(delta_head + _dumps(piece) + b"}}\n\n")

        await exchange.start(200, SSE_HEADERS)
        await exchange.chunk(
            _sse_event("message_start", {"type": "message_start", "message": message})
            + _sse_event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            )
        )
        async with self._slots:
            await self._generate(job, emit)
        await exchange.finish(
            _sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _sse_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": self._stop_reason(job), "stop_sequence": None},
                    "usage": {"output_tokens": len(job.pieces)},
                },
            )
            + _sse_event("message_stop", {"type": "message_stop"})
        )

    # Pooling: embeddings and rerank ------------------------------------------------

    async def _prefill(self, prompt_tokens: int) -> None:
        async with self._slots:
            self._prompt_tokens += prompt_tokens
            if self.state.ttft > 0:
                await trio.sleep(self.state.ttft)

    def _prepare_embeddings(self, payload: dict[str, Any], started: float) -> Run:
        items = payload.get("input")
        if isinstance(items, str) or (
            isinstance(items, list) and items and all(isinstance(t, int) for t in items)
        ):
            items = [items]
        if not isinstance(items, list) or not items:
            raise _RequestError(400, "`input` must be a string, a list of strings or token ids")
        inputs: list[tuple[bytes, int]] = []
        for item in items:
            if isinstance(item, str):
                inputs.append((item.encode(), len(_words(item))))
            elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                inputs.append((_dumps(item), len(item)))
            else:
                raise _RequestError(400, "`input` items must be strings or lists of token ids")
        for _, tokens in inputs:
            if tokens > self.max_context:
                raise _RequestError(
                    400,
                    f"This model's maximum context length is {self.max_context} tokens. "
                    f"However, you requested {tokens} tokens in the input for embedding "
                    "generation. Please reduce the length of the input.",
                )
        dim = payload.get("dimensions") or self.embedding_dim
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 < dim <= MAX_EMBEDDING_DIM:
            raise _RequestError(400, f"`dimensions` must be an integer in [1, {MAX_EMBEDDING_DIM}]")
        encoding = payload.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise _RequestError(400, "`encoding_format` must be 'float' or 'base64'")
        return partial(self._embeddings, inputs, dim, encoding == "base64")

    async def _embeddings(
        self, inputs: list[tuple[bytes, int]], dim: int, as_base64: bool, exchange: _Exchange
    ) -> None:
        prompt_tokens = sum(tokens for _, tokens in inputs)
        await self._prefill(prompt_tokens)
        data = []
        for index, (key, _) in enumerate(inputs):
            vector = _embedding(key, dim)
            encoded: list[float] | str = (
                base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode() if as_base64 else vector
            )
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        body = {
            "id": f"embd-sim{next(self._ids)}",
            "object": "list",
            "created": int(time.time()),
            "model": self.model,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
        await exchange.reply(200, _dumps(body))

    def _prepare_rerank(self, payload: dict[str, Any], started: float) -> Run:
        query = payload.get("query")
        documents = payload.get("documents")
        if not isinstance(query, str) or not isinstance(documents, list):
            raise _RequestError(400, "`query` must be a string and `documents` a list")
        texts = []
        for document in documents:
            if isinstance(document, dict):
                document = document.get("text")
            if not isinstance(document, str):
                raise _RequestError(400, "each document must be a string or {'text': ...}")
            texts.append(document)
        top_n = payload.get("top_n") or len(texts)
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
            raise _RequestError(400, "`top_n` must be a non-negative integer")
        return partial(self._rerank, query, texts, top_n)

    async def _rerank(self, query: str, texts: list[str], top_n: int, exchange: _Exchange) -> None:
        query_words = _words(query)
        wanted = {w.lower() for w in query_words}
        scored = []
        tokens = 0
        for index, text in enumerate(texts):
            words = _words(text)
            tokens += len(query_words) + len(words)
            # Share of the query's words found in the document: deterministic and ordered
            # the way a test author expects.
            found = wanted.intersection(w.lower() for w in words)
            scored.append((len(found) / len(wanted) if wanted else 0.0, index, text))
        await self._prefill(tokens)
        scored.sort(key=lambda item: (-item[0], item[1]))
        body = {
            "id": f"rerank-sim{next(self._ids)}",
            "model": self.model,
            "usage": {"total_tokens": tokens},
            "results": [
                {"index": index, "document": {"text": text}, "relevance_score": score}
                for score, index, text in scored[:top_n]
            ],
        }
        await exchange.reply(200, _dumps(body))

    # vLLM tokenize --------------------------------------------------------------------

    def _prepare_tokenize(self, payload: dict[str, Any], started: float) -> Run:
        """vLLM's `/tokenize`: a chat (`messages`) or a `prompt`, counted as generation is."""
        if "messages" in payload:
            count, _ = _conversation(payload["messages"])
            words = [
                w for m in payload["messages"] for w in _words(_content_text(m.get("content")))
            ]
        elif isinstance(payload.get("prompt"), str):
            words = _words(payload["prompt"])
            count = len(words)
        else:
            raise _RequestError(400, "either `messages` or `prompt` (a string) is required")
        # Word ids stand in for token ids; the count is what generation reports as usage.
        tokens = [int.from_bytes(hashlib.blake2s(w.encode()).digest()[:2]) for w in words]
        body = _dumps({"count": count, "max_model_len": self.max_context, "tokens": tokens})

        async def run(exchange: _Exchange) -> None:
            await exchange.reply(200, body)

        return run


def _conversation(messages: Any, prompt_tokens: int = 0) -> tuple[int, list[str]]:
    """Prompt size and the last user turn's words of an OpenAI or Anthropic message list."""
    if not isinstance(messages, list) or not messages:
        raise _RequestError(400, "`messages` must be a non-empty list")
    last_user: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise _RequestError(400, "each message must be an object")
        words = _words(_content_text(message.get("content")))
        prompt_tokens += len(words)
        if message.get("role") == "user":
            last_user = words
    return prompt_tokens, last_user


def _max_tokens(payload: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = payload.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _RequestError(400, f"`{key}` must be a positive integer")
        return value
    return None


def _include_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client left before sending it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def create_sim_app(
    model: str,
    *,
    token_latency: float = 0.0,
    ttft: float = 0.0,
    max_context: int = 4096,
    capacity: int = 64,
    embedding_dim: int = 8,
) -> SimEngine:
    return SimEngine(
        model,
        token_latency=token_latency,
        ttft=ttft,
        max_context=max_context,
        capacity=capacity,
        embedding_dim=embedding_dim,
    )


async def serve_sim(
    app: SimEngine,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` until cancelled; `task_status.started` gets the bound port (port 0 picks one)."""
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    # A Logger (not hypercorn's default "-") gets no handler of hypercorn's own: its
    # records reach the host process's logging configuration, once.
    config.errorlog = logging.getLogger("hypercorn.error")
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(partial(serve, app, config, mode="asgi"))
        task_status.started(int(binds[0].rsplit(":", 1)[1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m agent.engines.sim", description="Simulated vLLM-like inference engine."
    )
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-latency", type=float, default=0.0, help="seconds per token")
    parser.add_argument("--ttft", type=float, default=0.0, help="seconds to the first token")
    parser.add_argument("--max-context", type=int, default=4096, help="context limit in words")
    parser.add_argument("--capacity", type=int, default=64, help="requests run at once")
    parser.add_argument("--embedding-dim", type=int, default=8)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    app = create_sim_app(
        args.model,
        token_latency=args.token_latency,
        ttft=args.ttft,
        max_context=args.max_context,
        capacity=args.capacity,
        embedding_dim=args.embedding_dim,
    )
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(serve_sim, app, args.host, args.port)


if __name__ == "__main__":
    main()
