"""Which client API endpoints each engine serves, for the agent's capability check.

The router forwards a request to any agent of its model; an engine without the endpoint
would answer its own 404 (llama.cpp's `File Not Found`), which the router must count as
a `backend_error` against a healthy agent and retry. The agent answers instead, before
asking the engine: `endpoint_not_supported` (404), which the router neither charges
nor counts as a try (router/session.py), and which sends the request to an agent whose
engine serves it.

From each engine's documentation and route table, current releases:
- vLLM: all of them (`/v1/messages` is its Anthropic API, `/v1/rerank` its pooling API).
- SGLang: all of them.
- llama.cpp `llama-server`: all of them (`/v1/responses` since early 2026, `/v1/rerank`
  with `--reranking`).
- Ollama: no `/v1/rerank` (its OpenAI layer has chat, completions, responses since
  v0.13.3, embeddings; `/v1/messages` is its Anthropic layer).
A `custom` server is whatever the operator runs: it is asked every endpoint.
Paths outside this list (`/tokenize`) are not checked here.

An engine may still lack one of them (an older build, a custom server): its own 404
for such a path (`protocol.errors.route_missing`) becomes the same refusal, and the
agent remembers it (`MissingRoutes`), so the next requests are refused before the
engine is asked again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.paths import API_PATHS

# How long an engine's "no such route" holds before it is asked again: an engine
# upgraded in place serves the path again within five minutes, without an agent
# restart, while the requests of those minutes are refused at no cost.
MISSING_ROUTE_SECONDS = 300.0


def lacks(endpoints: frozenset[str], path: str) -> bool:
    """Whether an engine serving `endpoints` is known not to serve `path`."""
    return path in API_PATHS and path not in endpoints


@dataclass
class MissingRoutes:
    """The API paths this agent's engine answered "no such route" for, each with the
    time (`clock`'s) until which it is not asked again."""

    clock: Callable[[], float] = time.monotonic
    until: dict[str, float] = field(default_factory=dict)

    def learn(self, path: str) -> None:
        if path in API_PATHS:
            self.until[path] = self.clock() + MISSING_ROUTE_SECONDS

    def lacks(self, path: str) -> bool:
        until = self.until.get(path) if self.until else None
        return until is not None and until > self.clock()

    def serving(self, serves: Callable[[str], bool]) -> Callable[[str], bool]:
        """`serves` (the adapter's table) with what the engine said of itself."""
        return lambda path: serves(path) and not self.lacks(path)
