"""vLLM: OpenAI-compatible server, `/health`, Prometheus `/metrics` labelled by model."""

from __future__ import annotations

from agent.engines.base import EngineAdapter, MetricNames

VLLM_METRICS = MetricNames(
    kv_cache_utilization=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    running_requests=("vllm:num_requests_running",),
    waiting_requests=("vllm:num_requests_waiting",),
    ttft_histogram=("vllm:time_to_first_token_seconds",),
    itl_histogram=("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    preemptions=("vllm:num_preemptions_total",),
    prompt_tokens_histogram=("vllm:request_prompt_tokens",),
    generation_tokens_histogram=("vllm:request_generation_tokens",),
    finish_reasons=("vllm:request_success_total",),
)


class VllmAdapter(EngineAdapter):
    name = "vllm"
    default_backend_url = "http://localhost:8000"
    metric_names = VLLM_METRICS


ADAPTER = VllmAdapter()
