"""Ollama: no `/metrics`; health and models from `/api/tags`, as the Go agent reads them."""

from __future__ import annotations

import httpx

from agent.engines.base import EngineAdapter, EngineEndpoints, get_json, join_url
from protocol.paths import API_PATHS, RERANK

# Ollama's name for a model pulled without a tag; a client asks for `llama3.1`.
IMPLICIT_TAG = ":latest"


def public_name(ollama_name: str) -> str:
    """The name a model is registered under: Ollama's, less an implicit `:latest`
    (`llama3.1:latest` is `llama3.1`; `llama3.1:8b` stays)."""
    return ollama_name.removesuffix(IMPLICIT_TAG)


def _pulled(body: object) -> list[str] | None:
    """The model names of an `/api/tags` answer in its order; None when it is not one."""
    models = body.get("models") if isinstance(body, dict) else None
    if not isinstance(models, list):
        return None
    names = (m.get("name") or m.get("model") for m in models if isinstance(m, dict))
    return [name for name in names if isinstance(name, str) and name]


class OllamaAdapter(EngineAdapter):
    name = "ollama"
    default_backend_url = "http://localhost:11434"
    health_path = "/api/tags"
    metrics_path = None
    # No reranking API (agent/engines/endpoints.py).
    api_paths = API_PATHS - {RERANK}

    def answers_for(self, response: httpx.Response, model: str | None) -> bool:
        """Ollama lists the agent's model: a model not pulled yet (or removed) would
        fail every request sent to it."""
        if not model:
            return True
        try:
            names = _pulled(response.json())
        except ValueError:
            names = None
        # A --health-url of the operator's that is no model list says only that Ollama
        # is up.
        return names is None or public_name(model) in {public_name(n) for n in names}

    async def discover_model(self, client: httpx.AsyncClient, ep: EngineEndpoints) -> str | None:
        """The first model `/api/tags` lists (Ollama loads it on the first request)."""
        names = _pulled(await get_json(client, join_url(ep.backend_url, "/api/tags")))
        return public_name(names[0]) if names else None


ADAPTER = OllamaAdapter()
