"""The external provider call behind `fallback_provider`: OpenAI or Anthropic over HTTPS.

`ProviderClient` is the dispatcher's `ProviderCall`. A client that streams gets the
provider's stream, each event relayed (and translated between the OpenAI and Anthropic
shapes, router/providers/anthropic_stream.py and messages.py) as it arrives, so the
time to first token is the provider's. Until the first event has been translated the
call can still fail as a whole, with a RouterError the HTTP layer answers with; after
it, a failure ends the client's stream with an error event in its protocol.

Which client endpoint goes to which provider endpoint (`_ROUTES`): chat completions to
either provider; Anthropic's messages to either; legacy completions and responses to
OpenAI only (Anthropic has neither, and a translation would lose most of their fields).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from protocol.errors import ErrorCode, RouterError, classify_backend_status
from protocol.logs import quote
from protocol.paths import CHAT, COMPLETIONS, RESPONSES
from router.dispatch import ProviderServed
from router.policy.schema import ProviderFallback
from router.providers import anthropic, messages, openai
from router.providers.anthropic_stream import AnthropicToOpenAI
from router.providers.events import EventParser, PassThrough, ProviderErrorEvent, Translator
from router.session import RouteRequest

log = logging.getLogger("provider")

DEFAULT_OPENAI_BASE_URL = "https://api.openai.com/v1"
DEFAULT_ANTHROPIC_BASE_URL = "https://api.anthropic.com"
SERVED_BY_HEADER = "x-hivenet-served-by"
# Enough of a provider's error text to say what went wrong, not a whole HTML page.
_DETAIL_LIMIT = 300
# The error types of a provider's error event that say it is busy, not broken.
_BUSY = frozenset({"overloaded_error", "rate_limit_error"})

MESSAGES = "/v1/messages"


@dataclass(frozen=True)
class _Route:
    """How one client endpoint is served by one provider."""

    path: str  # the provider's path, after its base URL
    # The provider's body for the client's payload and the policy's model; raises
    # RouterError (invalid_parameter) for what it cannot carry.
    build: Callable[[dict[str, Any], str, bool], dict[str, Any]]
    # The client's whole answer for the provider's parsed one; ValueError when malformed.
    # None: the provider's bytes are the answer (same format), once `check`ed.
    read: Callable[[object, str], dict[str, Any]] | None
    # The stream translator for a client that streams.
    stream: Callable[[RouteRequest, str], Translator]
    check: Callable[[object], dict[str, Any]] = openai.check_object


def _same_openai(
    path: str, check: Callable[[object], dict[str, Any]] = openai.check_object
) -> _Route:
    return _Route(
        path=path.removeprefix("/v1"),
        build=lambda payload, model, stream: openai.request(payload, model, path, stream),
        read=None,
        stream=lambda req, model: PassThrough(
            strip_usage_chunk=path in openai.USAGE_ON_REQUEST
            and not openai.client_asked_usage(req.payload)
        ),
        check=check,
    )


def _anthropic_messages(payload: dict[str, Any], model: str, stream: bool) -> dict[str, Any]:
    body = anthropic.messages_request(payload, model)
    if stream:
        body["stream"] = True
    return body


def _anthropic_passthrough(payload: dict[str, Any], model: str, stream: bool) -> dict[str, Any]:
    body = {**payload, "model": model}
    body.pop("stream", None)
    if stream:
        body["stream"] = True
    return body


def _openai_for_messages(payload: dict[str, Any], model: str, stream: bool) -> dict[str, Any]:
    body = messages.chat_request(payload, model)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


_ROUTES: dict[tuple[str, str], _Route] = {
    ("openai", CHAT): _same_openai(CHAT, openai.check_completion),
    ("openai", COMPLETIONS): _same_openai(COMPLETIONS),
    ("openai", RESPONSES): _same_openai(RESPONSES),
    ("openai", MESSAGES): _Route(
        path="/chat/completions",
        build=_openai_for_messages,
        read=messages.message_from_completion,
        stream=lambda req, model: messages.OpenAIToAnthropic(model),
    ),
    ("anthropic", CHAT): _Route(
        path="/v1/messages",
        build=_anthropic_messages,
        read=anthropic.completion_from_message,
        stream=lambda req, model: AnthropicToOpenAI(model, openai.client_asked_usage(req.payload)),
    ),
    ("anthropic", MESSAGES): _Route(
        path="/v1/messages",
        build=_anthropic_passthrough,
        read=None,
        stream=lambda req, model: PassThrough(strip_usage_chunk=False),
    ),
}


@dataclass(frozen=True)
class _Engine:
    base_url: str
    headers: dict[str, str]


class ProviderStream:
    """A provider's answer being streamed: `next` gives the client's next bytes, None
    at the end; RouterError when the provider's stream fails. `aclose` on every path."""

    def __init__(self, name: str, response: httpx.Response, translator: Translator) -> None:
        self.name = name
        self._response = response
        self._chunks = response.aiter_bytes()
        self._parser = EventParser()
        self._translator = translator
        self._ended = False
        # How the stream failed, raised once the events before the failure are out.
        self._failure: RouterError | None = None
        # The first translated event, read before the call returns (ProviderClient).
        self.first = b""

    @property
    def usage(self) -> dict[str, int] | None:
        return self._translator.usage

    async def next(self) -> bytes | None:
        while not self._ended:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self._ended = True
                try:
                    if self._parser.pending():
                        raise ValueError("the stream broke off inside an event")
                    out = self._translator.end()
                except ValueError as exc:
                    raise _backend(f"{self.name} provider stream: {exc}") from None
                return out or None
            except httpx.HTTPError as exc:
                self._ended = True
                raise _backend(f"{self.name} provider stream broke off: {_describe(exc)}") from None
            out = self._translate(chunk)
            if out:
                return out
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        return None

    def _translate(self, chunk: bytes) -> bytes:
        """The client's bytes for the events `chunk` completes; a failure among them
        ends the stream after the events before it."""
        out: list[bytes] = []
        try:
            for name, data in self._parser.feed(chunk):
                out.append(self._translator.event(name, data))
        except ValueError as exc:
            self._ended = True
            self._failure = _backend(f"{self.name} provider stream is malformed: {exc}")
        except ProviderErrorEvent as exc:
            self._ended = True
            # Overloaded or rate-limited: busy, as a 429 or 529 status would say.
            code = ErrorCode.BACKEND_UNAVAILABLE if exc.kind in _BUSY else ErrorCode.BACKEND_ERROR
            detail = f"{exc.kind}: {exc.message[:_DETAIL_LIMIT]}"
            message = f"{self.name} provider stream failed: {detail}"
            self._failure = RouterError(code, message, source="backend")
        return b"".join(out)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._response.aclose()


