"""SGLang (`--enable-metrics`): OpenAI-compatible server, `/health`, `/metrics`."""

from __future__ import annotations

from agent.engines.base import EngineAdapter, MetricNames


def _both_prefixes(*names: str) -> tuple[str, ...]:
    # SGLang names its metrics `sglang:x`; some deployments (multi-tokenizer mode,
    # exporters that rewrite colons) expose `sglang_x` instead.
    return tuple(f"sglang{sep}{name}" for name in names for sep in (":", "_"))


SGLANG_METRICS = MetricNames(
    kv_cache_utilization=_both_prefixes("token_usage"),
    running_requests=_both_prefixes("num_running_reqs"),
    waiting_requests=_both_prefixes("num_queue_reqs"),
    ttft_histogram=_both_prefixes("time_to_first_token_seconds"),
    itl_histogram=_both_prefixes("inter_token_latency_seconds"),
)


class SglangAdapter(EngineAdapter):
    name = "sglang"
    default_backend_url = "http://localhost:30000"
    metric_names = SGLANG_METRICS


ADAPTER = SglangAdapter()
