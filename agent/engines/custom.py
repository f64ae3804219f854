"""Any other HTTP inference server: the operator names its health URL and model.

Metrics are read only from an explicit `--metrics-url`, under every name a known engine
uses, since such servers are often a known engine behind a proxy.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from agent.engines.base import EngineAdapter, EngineEndpoints
from agent.engines.llamacpp import LLAMACPP_METRICS
from agent.engines.sglang import SGLANG_METRICS
from agent.engines.vllm import VLLM_METRICS


class CustomAdapter(EngineAdapter):
    name = "custom"
    health_path = None
    metrics_path = None
    metric_names = VLLM_METRICS | SGLANG_METRICS | LLAMACPP_METRICS

    def endpoints(
        self, backend_url: str | None, health_url: str | None, metrics_url: str | None
    ) -> EngineEndpoints:
        if not health_url:
            raise ValueError("engine custom: --health-url is required")
        if not backend_url:
            # The health endpoint is served by the backend itself in every server we know.
            parts = urlsplit(health_url)
            backend_url = f"{parts.scheme}://{parts.netloc}"
        return super().endpoints(backend_url, health_url, metrics_url)

    async def discover_model(self, client: httpx.AsyncClient, ep: EngineEndpoints) -> str | None:
        # An unknown server's model list cannot be trusted to name the served model.
        return None


ADAPTER = CustomAdapter()
