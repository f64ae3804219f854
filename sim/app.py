"""The simulated engine as one ASGI app: routing, the scheduler, prefill and decode.

Each look-alike API (`sim.openai`, `sim.anthropic`, `sim.vllm`) turns a request into a
`Run`; the engine admits it, watches for the client leaving, and times the generation
the way a client of a real engine sees it: a prefill of `ttft` plus
`prefill_token_latency` per prompt token missing from the prefix cache (in every slot
at once, or with `prefill_shared` one prompt after another), then one `token_latency`
gap per generated token.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import trio

from sim import anthropic, openai, vllm
from sim.asgi import (
    JSON_TYPE,
    TEXT_TYPE,
    Exchange,
    Handler,
    Receive,
    Send,
    dumps,
    lifespan,
    read_body,
)
from sim.faults import reply_failure
from sim.generation import Emit, Job, RequestError, Run, answer, check_context
from sim.metrics import KINDS, METRICS_TYPE, EngineMetrics
from sim.prefix_cache import PrefixCache, block_hashes
from sim.state import DEFAULT_PREFIX_BLOCK_TOKENS, DEFAULT_PREFIX_CACHE_BLOCKS, SimState
from sim.tools import ToolCall

Prepare = Callable[["SimEngine", dict[str, Any], float], Run]
ErrorBody = Callable[[RequestError], bytes]

# Each engine's answer to a path it does not serve: FastAPI's (vLLM, SGLang),
# llama-server's, Ollama's (Go's net/http).
_NOT_FOUND = {
    "vllm": (b'{"detail":"Not Found"}', JSON_TYPE),
    "sglang": (b'{"detail":"Not Found"}', JSON_TYPE),
    "llamacpp": (
        b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}',
        JSON_TYPE,
    ),
    "ollama": (b"404 page not found", TEXT_TYPE),
}
# `owned_by` in each engine's `/v1/models`.
_OWNER = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "ollama": "library"}
# llama-server's health answers, ready and loading.
_LLAMACPP_OK = b'{"status":"ok"}'
_LLAMACPP_LOADING = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
# What `/api/version` reports; the agent reads no version.
OLLAMA_VERSION = "0.12.6"


def ollama_name(model: str) -> str:
    """The name Ollama lists a model under: a name without a tag is `:latest`."""
    return model if ":" in model.rpartition("/")[2] else f"{model}:latest"


class SimEngine:
    """The ASGI app; `state` holds the run-time knobs and counters."""

    def __init__(
        self,
        model: str,
        *,
        kind: str = "vllm",
        token_latency: float,
        ttft: float,
        max_context: int,
        capacity: int,
        embedding_dim: int,
        prefill_token_latency: float,
        prefill_shared: bool,
        prefix_block_tokens: int,
        prefix_cache_blocks: int,
    ) -> None:
        if capacity <= 0 or max_context <= 0 or embedding_dim <= 0:
            raise ValueError("capacity, max_context and embedding_dim must be positive")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
        self.kind = kind
        self.model = model
        # Ollama takes a model's name with or without its implicit `:latest`.
        self.model_names = {model, ollama_name(model)} if kind == "ollama" else {model}
        self.model_json = dumps(model)
        self.max_context = max_context
        self.capacity = capacity
        self.embedding_dim = embedding_dim
        self.state = SimState(token_latency=token_latency, ttft=ttft)
        # Checked as `/sim/state` checks them: a bad start-up value is a ValueError.
        self.state.update(
            {
                "prefill_token_latency": prefill_token_latency,
                "prefill_shared": prefill_shared,
                "prefix_block_tokens": prefix_block_tokens,
                "prefix_cache_blocks": prefix_cache_blocks,
            }
        )
        self.metrics = EngineMetrics(model, kind)
        self.prefix_cache = PrefixCache()
        # The engine's scheduler: at most `capacity` requests run, the rest wait.
        self._slots = trio.Semaphore(capacity)
        # With `prefill_shared`, the one prefill that runs; trio's Lock is FIFO.
        self._prefill_lane = trio.Lock()
        # Set when `hold` turns false: the held requests go on.
        self._released = trio.Event()
        self._ids = itertools.count(1)
        self._models_body = dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": _OWNER[kind],
                        "root": model,
                        "parent": None,
                        "max_model_len": max_context,
                    }
                ],
            }
        )
        self._routes = self._routes_of(kind)

    def _routes_of(self, kind: str) -> dict[str, dict[str, Handler]]:
        """The paths `kind` serves (agent/engines/endpoints.py lists the same per engine)."""
        routes: dict[str, dict[str, Handler]] = {
            "/v1/models": {"GET": self._models},
            "/sim/state": {"GET": self._get_state, "POST": self._set_state},
            "/v1/chat/completions": {"POST": self._api(openai.prepare_chat, openai.error_body)},
            "/v1/completions": {"POST": self._api(openai.prepare_completion, openai.error_body)},
            "/v1/responses": {"POST": self._api(openai.prepare_response, openai.error_body)},
            "/v1/embeddings": {"POST": self._api(openai.prepare_embeddings, openai.error_body)},
            "/v1/messages": {"POST": self._api(anthropic.prepare_messages, anthropic.error_body)},
        }
        if kind == "ollama":
            # No /health, /metrics, rerank or /tokenize: its own API says it is up.
            routes["/"] = {"GET": self._ollama_root}
            routes["/api/version"] = {"GET": self._ollama_version}
            routes["/api/tags"] = {"GET": self._ollama_tags}
            routes["/api/ps"] = {"GET": self._ollama_tags}
            return routes
        routes["/health"] = {"GET": self._health}
        routes["/metrics"] = {"GET": self._metrics}
        routes["/v1/rerank"] = {"POST": self._api(vllm.prepare_rerank, openai.error_body)}
        # vLLM's form, which SGLang's text form is a part of; llama-server's takes
        # `content` and answers the token ids alone.
        tokenize = vllm.prepare_llamacpp_tokenize if kind == "llamacpp" else vllm.prepare_tokenize
        routes["/tokenize"] = {"POST": self._api(tokenize, openai.error_body)}
        return routes

    def _api(self, prepare: Prepare, error_body: ErrorBody) -> Handler:
        return partial(self._inference, prepare=partial(prepare, self), error_body=error_body)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        methods = self._routes.get(scope["path"])
        if methods is None or scope["path"] in self.state.missing_routes:
            await Exchange(send).reply(404, *_NOT_FOUND[self.kind])
            return
        handler = methods.get(scope["method"])
        if handler is None:
            await Exchange(send).reply(405, b'{"detail":"Method Not Allowed"}')
            return
        if scope["method"] == "POST" and scope["path"] != "/sim/state":
            # What reached the engine, for tests of what the agent forwards.
            self.state.last_headers = {
                k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
            }
        await handler(receive, send)

    def next_id(self) -> int:
        """The number in the next response id (`chatcmpl-sim7`)."""
        return next(self._ids)

    # -- plain endpoints --------------------------------------------------------------

    async def _health(self, receive: Receive, send: Send) -> None:
        status = 200 if self.state.healthy else 503
        if self.kind == "llamacpp":
            await Exchange(send).reply(status, _LLAMACPP_OK if status == 200 else _LLAMACPP_LOADING)
            return
        await Exchange(send).reply(status, b"", TEXT_TYPE)

    async def _ollama_root(self, receive: Receive, send: Send) -> None:
        await Exchange(send).reply(200, b"Ollama is running", TEXT_TYPE)

    async def _ollama_version(self, receive: Receive, send: Send) -> None:
        await Exchange(send).reply(200, dumps({"version": OLLAMA_VERSION}))

    async def _ollama_tags(self, receive: Receive, send: Send) -> None:
        """`/api/tags` (pulled) and `/api/ps` (loaded): the one model, always loaded.
        Unhealthy, the list is empty, as when the model was removed: Ollama itself
        stays up, and the agent's health check is that its model is listed."""
        name = ollama_name(self.model)
        entry = {
            "name": name,
            "model": name,
            "size": 0,
            "digest": hashlib.sha256(name.encode()).hexdigest(),
            "details": {"format": "gguf", "family": "sim"},
        }
        await Exchange(send).reply(200, dumps({"models": [entry] if self.state.healthy else []}))

    async def _models(self, receive: Receive, send: Send) -> None:
        await Exchange(send).reply(200, self._models_body)

    async def _metrics(self, receive: Receive, send: Send) -> None:
        status = self.state.metrics_status
        if status != 200:
            await Exchange(send).reply(status, b"metrics unavailable\n", TEXT_TYPE)
            return
        await Exchange(send).reply(200, self.render_metrics().encode(), METRICS_TYPE)

    async def _get_state(self, receive: Receive, send: Send) -> None:
        await Exchange(send).reply(200, dumps(asdict(self.state)))

    async def _set_state(self, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        if body is None:
            return
        try:
            self.update_state(json.loads(body or b"{}"))
        except ValueError as exc:
            await Exchange(send).reply(400, dumps({"detail": str(exc)}))
            return
        await Exchange(send).reply(200, dumps(asdict(self.state)))

    def update_state(self, changes: Any) -> None:
        """Apply `/sim/state` changes all or nothing; ValueError names the bad key."""
        self.state.update(changes)
        if not self.state.hold:
            self._released.set()
            self._released = trio.Event()

    async def _held(self) -> None:
        while self.state.hold:
            await self._released.wait()

    def render_metrics(self) -> str:
        running = self.capacity - self._slots.value
        waiting = self.state.in_flight - running
        kv = self.state.kv_cache_utilization
        if kv is None:
            kv = running / self.capacity
        return self.metrics.render(running, waiting, kv)

    # -- inference --------------------------------------------------------------------

    async def _inference(
        self,
        receive: Receive,
        send: Send,
        *,
        prepare: Callable[[dict[str, Any], float], Run],
        error_body: ErrorBody,
    ) -> None:
        started = time.monotonic()
        body = await read_body(receive)
        if body is None:
            return
        state = self.state
        state.requests_total += 1
        exchange = Exchange(send)
        if state.fail_count > 0:
            state.fail_count -= 1
            await reply_failure(
                exchange, state, self.model_json, error_body is anthropic.error_body
            )
            return
        try:
            payload = json.loads(body)
        except ValueError as exc:
            await exchange.reply(400, error_body(RequestError(400, f"invalid JSON: {exc}")))
            return
        try:
            if not isinstance(payload, dict):
                raise RequestError(400, "the request body must be a JSON object")
            model = payload.get("model")
            if model is not None and model not in self.model_names:
                raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")
            run = prepare(payload, started)
        except RequestError as exc:
            await exchange.reply(exc.status, error_body(exc))
            return
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, exchange, nursery.cancel_scope)
                await run(exchange)
                nursery.cancel_scope.cancel()
        finally:
            state.in_flight -= 1

    async def _watch_disconnect(
        self, receive: Receive, exchange: Exchange, scope: trio.CancelScope
    ) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not exchange.done:
            self.state.cancelled_total += 1
            scope.cancel()

    def job(
        self,
        prompt: list[str],
        last_user: list[str],
        max_tokens: int | None,
        payload: dict[str, Any],
        started: float,
        skip: int = 0,
    ) -> Job:
        """The generation a request asks for, checked against the context limit; `skip`
        answer words are already in a prefilled assistant turn."""
        prompt_tokens = len(prompt)
        check_context(self.max_context, prompt_tokens, max_tokens)
        limit = max_tokens if max_tokens is not None else self.max_context - prompt_tokens
        pieces, finish = answer(last_user, limit, payload.get("ignore_eos") is True, skip)
        return Job(prompt, pieces, finish, started)

    def tool_job(
        self, prompt: list[str], call: ToolCall, max_tokens: int | None, started: float
    ) -> Job:
        """The generation of a scripted tool call (sim/tools.py): its arguments' pieces,
        cut at `max_tokens` as an engine cuts them (`length`), else `tool_calls`."""
        check_context(self.max_context, len(prompt), max_tokens)
        pieces = call.pieces()
        if max_tokens is not None and len(pieces) > max_tokens:
            return Job(prompt, pieces[:max_tokens], "length", started)
        return Job(prompt, pieces, "tool_calls", started)

    async def prefill(self, prompt_tokens: int) -> None:
        """A pooling request (embeddings, rerank): a slot for the prefill alone."""
        async with self._slots:
            await self._held()
            self.metrics.prompt_tokens += prompt_tokens
            if self.state.ttft > 0:
                await trio.sleep(self.state.ttft)

    async def generate(self, job: Job, emit: Emit | None) -> None:
        """Prefill then decode in a slot, observing the TTFT and ITL a client sees.

        `emit` gets each piece as it is decoded (a stream); without it the whole decode
        is one sleep and the answer is sent after.
        """
        async with self._slots:
            await self._decode(job, emit)

    async def _prefill_prompt(self, job: Job) -> None:
        """Look the prompt up in the prefix cache, prefill what is missing, cache it all.

        With `prefill_shared` the lookup waits for the lane as vLLM matches a waiting
        prompt when it is scheduled, so a prompt queued behind one with the same prefix
        finds that prefix cached. The fixed `ttft` is not in the lane."""
        await self._held()
        if self.state.ttft > 0:
            await trio.sleep(self.state.ttft)
        if self.state.prefill_shared:
            async with self._prefill_lane:
                await self._prefill_cached(job)
        else:
            await self._prefill_cached(job)

    async def _prefill_cached(self, job: Job) -> None:
        state, metrics = self.state, self.metrics
        block = state.prefix_block_tokens
        hashes = block_hashes(job.prompt, block)
        # vLLM computes the last prompt token even when it is cached (its logits give the
        # first output token), so a hit covers at most the blocks before that token.
        usable = max(0, job.prompt_tokens - 1) // block
        job.cached_tokens = self.prefix_cache.match(hashes[:usable]) * block
        metrics.prompt_tokens += job.prompt_tokens
        metrics.prefix_cache_queries += job.prompt_tokens
        metrics.prefix_cache_hits += job.cached_tokens
        delay = state.prefill_token_latency * (job.prompt_tokens - job.cached_tokens)
        if delay > 0:
            await trio.sleep(delay)
        self.prefix_cache.store(hashes, state.prefix_cache_blocks)

    async def _decode(self, job: Job, emit: Emit | None) -> None:
        state, metrics = self.state, self.metrics
        await self._prefill_prompt(job)
        last = time.monotonic()
        metrics.ttft.observe(last - job.started)
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
                metrics.itl.observe((time.monotonic() - last) / gaps, gaps)
            metrics.generation_tokens += len(pieces)
            return
        # Events of `tokens_per_event` tokens (the last may hold fewer); the tokens'
        # gaps are slept one by one all the same, as the engine decodes them.
        per_event = state.tokens_per_event
        for start in range(0, len(pieces), per_event):
            group = pieces[start : start + per_event]
            for index in range(start, start + len(group)):
                if index:
                    if state.token_latency > 0:
                        await trio.sleep(state.token_latency)
                    now = time.monotonic()
                    metrics.itl.observe(now - last)
                    last = now
                stall = state.stall_after_tokens
                if stall is not None and index >= stall:
                    await trio.sleep_forever()
            job.emitted = start + len(group)
            await emit(start, group[0] if len(group) == 1 else "".join(group))
            metrics.generation_tokens += len(group)


def create_sim_app(
    model: str,
    *,
    kind: str = "vllm",
    token_latency: float = 0.0,
    ttft: float = 0.0,
    max_context: int = 4096,
    capacity: int = 64,
    embedding_dim: int = 8,
    prefill_token_latency: float = 0.0,
    prefill_shared: bool = False,
    prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS,
    prefix_cache_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS,
) -> SimEngine:
    return SimEngine(
        model,
        kind=kind,
        token_latency=token_latency,
        ttft=ttft,
        max_context=max_context,
        capacity=capacity,
        embedding_dim=embedding_dim,
        prefill_token_latency=prefill_token_latency,
        prefill_shared=prefill_shared,
        prefix_block_tokens=prefix_block_tokens,
        prefix_cache_blocks=prefix_cache_blocks,
    )
