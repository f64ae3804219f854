"""Relaying a stream to the client, and continuing it on another agent when it breaks.

When the agent's stream breaks (agent gone, link error, engine error) after part of it
reached the client, the router routes the request again through the same policy, the
broken agents excluded and only engines that continue an assistant turn eligible
(router/continuation.py), with the text already sent as that turn. The new stream is
spliced on: the client sees one stream. Each agent's break is continued once (it is
then excluded), so the seeds' budget-free recovery holds once per agent; the new route
has its own tries, as a fresh request would. What cannot be continued ends with the
error event as before.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable

from protocol.errors import ErrorCode, RouterError
from protocol.logs import quote
from router.continuation import (
    CHAT_PATH,
    CONTINUABLE_ENGINES,
    FLAGGED_ENGINES,
    MAX_COUNT,
    MAX_TRANSCRIPT_BYTES,
    MESSAGES_PATH,
    PREFILL_ENGINES,
    Sent,
    Splice,
    closing,
    continuation_body,
    merged_usage,
    read_sent,
    tokens_left,
)
from router.dispatch import Dispatcher
from router.http.asgi import Send, send_body
from router.http.count_tokens import (
    CHAT_TOKENIZERS,
    CONTENT_TOKENIZERS,
    TEXT_TOKENIZERS,
    TOKENIZE_PATH,
    input_tokens,
)
from router.link import AgentResponse, StreamBroken
from router.metrics import RouterMetrics
from router.peers import PeerTable
from router.session import BackendRejected, RouteRequest

log = logging.getLogger("http")

_CONTINUED_PATHS = (CHAT_PATH, MESSAGES_PATH)
# vLLM's and SGLang's `/tokenize` take `prompt` (the text, with no template).
_PROMPT_TOKENIZERS = CHAT_TOKENIZERS | TEXT_TOKENIZERS


def record_break(metrics: RouterMetrics, req: RouteRequest, broken: StreamBroken) -> None:
    """Count and log an answer that broke part way, continued or not."""
    code = broken_code(broken)
    metrics.forward_failures.labels(req.model, str(code), req.tenant).inc()
    log.warning(
        "req=%s stream_broken reason=%s tenant=%s",
        req.request_id,
        quote(str(broken)),
        quote(req.tenant),
    )


def broken_code(broken: StreamBroken) -> ErrorCode:
    if str(broken).startswith("agent_disconnected"):
        return ErrorCode.AGENT_DISCONNECTED
    return ErrorCode.BACKEND_ERROR


class StreamContinuer:
    """Continues broken streams through the dispatcher's local chain."""

    def __init__(self, dispatcher: Dispatcher, table: PeerTable, metrics: RouterMetrics) -> None:
        self.dispatcher = dispatcher
        self.table = table
        self.metrics = metrics

    def enabled(self, req: RouteRequest) -> bool:
        return req.path in _CONTINUED_PATHS and self.dispatcher.policy_of(req).stream_continuation

    async def continue_after(
        self, req: RouteRequest, sent: Sent, exclude: frozenset[str]
    ) -> AgentResponse | None:
        """Another agent's answer going on after `sent`, or None when none took it."""
        # Chat bodies differ by engine (`continue_final_message`); Anthropic's do not.
        dialects = (
            ((FLAGGED_ENGINES, True), (PREFILL_ENGINES, False))
            if req.path == CHAT_PATH
            else ((CONTINUABLE_ENGINES, False),)
        )
        pool = [p for p in self.table.for_model(req.model) if p.peer_id not in exclude]
        for engines, flagged in dialects:
            allowed = engines & req.engines if req.engines else engines
            if not any(p.metadata.engine in allowed for p in pool):
                continue
            payload = continuation_body(req.path, req.payload, sent, flagged)
            body = json.dumps(payload, separators=(",", ":")).encode()
            again = dataclasses.replace(
                req, body=body, payload=payload, engines=allowed, exclude=exclude, waited=0.0
            )
            try:
                served = await self.dispatcher.continuation(again)
            except (BackendRejected, RouterError) as exc:
                log.info(
                    "req=%s stream_continuation_refused reason=%s tenant=%s",
                    req.request_id,
                    quote(str(exc)),
                    quote(req.tenant),
                )
                continue
            if served is not None:
                assert isinstance(served.response, AgentResponse)
                return served.response
        return None

    async def count_sent(self, req: RouteRequest, sent: Sent, exclude: frozenset[str]) -> None:
        """Count `sent.text` with an engine's own tokenizer, in place, where the stream
        carried no running count (Anthropic's): one token per content event undercounts
        when the engine packs several into one (issue 48: vLLM), and the continuation's
        `max_tokens` and the spliced usage are only as right as this count. No agent
        with a tokenizer, or a failed call: the event count stands."""
        if not sent.text:
            return
        engines = {
            p.metadata.engine for p in self.table.for_model(req.model) if p.peer_id not in exclude
        }
        payload: dict
        if engines & _PROMPT_TOKENIZERS:
            tokenizers = _PROMPT_TOKENIZERS
            payload = {"model": req.model, "prompt": sent.text, "add_special_tokens": False}
        elif engines & CONTENT_TOKENIZERS:
            tokenizers = CONTENT_TOKENIZERS
            payload = {"content": sent.text, "add_special": False}
        else:
            return
        body = json.dumps(payload, separators=(",", ":")).encode()
        ask = dataclasses.replace(
            req,
            path=TOKENIZE_PATH,
            body=body,
            payload=payload,
            stream=False,
            engines=tokenizers,
            exclude=exclude,
            waited=0.0,
        )
        try:
            served = await self.dispatcher.continuation(ask)
            if served is None:
                raise RouterError(ErrorCode.BACKEND_ERROR, "no agent's engine could count it")
            response = served.response
            assert isinstance(response, AgentResponse)
            try:
                count = input_tokens(await response.read_all())["input_tokens"]
            finally:
                response.close()
        except (BackendRejected, RouterError, StreamBroken) as exc:
            log.info(
                "req=%s stream_tokens_uncounted reason=%s tenant=%s",
                req.request_id,
                quote(str(exc)),
                quote(req.tenant),
            )
            return
        if 0 <= count < MAX_COUNT:
            log.info(
                "req=%s stream_tokens_counted tokens=%d events=%d tenant=%s",
                req.request_id,
                count,
                sent.tokens,
                quote(req.tenant),
            )
            sent.tokens = count


