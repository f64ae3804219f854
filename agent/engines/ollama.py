"""Ollama: no `/metrics`; health from `/api/version`; models from `/api/ps` and `/api/tags`."""

from __future__ import annotations

import httpx

from agent.engines.base import EngineAdapter, EngineEndpoints, get_json, join_url
from protocol.paths import API_PATHS, RERANK


class OllamaAdapter(EngineAdapter):
    name = "ollama"
    default_backend_url = "http://localhost:11434"
    health_path = "/api/version"
    metrics_path = None
    # No reranking API (agent/engines/endpoints.py).
    api_paths = API_PATHS - {RERANK}

    async def discover_model(self, client: httpx.AsyncClient, ep: EngineEndpoints) -> str | None:
        # A loaded model (`/api/ps`) is the one already serving; otherwise the first
        # pulled one (`/api/tags`), which Ollama loads on the first request.
        for path in ("/api/ps", "/api/tags"):
            body = await get_json(client, join_url(ep.backend_url, path))
            models = body.get("models") if isinstance(body, dict) else None
            if isinstance(models, list) and models and isinstance(models[0], dict):
                name = models[0].get("model") or models[0].get("name")
                if isinstance(name, str) and name:
                    return name
        return None


ADAPTER = OllamaAdapter()
