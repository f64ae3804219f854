"""Error codes shared by the router, the agent and the HTTP API.

A code carries its HTTP status and how routing treats it: request-level codes stop
the routing session at once, retryable codes consume a forward try,
`agent_disconnected` is the connection-level failure that earns one free recovery, and
`agent_full` (the agent's own `--capacity`, counted over every router it serves, is
taken) costs nothing: the router selects again, and `endpoint_not_supported` (the
agent's engine lacks the endpoint) costs nothing either: that agent is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class ErrorCode(StrEnum):
    REQUEST_INVALID = "request_invalid"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_PARAMETER = "invalid_parameter"
    UNAUTHORIZED = "unauthorized"
    MODEL_NOT_FOUND = "model_not_found"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    TOKEN_LIMIT_EXCEEDED = "token_limit_exceeded"
    NO_AGENTS_AVAILABLE = "no_agents_available"
    NO_CAPACITY = "no_capacity"
    AGENT_DISCONNECTED = "agent_disconnected"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    BACKEND_ERROR = "backend_error"
    REQUEST_TIMEOUT = "request_timeout"
    # A policy step's `shed_if` refused the request under load (503 with Retry-After).
    LOAD_SHED = "load_shed"
    # No agent of the model runs an engine with a tokenizer endpoint (count_tokens).
    TOKENIZER_UNAVAILABLE = "tokenizer_unavailable"
    # Not in INTERFACE.md's list; the router's own answers where none of those fits.
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    INTERNAL_ERROR = "internal_error"
    # A tenant's limits from the auth file (the router's own refusals, never retried).
    # The Go router's codes for the same conditions, so its clients' handlers still
    # match: RPM is INTERFACE.md's `rate_limit_exceeded`, the daily budget its
    # `token_limit_exceeded` (the same values as the backend codes above).
    RATE_LIMITED = "rate_limit_exceeded"
    QUOTA_EXCEEDED = "token_limit_exceeded"
    MODEL_NOT_ALLOWED = "model_forbidden"
    TOO_MANY_CONCURRENT = "concurrency_limit_exceeded"
    # Upstream's router-wide refusals: a top-level `shed_if` answers
    # concurrency_limit_exceeded; a full router-wide wait (--queue-size) `queue_full`.
    QUEUE_FULL = "queue_full"
    # Upstream's B1 request caps (policy or key `max_input_tokens`, `images_max`).
    INPUT_TOO_LONG = "input_too_long"
    # The agent refused a request before starting it: its capacity is held by requests
    # from this and other routers. Agent to router only; a client never sees it.
    AGENT_FULL = "agent_full"
    # An Idempotency-Key (or X-Request-ID) reused with another body (router/idempotency.py).
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    # The agent's engine does not serve the endpoint (its adapter's capability check):
    # the engine was not asked, and the agent is not at fault.
    ENDPOINT_NOT_SUPPORTED = "endpoint_not_supported"


STATUS: dict[ErrorCode, int] = {
    ErrorCode.REQUEST_INVALID: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.INPUT_TOO_LONG: 400,
    ErrorCode.INVALID_PARAMETER: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.TOKENIZER_UNAVAILABLE: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.RATE_LIMIT_EXCEEDED: 429,
    ErrorCode.TOKEN_LIMIT_EXCEEDED: 429,
    ErrorCode.NO_AGENTS_AVAILABLE: 503,
    ErrorCode.NO_CAPACITY: 503,
    ErrorCode.QUEUE_FULL: 503,
    ErrorCode.LOAD_SHED: 503,
    ErrorCode.AGENT_DISCONNECTED: 503,
    ErrorCode.BACKEND_UNAVAILABLE: 503,
    ErrorCode.BACKEND_ERROR: 502,
    ErrorCode.REQUEST_TIMEOUT: 504,
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.QUOTA_EXCEEDED: 429,
    ErrorCode.TOO_MANY_CONCURRENT: 429,
    ErrorCode.MODEL_NOT_ALLOWED: 403,
    ErrorCode.AGENT_FULL: 503,
    ErrorCode.IDEMPOTENCY_CONFLICT: 409,
    ErrorCode.ENDPOINT_NOT_SUPPORTED: 404,
}

# The client's request is at fault: another agent would answer the same.
REQUEST_LEVEL: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.REQUEST_INVALID,
        ErrorCode.INVALID_PARAMETER,
        ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        ErrorCode.TOKEN_LIMIT_EXCEEDED,
    }
)

# The codes an agent's `error` frame may carry: its own refusals and failures, and an
# engine's judgement of the request. Any other is a router's own answer (401, 403, a
# tenant's 429…), which an agent must not give clients in the router's name; the router
# takes it as backend_error.
AGENT_CODES: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.BACKEND_UNAVAILABLE,
        ErrorCode.BACKEND_ERROR,
        ErrorCode.AGENT_FULL,
        ErrorCode.ENDPOINT_NOT_SUPPORTED,
        ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        ErrorCode.INVALID_PARAMETER,
    }
)

# Another agent may succeed: these consume one forward try.
RETRYABLE: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.BACKEND_UNAVAILABLE,
        ErrorCode.BACKEND_ERROR,
        ErrorCode.RATE_LIMIT_EXCEEDED,
        ErrorCode.AGENT_DISCONNECTED,
    }
)

# OpenAI's `type` field, chosen so SDKs raise the matching exception class.
_OPENAI_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "api_error",
    504: "timeout_error",
}

# Anthropic's error `type` names for the same statuses.
_ANTHROPIC_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def status_of(code: ErrorCode) -> int:
    return STATUS.get(code, 500)


@dataclass(frozen=True)
class RouterError(Exception):
    """An error the router answers with; `source` is `router` or `backend`."""

    code: ErrorCode
    message: str
    source: str = "router"
    status: int | None = None
    # Seconds for a `Retry-After` header; None sends none.
    retry_after: float | None = None

    @property
    def http_status(self) -> int:
        return self.status if self.status is not None else status_of(self.code)

    def retry_headers(self) -> list[tuple[str, str]]:
        """`Retry-After` in whole seconds (at least 1), and `retry-after-ms`, which the
        OpenAI and Anthropic SDKs read first."""
        if self.retry_after is None:
            return []
        seconds = max(1, math.ceil(self.retry_after))
        return [("retry-after", str(seconds)), ("retry-after-ms", str(seconds * 1000))]

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


def openai_error_body(err: RouterError) -> dict:
    return {
        "error": {
            "code": str(err.code),
            "message": err.message,
            "type": _OPENAI_TYPE.get(err.http_status, "api_error"),
            "source": err.source,
        }
    }


def anthropic_error_body(err: RouterError) -> dict:
    return {
        "type": "error",
        "error": {
            "code": str(err.code),
            "message": err.message,
            "type": _ANTHROPIC_TYPE.get(err.http_status, "api_error"),
            "source": err.source,
        },
    }


def error_payload(protocol: str, err: RouterError) -> dict:
    """`err` as a caller of `protocol` ("anthropic" or "openai") reads an error."""
    return anthropic_error_body(err) if protocol == "anthropic" else openai_error_body(err)


# With "context", what engines say of a prompt too long: vLLM's "maximum context
# length", SGLang's "context length", llama.cpp's "exceeds the available context
# size" (type exceed_context_size_error, with n_prompt_tokens), "context window".
_CONTEXT_WORDS = ("length", "window", "token", "size")


def route_missing(status: int, body: bytes) -> bool:
    """Whether an engine's answer says it has no such route, rather than judging the
    request: a 404 whose body does not name a model. Engines' own words for a path they
    do not serve: FastAPI's `{"detail":"Not Found"}` (vLLM, SGLang), llama-server's
    `File Not Found`, Go's `404 page not found` (Ollama); a model they lack is named
    (vLLM's "The model `m` does not exist", Ollama's `model "m" not found`)."""
    return status == 404 and b"model" not in body[:4096].lower()


def classify_backend_status(status: int, body: bytes) -> ErrorCode | None:
    """Map an engine's HTTP answer to an error code; None when it is a success.

    INTERFACE.md fixes 400/422 (the request's fault), 429/503 (busy, retryable) and
    other 5xx. The rest: 408 is the engine being slow (retryable like 503); 413 is the
    request's size (request-level); any other 4xx (401/403 from a mis-keyed engine, 404
    from an engine that lacks the model or the endpoint) is that agent's fault, so
    another agent may succeed: `backend_error`, retryable.
    """
    if status < 400:
        return None
    if status in (400, 422):
        text = body[:4096].decode("utf-8", "replace").lower()
        if "context" in text and any(word in text for word in _CONTEXT_WORDS):
            return ErrorCode.CONTEXT_LENGTH_EXCEEDED
        return ErrorCode.INVALID_PARAMETER
    if status in (408, 429, 503):
        return ErrorCode.BACKEND_UNAVAILABLE
    if status == 413:
        return ErrorCode.REQUEST_INVALID
    return ErrorCode.BACKEND_ERROR