class ProviderClient:
    def __init__(
        self,
        openai_api_key: str,
        anthropic_api_key: str,
        openai_base_url: str = DEFAULT_OPENAI_BASE_URL,
        anthropic_base_url: str = DEFAULT_ANTHROPIC_BASE_URL,
        timeout: float = 30.0,
    ) -> None:
        self.timeout = timeout
        # --metrics-compat upstream: told each call's provider, status and seconds.
        self.observe: Callable[[str, int, float], None] | None = None
        self._engines: dict[str, _Engine] = {}
        if openai_api_key:
            self._engines["openai"] = _Engine(
                base_url=openai_base_url.rstrip("/"),
                headers={"authorization": f"Bearer {openai_api_key}"},
            )
        if anthropic_api_key:
            self._engines["anthropic"] = _Engine(
                base_url=anthropic_base_url.rstrip("/"),
                headers={
                    "x-api-key": anthropic_api_key,
                    "anthropic-version": anthropic.ANTHROPIC_VERSION,
                },
            )
        self._http: httpx.AsyncClient | None = None

    def available(self, engine: str) -> bool:
        """Whether a key is configured for `engine`."""
        return engine in self._engines

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __call__(self, provider: ProviderFallback, req: RouteRequest) -> ProviderServed:
        name = provider.engine
        engine = self._engines.get(name)
        if engine is None:
            raise RouterError(
                ErrorCode.BACKEND_ERROR,
                f"provider fallback {name!r} has no API key configured",
                source="router",
            )
        route = _ROUTES.get((name, req.path))
        if route is None:
            raise RouterError(
                ErrorCode.ENDPOINT_NOT_SUPPORTED,
                f"the {name} provider fallback does not serve {req.path}"
                " (it serves /v1/chat/completions and /v1/messages)",
                source="router",
            )
        # Refusals (invalid_parameter) happen here, before anything leaves the router.
        body = route.build(req.payload, provider.model, req.stream)
        if self.observe is not None:
            return await self._observed(self.observe, name, engine, route, body, provider, req)
        return await self._call(name, engine, route, body, provider, req)

    async def _observed(
        self,
        observe: Callable[[str, int, float], None],
        name: str,
        engine: _Engine,
        route: _Route,
        body: dict[str, Any],
        provider: ProviderFallback,
        req: RouteRequest,
    ) -> ProviderServed:
        started = trio.current_time()
        status = 502
        try:
            served = await self._call(name, engine, route, body, provider, req)
            status = served.status
            return served
        except RouterError as err:
            status = err.http_status
            raise
        finally:
            observe(name, status, trio.current_time() - started)

    async def _call(
        self,
        name: str,
        engine: _Engine,
        route: _Route,
        body: dict[str, Any],
        provider: ProviderFallback,
        req: RouteRequest,
    ) -> ProviderServed:
        headers = {SERVED_BY_HEADER: f"provider:{name}"}
        url = engine.base_url + route.path
        try:
            if req.stream:
                translator = route.stream(req, provider.model)
                stream = await self._open_stream(name, engine, url, body, translator)
            else:
                raw = await self._post(name, engine, url, body)
                answer = self._answer(name, route, raw, provider.model, req.path)
        except RouterError as err:
            log.warning(
                "req=%s provider=%s model=%s provider_failed reason=%s tenant=%s",
                req.request_id,
                name,
                quote(provider.model),
                quote(err.message),
                quote(req.tenant),
            )
            raise
        # The outcome either way, as upstream logs it: a request the provider served
        # leaves no other trace of where it went but the answer's header.
        if log.isEnabledFor(logging.INFO):  # no quoting when off
            log.info(
                "req=%s provider=%s model=%s provider_served stream=%s tenant=%s",
                req.request_id,
                name,
                quote(provider.model),
                "true" if req.stream else "false",
                quote(req.tenant),
            )
        if req.stream:
            return ProviderServed(
                status=200,
                content_type="text/event-stream",
                body=stream.first,
                engine=name,
                headers={**headers, "cache-control": "no-cache"},
                stream=stream,
            )
        return ProviderServed(
            status=200, content_type="application/json", body=answer, engine=name, headers=headers
        )

    def _answer(self, name: str, route: _Route, raw: bytes, model: str, path: str) -> bytes:
        try:
            parsed = json.loads(raw)
            if route.read is None:
                answer = route.check(parsed)
                if path != CHAT:
                    return raw
            else:
                answer = route.read(parsed, model)
            if path == CHAT:
                # Upstream's mark on a chat completion the provider answered (besides
                # the x-hivenet-served-by header).
                answer["processed_by"] = f"provider:{name}"
            return json.dumps(answer).encode()
        except ValueError as exc:
            raise _backend(f"{name} provider answered malformed JSON: {exc}") from None

    def _deadline(self) -> float:
        # The provider gets its own timeout, but never past the request's deadline. When
        # the request deadline comes first, the caller's scope catches the cancellation
        # (trio hands it to the outermost cancelled scope) and answers request_timeout.
        return min(trio.current_time() + self.timeout, trio.current_effective_deadline())

    async def _post(self, name: str, engine: _Engine, url: str, body: dict[str, Any]) -> bytes:
        with trio.move_on_at(self._deadline()) as scope:
            try:
                response = await self._client().post(url, json=body, headers=engine.headers)
            except httpx.ConnectError as exc:
                raise _backend(f"{name} provider unreachable: {_describe(exc)}") from None
            except httpx.HTTPError as exc:
                raise _backend(f"{name} provider connection failed: {_describe(exc)}") from None
        if scope.cancelled_caught:
            raise _backend(f"{name} provider timed out after {self.timeout:g}s")
        if response.status_code != 200:
            raise _status_error(name, response.status_code, response.content)
        return response.content

    async def _open_stream(
        self, name: str, engine: _Engine, url: str, body: dict[str, Any], translator: Translator
    ) -> ProviderStream:
        """The provider's stream, up to its first translated event.

        The provider's timeout bounds the wait for that event, not the whole answer (a
        long answer streams for longer than 30 s); the request's deadline bounds the rest.
        """
        response: httpx.Response | None = None
        opened: ProviderStream | None = None
        with trio.move_on_at(self._deadline()) as scope:
            try:
                request = self._client().build_request(
                    "POST", url, json=body, headers=engine.headers
                )
                response = await self._client().send(request, stream=True)
                if response.status_code != 200:
                    content = await response.aread()
                    raise _status_error(name, response.status_code, content)
                stream = ProviderStream(name, response, translator)
                first = await stream.next()
                if first is None:
                    raise _backend(f"{name} provider stream ended without an event")
                stream.first = first
                opened = stream
            except httpx.ConnectError as exc:
                await _close(response)
                raise _backend(f"{name} provider unreachable: {_describe(exc)}") from None
            except httpx.HTTPError as exc:
                await _close(response)
                raise _backend(f"{name} provider connection failed: {_describe(exc)}") from None
            except BaseException:
                await _close(response)
                raise
        if opened is None or scope.cancelled_caught:
            await _close(response)
            raise _backend(f"{name} provider sent no event within {self.timeout:g}s")
        return opened

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            # No httpx timeout: the trio deadline above bounds the whole call.
            self._http = httpx.AsyncClient(timeout=None)
        return self._http


async def _close(response: httpx.Response | None) -> None:
    if response is not None:
        with trio.CancelScope(shield=True):
            await response.aclose()


def _backend(message: str) -> RouterError:
    return RouterError(ErrorCode.BACKEND_ERROR, message, source="backend")


def _describe(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def _status_error(name: str, status: int, body: bytes) -> RouterError:
    message = f"{name} provider answered HTTP {status}"
    detail = _provider_message(body)
    if detail:
        message += f": {detail}"
    # The provider is the request's backend: its statuses mean what an engine's do
    # (INTERFACE.md), so a 400/422 is the client's to fix and a 429 or 503 is busy
    # (503 backend_unavailable, which SDKs retry after a while). Anthropic's 529
    # (overloaded) is its 503.
    code = classify_backend_status(503 if status == 529 else status, body)
    return RouterError(code or ErrorCode.BACKEND_ERROR, message, source="backend")


def _provider_message(body: bytes) -> str:
    """The error text of OpenAI's and Anthropic's error bodies (both `error.message`)."""
    try:
        parsed = json.loads(body)
        message = parsed["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()
    return str(message)[:_DETAIL_LIMIT]
