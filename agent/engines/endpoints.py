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
"""

from __future__ import annotations

from protocol.paths import API_PATHS


def lacks(endpoints: frozenset[str], path: str) -> bool:
    """Whether an engine serving `endpoints` is known not to serve `path`."""
    return path in API_PATHS and path not in endpoints
