"""llama.cpp `llama-server --metrics`: OpenAI-compatible, `/health`, `/metrics`.

It reports no TTFT/ITL histograms (`predicted_tokens_seconds` is a rate, not a
latency). The average ITL comes from its decode counters instead: seconds spent
generating over tokens generated, both summed over its slots as requests end, over
each scrape interval. TTFT has no such pair (no request count), P90s need a
histogram, and current releases have no KV-cache ratio: those fields stay None.
"""

from __future__ import annotations

from agent.engines.base import EngineAdapter, MetricNames

LLAMACPP_METRICS = MetricNames(
    kv_cache_utilization=("llamacpp:kv_cache_usage_ratio",),
    running_requests=("llamacpp:requests_processing",),
    waiting_requests=("llamacpp:requests_deferred",),
    itl_counters=(("llamacpp:tokens_predicted_seconds_total", "llamacpp:tokens_predicted_total"),),
    predicted_tps=("llamacpp:predicted_tokens_seconds",),
    prompt_tps=("llamacpp:prompt_tokens_seconds",),
)


class LlamacppAdapter(EngineAdapter):
    name = "llamacpp"
    default_backend_url = "http://localhost:8080"
    metric_names = LLAMACPP_METRICS


ADAPTER = LlamacppAdapter()