class StreamRelay:
    """One stream's relay: the agent's chunks to the client, continued across breaks.

    `on_response` is told of each new answer (the request's deadline closes the current
    one); `grow`, when set, each chunk the client is sent. Raises StreamBroken when a
    break cannot be continued. `write_part`, the client connection's (ANSWER_SCOPE's
    `part_writer`), lets the link's reader write the parts that arrive while this task
    waits for one (`_Pending.sink`): a pass of this task through trio's scheduler per
    part cost more than a third of the router's CPU per relayed event (`python -m
    bench.stream_relay --token-latency 0.01 --concurrency 64`: 33,805 → 54,479 events
    per second of router CPU).
    """

    def __init__(
        self,
        continuer: StreamContinuer,
        req: RouteRequest,
        response: AgentResponse,
        on_response: Callable[[AgentResponse], None],
        grow: Callable[[bytes], Awaitable[None]] | None = None,
        write_part: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.continuer = continuer
        self.req = req
        self.response = response
        self.on_response = on_response
        # Admission's footprint of an answer with no declared limit, told each chunk.
        self.grow = grow
        self.write_part = write_part
        # What the client was sent, read only when the stream breaks; None: not kept.
        self.transcript: list[bytes] | None = [] if continuer.enabled(req) else None
        self.size = 0
        self.sent: Sent | None = None  # at the last splice
        self.continuations = 0

    @property
    def usage(self) -> dict[str, int] | None:
        """The engine's token count of the whole answer, both parts when spliced."""
        usage = self.response.usage
        return usage if self.sent is None else merged_usage(usage, self.sent)

    async def run(self, send: Send) -> None:
        splice: Splice | None = None
        while True:
            try:
                # `last`: the answer's end came with this part, which then ends the
                # client's answer in the same write (router/link.py `parts`).
                last = False
                if splice is None and self.grow is None and self.write_part is not None:
                    # Cleared when the answer closes (AgentResponse.close).
                    self.response.pending.sink = self._sink
                async for chunk, last in self.response.parts():
                    if splice is not None:
                        chunk = splice.feed(chunk)
                        if not chunk and not last:
                            continue
                    self._keep(chunk)
                    if self.grow is not None:
                        await self.grow(chunk)
                    await send_body(send, chunk, more=not last)
                if not last:
                    await send_body(send, b"")
                return
            except StreamBroken as broken:
                record_break(self.continuer.metrics, self.req, broken)
                if self.transcript is None:
                    raise
                splice = await self._continue(broken, send)
                if splice is None:
                    return

    def _sink(self, chunk: bytes) -> bool:
        """A part written by the link's reader (`_Pending.sink`)."""
        assert self.write_part is not None
        self._keep(chunk)
        return self.write_part(chunk)

    def _keep(self, chunk: bytes) -> None:
        transcript = self.transcript
        if transcript is None:
            return
        self.size += len(chunk)
        if self.size > MAX_TRANSCRIPT_BYTES:
            self.transcript = None
        else:
            transcript.append(chunk)

    async def _continue(self, broken: StreamBroken, send: Send) -> Splice | None:
        """Splice the next agent's stream on (its Splice), end a stream that was whole
        (None), or re-raise `broken`."""
        req, metrics = self.req, self.continuer.metrics
        assert self.transcript is not None
        sent = read_sent(req.path, b"".join(self.transcript))
        gone = self.response.session.peer
        gone_id = gone.peer_id if gone is not None else "-"
        counter = metrics.stream_continuations
        exclude = req.exclude | {gone_id}
        if req.path == MESSAGES_PATH and sent.problem is None and not sent.finished:
            await self.continuer.count_sent(req, sent, exclude)
        left = tokens_left(req.payload, sent)
        if sent.problem is None and (sent.finished or (left is not None and left < 1)):
            # Nothing is missing but the end: the router writes it.
            end = closing(req.path, sent, "stop" if sent.finished else "length")
            self._keep(end)
            await send_body(send, end)
            counter.labels(req.model, req.tenant, "completed").inc()
            self._log("stream_completed", gone_id, "-", sent, str(broken))
            return None
        if sent.problem is not None:
            counter.labels(req.model, req.tenant, "unsupported").inc()
            self._log("stream_not_continued", gone_id, "-", sent, sent.problem)
            raise broken
        self.req = dataclasses.replace(req, exclude=exclude)
        response = await self.continuer.continue_after(req, sent, exclude)
        if response is None:
            counter.labels(req.model, req.tenant, "no_agent").inc()
            self._log("stream_not_continued", gone_id, "-", sent, "no agent could continue it")
            raise broken
        self.response.close()
        self.response = response
        self.on_response(response)
        self.sent = sent
        self.continuations += 1
        counter.labels(req.model, req.tenant, "continued").inc()
        to = response.session.peer
        self._log("stream_continued", gone_id, to.peer_id if to else "-", sent, str(broken))
        return Splice(req.path, sent)

    def _log(self, event: str, gone: str, to: str, sent: Sent, reason: str) -> None:
        level = logging.INFO if event != "stream_not_continued" else logging.WARNING
        log.log(
            level,
            "req=%s %s from=%s to=%s sent_tokens=%d continuations=%d reason=%s tenant=%s",
            self.req.request_id,
            event,
            gone,
            to,
            sent.tokens,
            self.continuations,
            quote(reason),
            quote(self.req.tenant),
        )
