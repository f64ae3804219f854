"""llama.cpp `llama-server --metrics`: OpenAI-compatible, `/health`, `/metrics`.

It reports no TTFT/ITL histograms (`predicted_tokens_seconds` is a rate, not a
latency), and current releases no KV-cache ratio: those fields stay None.
"""

from __future__ import annotations

from agent.engines.base import EngineAdapter, MetricNames

LLAMACPP_METRICS = MetricNames(
    kv_cache_utilization=("llamacpp:kv_cache_usage_ratio",),
    running_requests=("llamacpp:requests_processing",),
    waiting_requests=("llamacpp:requests_deferred",),
)


class LlamacppAdapter(EngineAdapter):
    name = "llamacpp"
    default_backend_url = "http://localhost:8080"
    metric_names = LLAMACPP_METRICS


ADAPTER = LlamacppAdapter()
