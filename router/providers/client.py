"""The external provider call behind `fallback_provider`: OpenAI or Anthropic over HTTPS.

`ProviderClient` is the dispatcher's `ProviderCall`. The provider is always called
without streaming; a client that asked for a stream gets the answer replayed as an
OpenAI event stream. Every failure is a RouterError the HTTP layer answers with.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from protocol.errors import ErrorCode, RouterError
from protocol.logs import quote
from router.dispatch import ProviderServed
from router.policy.schema import ProviderFallback
from router.providers import anthropic, openai
from router.providers.sse import completion_to_sse
from router.session import RouteRequest

log = logging.getLogger("provider")

DEFAULT_OPENAI_BASE_URL = "https://api.openai.com/v1"
DEFAULT_ANTHROPIC_BASE_URL = "https://api.anthropic.com"
SERVED_BY_HEADER = "x-hivenet-served-by"
# Enough of a provider's error text to say what went wrong, not a whole HTML page.
_DETAIL_LIMIT = 300


@dataclass(frozen=True)
class _Engine:
    url: str
    headers: dict[str, str]
    build: Callable[[dict[str, Any], str], dict[str, Any]]
    # The provider's parsed answer as a `chat.completion`; ValueError when malformed.
    read: Callable[[object, str], dict[str, Any]]
    # The answer bytes are already what the client expects (no translation back).
    native: bool


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
        self._engines: dict[str, _Engine] = {}
        if openai_api_key:
            self._engines["openai"] = _Engine(
                url=openai_base_url.rstrip("/") + "/chat/completions",
                headers={"authorization": f"Bearer {openai_api_key}"},
                build=openai.chat_request,
                read=lambda answer, model: openai.check_completion(answer),
                native=True,
            )
        if anthropic_api_key:
            self._engines["anthropic"] = _Engine(
                url=anthropic_base_url.rstrip("/") + "/v1/messages",
                headers={
                    "x-api-key": anthropic_api_key,
                    "anthropic-version": anthropic.ANTHROPIC_VERSION,
                },
                build=anthropic.messages_request,
                read=anthropic.completion_from_message,
                native=False,
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
        # Refusals (invalid_parameter) happen here, before anything leaves the router.
        body = engine.build(req.payload, provider.model)
        try:
            raw = await self._post(name, engine, body)
            try:
                completion = engine.read(json.loads(raw), provider.model)
            except ValueError as exc:
                raise _backend(f"{name} provider answered malformed JSON: {exc}") from None
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
        headers = {SERVED_BY_HEADER: f"provider:{name}"}
        if req.stream:
            options = req.payload.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            return ProviderServed(
                status=200,
                content_type="text/event-stream",
                body=completion_to_sse(completion, include_usage),
                engine=name,
                headers={**headers, "cache-control": "no-cache"},
            )
        answer = raw if engine.native else json.dumps(completion).encode()
        return ProviderServed(
            status=200, content_type="application/json", body=answer, engine=name, headers=headers
        )

    async def _post(self, name: str, engine: _Engine, body: dict[str, Any]) -> bytes:
        # The provider gets its own timeout, but never past the request's deadline. When
        # the request deadline comes first, the caller's scope catches the cancellation
        # (trio hands it to the outermost cancelled scope) and answers request_timeout.
        own_deadline = trio.current_time() + self.timeout
        with trio.move_on_at(min(own_deadline, trio.current_effective_deadline())) as scope:
            try:
                response = await self._client().post(engine.url, json=body, headers=engine.headers)
            except httpx.ConnectError as exc:
                raise _backend(f"{name} provider unreachable: {_describe(exc)}") from None
            except httpx.HTTPError as exc:
                raise _backend(f"{name} provider connection failed: {_describe(exc)}") from None
        if scope.cancelled_caught:
            raise _backend(f"{name} provider timed out after {self.timeout:g}s")
        if response.status_code != 200:
            raise _status_error(name, response.status_code, response.content)
        return response.content

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            # No httpx timeout: the trio deadline above bounds the whole call.
            self._http = httpx.AsyncClient(timeout=None)
        return self._http


def _backend(message: str) -> RouterError:
    return RouterError(ErrorCode.BACKEND_ERROR, message, source="backend")


def _describe(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def _status_error(name: str, status: int, body: bytes) -> RouterError:
    message = f"{name} provider answered HTTP {status}"
    detail = _provider_message(body)
    if detail:
        message += f": {detail}"
    # A provider's 400/422 judges the client's request (context length, a bad value):
    # the client must fix it, and a 502 would invite a pointless retry.
    if status in (400, 422):
        text = detail.lower()
        code = (
            ErrorCode.CONTEXT_LENGTH_EXCEEDED
            if "context" in text and ("length" in text or "window" in text)
            else ErrorCode.INVALID_PARAMETER
        )
        return RouterError(code, message, source="backend")
    return _backend(message)


def _provider_message(body: bytes) -> str:
    """The error text of OpenAI's and Anthropic's error bodies (both `error.message`)."""
    try:
        parsed = json.loads(body)
        message = parsed["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()
    return str(message)[:_DETAIL_LIMIT]
