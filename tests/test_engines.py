"""Engine adapters: endpoints, health, model discovery and `/metrics` parsing.

The fixtures are `/metrics` texts in each engine's own format (names, labels, bucket
bounds, the unrelated series around them); expected values are computed by hand in the
comments next to each test.
"""

# ruff: noqa: E501  (the fixtures are engine output lines, kept verbatim)
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from agent.app import AgentDaemon
from agent.engines import ENGINES, FIELDS, EngineEndpoints, HealthTracker, get_adapter
from agent.engines.base import histogram_quantile
from agent.link import RouterSession
from agent.settings import AgentSettings

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# vLLM V1 (current names). Scrape 1.
VLLM_CURRENT_1 = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12034.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5120.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.2
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.08",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.75",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="5.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7649e+09
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.025",model_name="meta-llama/Llama-3.1-8B-Instruct"} 300.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.05",model_name="meta-llama/Llama-3.1-8B-Instruct"} 390.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.075",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.15",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.2",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.3",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
"""

# Scrape 2: 10 more TTFT observations (sum +2.0), 400 more ITL observations (sum +12.0).
VLLM_CURRENT_2 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.875
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.2
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.08",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="meta-llama/Llama-3.1-8B-Instruct"} 18.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.75",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="5.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 150.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.025",model_name="meta-llama/Llama-3.1-8B-Instruct"} 500.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.05",model_name="meta-llama/Llama-3.1-8B-Instruct"} 690.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.075",model_name="meta-llama/Llama-3.1-8B-Instruct"} 790.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 800.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.15",model_name="meta-llama/Llama-3.1-8B-Instruct"} 800.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.2",model_name="meta-llama/Llama-3.1-8B-Instruct"} 800.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.3",model_name="meta-llama/Llama-3.1-8B-Instruct"} 800.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 800.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 800.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 800.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 800.0
"""

# vLLM V0 (older names, no `engine` label): gpu_cache_usage_perc, time_per_output_token_seconds.
VLLM_OLDER_1 = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 2.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 5.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 0.9
# HELP vllm:cpu_cache_usage_perc CPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 2.0
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 0.0
vllm:time_to_first_token_seconds_bucket{le="0.25",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 2.0
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 4.0
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 4.0
vllm:time_to_first_token_seconds_bucket{le="2.5",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 4.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 4.0
vllm:time_to_first_token_seconds_count{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 4.0
# HELP vllm:time_per_output_token_seconds Histogram of time per output token in seconds.
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_sum{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 1.0
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 0.0
vllm:time_per_output_token_seconds_bucket{le="0.025",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 20.0
vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 40.0
vllm:time_per_output_token_seconds_bucket{le="0.075",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 40.0
vllm:time_per_output_token_seconds_bucket{le="2.5",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 40.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 40.0
vllm:time_per_output_token_seconds_count{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 40.0
"""

# Scrape 2: TTFT +4 observations (sum +4.0), all in (0.5, 1.0]; TPOT +10 (sum +0.5), all in
# (0.025, 0.05] except 2 above 2.5.
VLLM_OLDER_2 = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 0.5
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 6.0
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 0.0
vllm:time_to_first_token_seconds_bucket{le="0.25",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 2.0
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 4.0
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 8.0
vllm:time_to_first_token_seconds_bucket{le="2.5",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 8.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 8.0
vllm:time_to_first_token_seconds_count{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 8.0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_sum{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 1.5
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 0.0
vllm:time_per_output_token_seconds_bucket{le="0.025",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 20.0
vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 48.0
vllm:time_per_output_token_seconds_bucket{le="0.075",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 48.0
vllm:time_per_output_token_seconds_bucket{le="2.5",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 48.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="mistralai/Mistral-7B-Instruct-v0.3"} 50.0
vllm:time_per_output_token_seconds_count{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 50.0
"""

# Data-parallel vLLM (engines 0 and 1 of one model) next to a second model's engine.
VLLM_TWO_MODELS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 3.0
vllm:num_requests_running{engine="1",model_name="a"} 4.0
vllm:num_requests_running{engine="0",model_name="b"} 10.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a"} 1.0
vllm:num_requests_waiting{engine="1",model_name="a"} 2.0
vllm:num_requests_waiting{engine="0",model_name="b"} 20.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.3
vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.6
vllm:kv_cache_usage_perc{engine="0",model_name="b"} 0.95
"""

# SGLang `--enable-metrics`, `sglang:` prefix; the `sglang_` variant is the same text
# with the other prefix (exposition via multi-tokenizer/exporters).
SGLANG_1 = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 5321.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 0.28
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 412.5
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="Qwen/Qwen2.5-7B-Instruct"} 81920.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="Qwen/Qwen2.5-7B-Instruct"} 3.0
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="Qwen/Qwen2.5-7B-Instruct"} 2.0
sglang:time_to_first_token_seconds_bucket{le="0.2",model_name="Qwen/Qwen2.5-7B-Instruct"} 4.0
sglang:time_to_first_token_seconds_bucket{le="0.4",model_name="Qwen/Qwen2.5-7B-Instruct"} 6.0
sglang:time_to_first_token_seconds_bucket{le="0.6",model_name="Qwen/Qwen2.5-7B-Instruct"} 8.0
sglang:time_to_first_token_seconds_bucket{le="0.8",model_name="Qwen/Qwen2.5-7B-Instruct"} 10.0
sglang:time_to_first_token_seconds_bucket{le="1.0",model_name="Qwen/Qwen2.5-7B-Instruct"} 10.0
sglang:time_to_first_token_seconds_bucket{le="2.0",model_name="Qwen/Qwen2.5-7B-Instruct"} 10.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 10.0
sglang:time_to_first_token_seconds_count{model_name="Qwen/Qwen2.5-7B-Instruct"} 10.0
# HELP sglang:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_sum{model_name="Qwen/Qwen2.5-7B-Instruct"} 1.0
sglang:inter_token_latency_seconds_bucket{le="0.002",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.0
sglang:inter_token_latency_seconds_bucket{le="0.004",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.0
sglang:inter_token_latency_seconds_bucket{le="0.006",model_name="Qwen/Qwen2.5-7B-Instruct"} 10.0
sglang:inter_token_latency_seconds_bucket{le="0.008",model_name="Qwen/Qwen2.5-7B-Instruct"} 50.0
sglang:inter_token_latency_seconds_bucket{le="0.01",model_name="Qwen/Qwen2.5-7B-Instruct"} 100.0
sglang:inter_token_latency_seconds_bucket{le="0.015",model_name="Qwen/Qwen2.5-7B-Instruct"} 100.0
sglang:inter_token_latency_seconds_bucket{le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 100.0
sglang:inter_token_latency_seconds_count{model_name="Qwen/Qwen2.5-7B-Instruct"} 100.0
"""

# Scrape 2: TTFT +10 (sum +5.0), 5 in (0.4, 0.6], 5 in (0.6, 0.8]; ITL +100 (sum +1.5),
# 60 in (0.01, 0.015], 40 in (0.008, 0.01].
SGLANG_2 = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 0.05
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 0.0
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="Qwen/Qwen2.5-7B-Instruct"} 8.0
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="Qwen/Qwen2.5-7B-Instruct"} 2.0
sglang:time_to_first_token_seconds_bucket{le="0.2",model_name="Qwen/Qwen2.5-7B-Instruct"} 4.0
sglang:time_to_first_token_seconds_bucket{le="0.4",model_name="Qwen/Qwen2.5-7B-Instruct"} 6.0
sglang:time_to_first_token_seconds_bucket{le="0.6",model_name="Qwen/Qwen2.5-7B-Instruct"} 13.0
sglang:time_to_first_token_seconds_bucket{le="0.8",model_name="Qwen/Qwen2.5-7B-Instruct"} 20.0
sglang:time_to_first_token_seconds_bucket{le="1.0",model_name="Qwen/Qwen2.5-7B-Instruct"} 20.0
sglang:time_to_first_token_seconds_bucket{le="2.0",model_name="Qwen/Qwen2.5-7B-Instruct"} 20.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 20.0
sglang:time_to_first_token_seconds_count{model_name="Qwen/Qwen2.5-7B-Instruct"} 20.0
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_sum{model_name="Qwen/Qwen2.5-7B-Instruct"} 2.5
sglang:inter_token_latency_seconds_bucket{le="0.002",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.0
sglang:inter_token_latency_seconds_bucket{le="0.004",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.0
sglang:inter_token_latency_seconds_bucket{le="0.006",model_name="Qwen/Qwen2.5-7B-Instruct"} 10.0
sglang:inter_token_latency_seconds_bucket{le="0.008",model_name="Qwen/Qwen2.5-7B-Instruct"} 50.0
sglang:inter_token_latency_seconds_bucket{le="0.01",model_name="Qwen/Qwen2.5-7B-Instruct"} 140.0
sglang:inter_token_latency_seconds_bucket{le="0.015",model_name="Qwen/Qwen2.5-7B-Instruct"} 200.0
sglang:inter_token_latency_seconds_bucket{le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 200.0
sglang:inter_token_latency_seconds_count{model_name="Qwen/Qwen2.5-7B-Instruct"} 200.0
"""

# llama-server --metrics, a release that still had the KV-cache ratio.
LLAMACPP_WITH_KV = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1024
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 0.512
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 2048
# HELP llamacpp:tokens_predicted_seconds_total Predict process time
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 40.96
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 2100
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode counter
llamacpp:n_busy_slots_per_decode 1.5
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 2000
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 50
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.35
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 1434
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""

# Current llama-server: no KV-cache ratio.
LLAMACPP_CURRENT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 4096
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 8192
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 48.2
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def _ttft_itl(values: dict[str, float | None]) -> tuple[float | None, ...]:
    return (
        values["avg_ttft_seconds"],
        values["p90_ttft_seconds"],
        values["avg_itl_seconds"],
        values["p90_itl_seconds"],
    )


def test_engine_list_and_unknown_engine() -> None:
    assert ENGINES == ("vllm", "sglang", "llamacpp", "ollama", "infinity", "custom", "sim")
    for engine in ENGINES:
        assert get_adapter(engine).name == engine
    with pytest.raises(ValueError, match="unknown engine"):
        get_adapter("tgi")
    # Infinity: embeddings and reranking only, no engine gauges (as upstream's agent).
    infinity = get_adapter("infinity")
    assert infinity.serves("/v1/embeddings") and infinity.serves("/v1/rerank")
    assert not infinity.serves("/v1/chat/completions")
    assert infinity.endpoints(None, None, None).metrics_url is None


def test_vllm_current_names_and_interval_histograms() -> None:
    sampler = get_adapter("vllm").new_sampler(MODEL)
    first = sampler.update(VLLM_CURRENT_1, now=100.0)
    # `upstream`: the engine's own histograms, for --metrics-compat upstream.
    assert set(first) - {"upstream"} == set(FIELDS)
    assert first["kv_cache_utilization"] == pytest.approx(0.42)
    assert first["running_requests"] == 3.0
    assert first["waiting_requests"] == 1.0
    # No previous scrape: no interval to average over.
    assert _ttft_itl(first) == (None, None, None, None)

    second = sampler.update(VLLM_CURRENT_2, now=100.5)
    assert second["kv_cache_utilization"] == pytest.approx(0.875)
    assert second["running_requests"] == 7.0
    assert second["waiting_requests"] == 0.0
    # TTFT: 10 new observations, sum 3.2 - 1.2 = 2.0 -> avg 0.2. Bucket deltas: 0.08:2,
    # 0.1:6, 0.25:10, +Inf:10. Rank 9 falls in (0.1, 0.25] holding 4 with 6 below:
    # 0.1 + 0.15 * 3/4 = 0.2125.
    assert second["avg_ttft_seconds"] == pytest.approx(0.2)
    assert second["p90_ttft_seconds"] == pytest.approx(0.2125)
    # ITL: 400 new, sum 12.0 -> 0.03. Deltas: 0.01:50, 0.025:200, 0.05:300, 0.075:390.
    # Rank 360 in (0.05, 0.075] holding 90 with 300 below: 0.05 + 0.025 * 60/90.
    assert second["avg_itl_seconds"] == pytest.approx(0.03)
    assert second["p90_itl_seconds"] == pytest.approx(0.05 + 0.025 * 60 / 90)


def test_vllm_older_names() -> None:
    sampler = get_adapter("vllm").new_sampler("mistralai/Mistral-7B-Instruct-v0.3")
    first = sampler.update(VLLM_OLDER_1, now=0.0)
    assert first["kv_cache_utilization"] == pytest.approx(0.9)
    assert first["running_requests"] == 2.0
    assert first["waiting_requests"] == 5.0
    second = sampler.update(VLLM_OLDER_2, now=0.5)
    assert second["kv_cache_utilization"] == pytest.approx(0.5)
    # TTFT: 4 new, sum +4.0 -> 1.0; all 4 in (0.5, 1.0]: rank 3.6 -> 0.5 + 0.5 * 3.6/4.
    assert second["avg_ttft_seconds"] == pytest.approx(1.0)
    assert second["p90_ttft_seconds"] == pytest.approx(0.95)
    # TPOT (older ITL name): 10 new, sum +0.5 -> 0.05. 8 in (0.025, 0.05], 2 above 2.5:
    # rank 9 lies in the +Inf bucket, which Prometheus answers with the highest finite
    # bound, 2.5.
    assert second["avg_itl_seconds"] == pytest.approx(0.05)
    assert second["p90_itl_seconds"] == pytest.approx(2.5)


def test_vllm_current_name_wins_when_both_are_exposed() -> None:
    both = (
        VLLM_CURRENT_1
        + '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="x"} 0.99\n'
    )
    values = get_adapter("vllm").new_sampler(MODEL).update(both, now=0.0)
    assert values["kv_cache_utilization"] == pytest.approx(0.42)


def test_vllm_series_of_the_served_model() -> None:
    adapter = get_adapter("vllm")
    a = adapter.new_sampler("a").update(VLLM_TWO_MODELS, now=0.0)
    # Counts sum over the model's data-parallel engines; cache use is the fuller engine.
    assert (a["running_requests"], a["waiting_requests"]) == (7.0, 3.0)
    assert a["kv_cache_utilization"] == pytest.approx(0.6)
    every = adapter.new_sampler(None).update(VLLM_TWO_MODELS, now=0.0)
    assert (every["running_requests"], every["waiting_requests"]) == (17.0, 23.0)
    assert every["kv_cache_utilization"] == pytest.approx(0.95)
    # A public name the engine does not label with: the engine's whole load.
    renamed = adapter.new_sampler("public-name").update(VLLM_TWO_MODELS, now=0.0)
    assert renamed["running_requests"] == 17.0


@pytest.mark.parametrize("prefix", ["sglang:", "sglang_"])
def test_sglang_both_prefixes(prefix: str) -> None:
    sampler = get_adapter("sglang").new_sampler("Qwen/Qwen2.5-7B-Instruct")
    first = sampler.update(SGLANG_1.replace("sglang:", prefix), now=0.0)
    assert first["kv_cache_utilization"] == pytest.approx(0.28)
    assert first["running_requests"] == 4.0
    assert first["waiting_requests"] == 2.0
    assert _ttft_itl(first) == (None, None, None, None)
    second = sampler.update(SGLANG_2.replace("sglang:", prefix), now=0.5)
    assert second["kv_cache_utilization"] == pytest.approx(0.05)
    assert (second["running_requests"], second["waiting_requests"]) == (1.0, 0.0)
    # TTFT: 10 new, sum +5.0 -> 0.5. Deltas 0.6:5, 0.8:10; rank 9 in (0.6, 0.8] holding 5
    # with 5 below: 0.6 + 0.2 * 4/5 = 0.76.
    assert second["avg_ttft_seconds"] == pytest.approx(0.5)
    assert second["p90_ttft_seconds"] == pytest.approx(0.76)
    # ITL: 100 new, sum +1.5 -> 0.015. Deltas 0.01:40, 0.015:100; rank 90 in
    # (0.01, 0.015] holding 60 with 40 below: 0.01 + 0.005 * 50/60.
    assert second["avg_itl_seconds"] == pytest.approx(0.015)
    assert second["p90_itl_seconds"] == pytest.approx(0.01 + 0.005 * 50 / 60)


def test_llamacpp_with_and_without_kv_ratio() -> None:
    adapter = get_adapter("llamacpp")
    older = adapter.new_sampler(None).update(LLAMACPP_WITH_KV, now=0.0)
    assert older["kv_cache_utilization"] == pytest.approx(0.35)
    assert older["running_requests"] == 2.0
    assert older["waiting_requests"] == 1.0
    sampler = adapter.new_sampler("any")
    for now in (0.0, 0.5):
        current = sampler.update(LLAMACPP_CURRENT, now=now)
        # Missing, not zero: a kv gate must skip this agent rather than pass it on 0.
        assert current["kv_cache_utilization"] is None
        assert current["running_requests"] == 0.0
        assert current["waiting_requests"] == 0.0
        # Throughput gauges are not latencies; the decode counters did not move.
        assert _ttft_itl(current) == (None, None, None, None)


def _llamacpp_counters(seconds: float, tokens: float) -> str:
    return (
        "# TYPE llamacpp:tokens_predicted_total counter\n"
        f"llamacpp:tokens_predicted_total {tokens}\n"
        "# TYPE llamacpp:tokens_predicted_seconds_total counter\n"
        f"llamacpp:tokens_predicted_seconds_total {seconds}\n"
        "llamacpp:requests_processing 1\n"
    )


@pytest.mark.parametrize("engine", ["llamacpp", "custom"])
def test_llamacpp_average_itl_from_its_decode_counters(engine: str) -> None:
    """Seconds decoding over tokens decoded in the window: the first scrape, a window
    with no token done and a counter that fell (a restart) give None."""
    sampler = get_adapter(engine).new_sampler(None)
    scrapes = [
        (0.0, (10.0, 1000.0), None),  # first: nothing to compare with
        (0.5, (12.5, 1100.0), 0.025),  # 2.5 s for 100 tokens
        (1.0, (12.5, 1100.0), 0.025),  # idle, within the window: the window's average
        (1.5, (13.0, 1150.0), 0.02),  # 3 s for 150 tokens since the first scrape
        (40.0, (13.0, 1150.0), None),  # idle for a window: no verdict, not zero
        (40.5, (0.2, 10.0), None),  # restarted
        (41.0, (0.5, 40.0), 0.01),
    ]
    for now, (seconds, tokens), want in scrapes:
        values = sampler.update(_llamacpp_counters(seconds, tokens), now=now)
        if want is None:
            assert values["avg_itl_seconds"] is None, now
        else:
            assert values["avg_itl_seconds"] == pytest.approx(want), now
        assert values["p90_itl_seconds"] is None and values["avg_ttft_seconds"] is None


def _ttft_page(total: float, count: float, fast: float) -> str:
    """A TTFT histogram: `fast` of `count` observations within 0.1 s, the rest within 1 s."""
    return (
        f'vllm:time_to_first_token_seconds_bucket{{le="0.1",model_name="{MODEL}"}} {fast}\n'
        f'vllm:time_to_first_token_seconds_bucket{{le="1.0",model_name="{MODEL}"}} {count}\n'
        f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="{MODEL}"}} {count}\n'
        f'vllm:time_to_first_token_seconds_sum{{model_name="{MODEL}"}} {total}\n'
        f'vllm:time_to_first_token_seconds_count{{model_name="{MODEL}"}} {count}\n'
    )


def test_latencies_cover_the_window_not_one_scrape_interval() -> None:
    """A slow answer keeps its agent's TTFT through LATENCY_WINDOW seconds of scrapes
    without another, so a gate on it holds between requests; then the value is missing
    again, and the agent, excluded meanwhile, is tried again."""
    sampler = get_adapter("vllm").new_sampler(MODEL)
    assert sampler.update(_ttft_page(0.0, 0, 0), now=0.0)["avg_ttft_seconds"] is None
    # Two answers of 0.8 s each between the first two scrapes.
    slow = sampler.update(_ttft_page(1.6, 2, 0), now=0.5)
    assert slow["avg_ttft_seconds"] == pytest.approx(0.8)
    assert slow["p90_ttft_seconds"] == pytest.approx(0.1 + 0.9 * 1.8 / 2)

    def scrapes(start: float, end: float, page: str) -> list[float | None]:
        times = [start + 0.5 * i for i in range(int((end - start) / 0.5) + 1)]
        return [sampler.update(page, now=t)["avg_ttft_seconds"] for t in times]

    assert scrapes(1.0, 10.0, _ttft_page(1.6, 2, 0)) == [pytest.approx(0.8)] * 19
    # Eight fast answers (0.05 s each): the window holds all ten.
    assert scrapes(10.5, 30.0, _ttft_page(2.0, 10, 8)) == [pytest.approx(0.2)] * 40
    # A window after the slow ones, only the fast ones; a window after those, nothing.
    assert scrapes(30.5, 40.0, _ttft_page(2.0, 10, 8)) == [pytest.approx(0.05)] * 20
    assert scrapes(40.5, 41.0, _ttft_page(2.0, 10, 8)) == [None, None]


def test_an_itl_histogram_wins_over_the_decode_counters() -> None:
    """`custom` reads every engine's names: an engine with both keeps its histogram's."""
    sampler = get_adapter("custom").new_sampler(None)
    for seconds, tokens, itl_sum, itl_count in ((1.0, 100.0, 1.0, 100.0), (3.0, 200.0, 1.5, 200.0)):
        page = _llamacpp_counters(seconds, tokens) + (
            "# TYPE vllm:inter_token_latency_seconds histogram\n"
            f'vllm:inter_token_latency_seconds_bucket{{le="+Inf"}} {itl_count}\n'
            f"vllm:inter_token_latency_seconds_sum {itl_sum}\n"
            f"vllm:inter_token_latency_seconds_count {itl_count}\n"
        )
        values = sampler.update(page, now=0.0)
    assert values["avg_itl_seconds"] == pytest.approx(0.005)


def test_ollama_has_no_metrics() -> None:
    adapter = get_adapter("ollama")
    ep = adapter.endpoints(None, None, None)
    assert ep.metrics_url is None
    values = adapter.new_sampler("llama3").update(VLLM_CURRENT_1, now=0.0)
    assert values == dict.fromkeys(FIELDS)


def test_custom_reads_every_known_name_from_an_explicit_url() -> None:
    sampler = get_adapter("custom").new_sampler(None)
    assert sampler.update(LLAMACPP_WITH_KV, now=0.0)["running_requests"] == 2.0
    assert sampler.update(SGLANG_1, now=0.5)["kv_cache_utilization"] == pytest.approx(0.28)


def test_no_new_observations_is_none_not_zero() -> None:
    sampler = get_adapter("vllm").new_sampler(MODEL)
    sampler.update(VLLM_CURRENT_1, now=0.0)
    same = sampler.update(VLLM_CURRENT_1, now=0.5)
    assert _ttft_itl(same) == (None, None, None, None)
    assert same["running_requests"] == 3.0


def test_counter_reset_is_not_a_negative_interval() -> None:
    sampler = get_adapter("vllm").new_sampler(MODEL)
    sampler.update(VLLM_CURRENT_2, now=0.0)
    # The engine restarted: its counters went back down. The interval is unknown...
    assert _ttft_itl(sampler.update(VLLM_CURRENT_1, now=0.5)) == (None, None, None, None)
    # ...and the next one is measured from the restarted counters.
    assert sampler.update(VLLM_CURRENT_2, now=1.0)["avg_ttft_seconds"] == pytest.approx(0.2)


def test_missing_histogram_resets_history() -> None:
    sampler = get_adapter("vllm").new_sampler(MODEL)
    sampler.update(VLLM_CURRENT_1, now=0.0)
    gauges_only = VLLM_TWO_MODELS
    assert _ttft_itl(sampler.update(gauges_only, now=0.5)) == (None, None, None, None)
    assert _ttft_itl(sampler.update(VLLM_CURRENT_2, now=1.0)) == (None, None, None, None)


def test_empty_and_malformed_text() -> None:
    sampler = get_adapter("vllm").new_sampler(MODEL)
    assert sampler.update("", now=0.0) == dict.fromkeys(FIELDS)
    with pytest.raises(ValueError, match="malformed"):
        sampler.update('vllm:num_requests_running{model_name="x} 1\n', now=0.0)


def test_untyped_exposition_is_read_by_sample_name() -> None:
    text = (
        "sglang_num_running_reqs 3\n"
        'sglang_time_to_first_token_seconds_bucket{le="1.0"} 4\n'
        'sglang_time_to_first_token_seconds_bucket{le="+Inf"} 4\n'
        "sglang_time_to_first_token_seconds_sum 2\n"
        "sglang_time_to_first_token_seconds_count 4\n"
    )
    sampler = get_adapter("sglang").new_sampler(None)
    assert sampler.update(text, now=0.0)["running_requests"] == 3.0
    later = text.replace("} 4", "} 8").replace("_sum 2", "_sum 6").replace("_count 4", "_count 8")
    second = sampler.update(later, now=0.5)
    assert second["avg_ttft_seconds"] == pytest.approx(1.0)
    assert second["p90_ttft_seconds"] == pytest.approx(0.9)


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-Inf", "1e308"])
def test_non_finite_samples_are_unknown(bad: str) -> None:
    # Valid Prometheus text; before, NaN and the infinities reached the heartbeat and
    # the router's routing table (bare NaN/Infinity, invalid JSON). 1e308 is finite but
    # two of them sum past the largest float.
    def text(count: int) -> str:
        return (
            f"sglang_token_usage {bad}\n"
            f"sglang_num_running_reqs {bad}\n"
            f"sglang_num_running_reqs {bad}\n"
            "sglang_num_queue_reqs 2\n"
            f'sglang_time_to_first_token_seconds_bucket{{le="1.0"}} {bad}\n'
            f'sglang_time_to_first_token_seconds_bucket{{le="+Inf"}} {count}\n'
            f"sglang_time_to_first_token_seconds_sum {bad}\n"
            f"sglang_time_to_first_token_seconds_count {count}\n"
        )

    sampler = get_adapter("sglang").new_sampler(None)
    sampler.update(text(4), now=0.0)
    values = sampler.update(text(8), now=0.5)
    json.dumps(values, allow_nan=False)
    assert values["waiting_requests"] == 2.0
    assert values["running_requests"] is None
    if bad != "1e308":
        assert values["kv_cache_utilization"] is None
        assert values["avg_ttft_seconds"] is None


def test_histogram_quantile_edges() -> None:
    assert histogram_quantile(0.9, []) is None
    assert histogram_quantile(0.9, [(1.0, 5.0)]) is None  # no +Inf bucket
    assert histogram_quantile(0.9, [(1.0, 0.0), (float("inf"), 0.0)]) is None
    # Unordered input is sorted first; lowest bucket interpolates from 0.
    assert histogram_quantile(0.5, [(float("inf"), 10.0), (2.0, 10.0)]) == pytest.approx(1.0)


def test_health_tracker_three_strikes() -> None:
    tracker = HealthTracker()
    # Never seen answering: unhealthy from the first failed check.
    assert tracker.healthy is False
    assert tracker.record(False) is False
    assert tracker.record(True) is True
    assert tracker.record(False) is True
    assert tracker.record(False) is True
    assert tracker.record(False) is False
    assert tracker.record(False) is False
    assert tracker.record(True) is True
    # The streak restarts after a success.
    assert tracker.record(False) is True
    assert tracker.record(False) is True
    assert tracker.record(False) is False


@pytest.mark.parametrize(
    ("engine", "backend", "health", "metrics"),
    [
        ("vllm", "http://localhost:8000", "/health", "/metrics"),
        ("sglang", "http://localhost:30000", "/health", "/metrics"),
        ("llamacpp", "http://localhost:8080", "/health", "/metrics"),
        ("ollama", "http://localhost:11434", "/api/tags", None),
    ],
)
def test_default_endpoints(engine: str, backend: str, health: str, metrics: str | None) -> None:
    ep = get_adapter(engine).endpoints(None, None, None)
    assert ep == EngineEndpoints(
        backend_url=backend,
        health_url=backend + health,
        metrics_url=None if metrics is None else backend + metrics,
    )


def test_endpoint_overrides() -> None:
    ep = get_adapter("vllm").endpoints("http://gpu1:9000/", None, "http://gpu1:9100/m")
    assert ep == EngineEndpoints(
        "http://gpu1:9000", "http://gpu1:9000/health", "http://gpu1:9100/m"
    )
    sim = get_adapter("sim").endpoints("http://127.0.0.1:4321", None, None)
    assert sim.health_url == "http://127.0.0.1:4321/health"
    assert sim.metrics_url == "http://127.0.0.1:4321/metrics"
    with pytest.raises(ValueError, match="backend-url"):
        get_adapter("sim").endpoints(None, None, None)


def test_custom_needs_a_health_url() -> None:
    custom = get_adapter("custom")
    with pytest.raises(ValueError, match="health-url"):
        custom.endpoints("http://localhost:7000", None, None)
    ep = custom.endpoints(None, "http://10.0.0.5:7000/healthz", None)
    assert ep == EngineEndpoints("http://10.0.0.5:7000", "http://10.0.0.5:7000/healthz", None)


def _client(routes: dict[str, httpx.Response]) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        return routes.get(request.url.path, httpx.Response(404))

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def test_health_checks() -> None:
    vllm = get_adapter("vllm")
    ep = vllm.endpoints(None, None, None)
    async with _client({"/health": httpx.Response(200)}) as client:
        assert await vllm.check_health(client, ep) is True
    async with _client({"/health": httpx.Response(503)}) as client:
        assert await vllm.check_health(client, ep) is False

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        assert await vllm.check_health(client, ep) is False


async def test_ollama_is_healthy_when_it_lists_the_agents_model() -> None:
    """Health is `/api/tags` answering with the agent's model in it (its implicit
    `:latest` or not): a model not pulled fails every request sent to it."""
    ollama = get_adapter("ollama")
    ep = ollama.endpoints(None, None, None)
    tags = {"models": [{"name": "llama3.1:latest"}, {"name": "mistral:7b"}]}
    async with _client({"/api/tags": httpx.Response(200, json=tags)}) as client:
        for model in (None, "llama3.1", "llama3.1:latest", "mistral:7b"):
            assert await ollama.check_health(client, ep, model) is True, model
        for model in ("llama3.1:8b", "mistral", "qwen2.5:7b"):
            assert await ollama.check_health(client, ep, model) is False, model
    async with _client({"/api/tags": httpx.Response(500)}) as client:
        assert await ollama.check_health(client, ep, None) is False
    # A list of no model names lists no model: not healthy for one.
    junk = {"models": [1, None, {"name": 5}, {"model": ["x"]}]}
    async with _client({"/api/tags": httpx.Response(200, json=junk)}) as client:
        assert await ollama.check_health(client, ep, "llama3.1") is False
        assert await ollama.discover_model(client, ep) is None
    # An operator's --health-url that is no model list: Ollama answering is enough.
    own = ollama.endpoints(None, "http://localhost:11434/api/version", None)
    async with _client({"/api/version": httpx.Response(200, json={"version": "0.5.7"})}) as client:
        assert await ollama.check_health(client, own, "llama3.1") is True


async def test_openai_model_discovery() -> None:
    listing = {"object": "list", "data": [{"id": MODEL, "object": "model"}, {"id": "lora-1"}]}
    for engine in ("vllm", "sglang", "llamacpp"):
        adapter = get_adapter(engine)
        ep = adapter.endpoints(None, None, None)
        async with _client({"/v1/models": httpx.Response(200, json=listing)}) as client:
            assert await adapter.discover_model(client, ep) == MODEL
        async with _client({"/v1/models": httpx.Response(200, json={"data": []})}) as client:
            assert await adapter.discover_model(client, ep) is None
        async with _client({"/v1/models": httpx.Response(200, text="<html>")}) as client:
            assert await adapter.discover_model(client, ep) is None


async def test_ollama_model_discovery() -> None:
    """The first model `/api/tags` lists, less an implicit `:latest`, as the Go agent
    registers it; loaded ones (`/api/ps`) come first in no way."""
    ollama = get_adapter("ollama")
    ep = ollama.endpoints(None, None, None)
    loaded = {"models": [{"name": "llama3.1:8b", "model": "llama3.1:8b", "size_vram": 1}]}
    for first, registered in (("qwen2.5:7b", "qwen2.5:7b"), ("llama3.1:latest", "llama3.1")):
        tags = {"models": [{"name": first, "model": first}, {"name": "llama3.1:8b"}]}
        routes = {
            "/api/ps": httpx.Response(200, json=loaded),
            "/api/tags": httpx.Response(200, json=tags),
        }
        async with _client(routes) as client:
            assert await ollama.discover_model(client, ep) == registered
    async with _client({"/api/tags": httpx.Response(200, json={"models": []})}) as client:
        assert await ollama.discover_model(client, ep) is None
    async with _client({}) as client:
        assert await ollama.discover_model(client, ep) is None


# --- the agent daemon's sampling loops and heartbeats ----------------------------------
# Driven on trio's autojump clock against httpx.MockTransport engines, so the times at
# which a scrape, a value and a heartbeat happen are exact.


def _daemon(tmp_path: Path, engine: str = "vllm", **settings: Any) -> AgentDaemon:
    return AgentDaemon(
        AgentSettings(
            routers=[],
            model=MODEL,
            engine=engine,
            identity_path=str(tmp_path / "agent.key"),
            **settings,
        )
    )


class _Page:
    """An engine's metrics page as `MetricsPage` reads it: `answer()` gives each
    (status, text); a status other than 2xx fails the read, as MetricsPage's does."""

    def __init__(self, answer: Callable[[], tuple[int, str]]) -> None:
        self.answer = answer
        self.times: list[float] = []

    async def text(self) -> str:
        self.times.append(trio.current_time())
        status, text = self.answer()
        if not 200 <= status < 300:
            raise ValueError(f"answered HTTP {status}")
        return text

    def close(self) -> None:
        pass


def _engine(answers: list[tuple[int, str] | str]) -> _Page:
    """An engine whose n-th `/metrics` answer is answers[n] (the last one repeats)."""
    page: _Page

    def answer() -> tuple[int, str]:
        given = answers[min(len(page.times) - 1, len(answers) - 1)]
        return given if isinstance(given, tuple) else (200, given)

    page = _Page(answer)
    return page


async def test_engine_loop_refreshes_values_only_on_good_scrapes(
    tmp_path: Path, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent")
    daemon = _daemon(tmp_path, engine_sample_interval=0.5)
    ep = daemon.adapter.endpoints("http://engine:8000", None, None)
    down = (503, "loading")
    # Scrapes at 0, 0.5, ...: two good ones, four failures, garbage, then the engine is
    # back after a restart (its histogram counters lower than before), then counting up.
    answers = [VLLM_CURRENT_1, VLLM_CURRENT_2, *[down] * 4, "{{{", VLLM_CURRENT_1, VLLM_CURRENT_2]
    page = _engine(answers)
    status = daemon.status
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(daemon._engine_loop, ep, page)
        await trio.sleep(0.25)
        assert status.engine is not None
        assert status.engine["kv_cache_utilization"] == pytest.approx(0.42)
        assert status.engine_at == pytest.approx(t0)
        await trio.sleep(0.5)
        assert status.engine["kv_cache_utilization"] == pytest.approx(0.875)
        assert status.engine["avg_ttft_seconds"] == pytest.approx(0.2)
        assert status.engine_at == pytest.approx(t0 + 0.5)
        # Failed scrapes from 1.0 leave the values and their time alone while they are
        # at most three periods old; the scrape at 2.5 finds them older and reports them
        # missing at once.
        changed = status.changed
        await trio.sleep(1.5)  # t0 + 2.25
        assert status.changed is changed  # nothing new to tell the routers
        assert status.engine["kv_cache_utilization"] == pytest.approx(0.875)
        assert status.engine_at == pytest.approx(t0 + 0.5)
        await trio.sleep(1.0)  # t0 + 3.25
        assert status.changed is not changed
        assert status.engine == dict.fromkeys(status.engine)
        heartbeat = status.heartbeat(5.0)["engine"]
        assert heartbeat["age"] == pytest.approx(2.75)
        # The agent confirms unchanged values with each 5 s heartbeat.
        assert heartbeat["interval"] == 5.0
        assert status.heartbeat(0.1)["engine"]["interval"] == 0.5
        changed = status.changed
        await trio.sleep(0.5)  # t0 + 3.75: the restarted engine answered at 3.5
        assert status.changed is not changed
        assert status.engine_at == pytest.approx(t0 + 3.5)
        assert status.engine["kv_cache_utilization"] == pytest.approx(0.42)
        # Counters went down: that interval has no TTFT/ITL, rather than a negative one.
        assert _ttft_itl(status.engine) == (None, None, None, None)
        await trio.sleep(0.5)
        assert status.engine["avg_ttft_seconds"] == pytest.approx(0.2)
        nursery.cancel_scope.cancel()
    # A fixed schedule: one scrape per period, whatever the answers.
    assert [round(t - t0, 6) for t in page.times] == [i * 0.5 for i in range(9)]
    failed = [r for r in caplog.records if "engine_metrics_failed" in r.getMessage()]
    recovered = [r for r in caplog.records if "engine_metrics_recovered" in r.getMessage()]
    assert len(failed) == 1  # one warning per failing streak, not one per scrape
    assert len(recovered) == 1


async def test_ollama_engine_loop_reports_nothing(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, engine="ollama")
    ep = daemon.adapter.endpoints("http://ollama:11434", None, None)
    await daemon._engine_loop(ep)  # returns at once: there is no /metrics
    heartbeat = daemon.status.heartbeat(5.0)
    assert heartbeat["engine"] == {}


async def test_backend_health_three_strikes_through_the_daemon(
    tmp_path: Path, autojump_clock: Any
) -> None:
    daemon = _daemon(tmp_path)
    ep = daemon.adapter.endpoints("http://engine:8000", None, None)
    answers = iter([200, 500, 500, 500, 500, 200])

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/health"
        return httpx.Response(next(answers))

    seen = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as probe:
        for _ in range(6):
            changed = daemon.status.changed
            await daemon._probe_health(probe, ep)
            seen.append((daemon.status.backend_healthy, daemon.status.changed is not changed))
    # (healthy, heartbeat woken): the first check reports healthy; the third failure in
    # a row reports unhealthy; one success recovers. Only changes wake the heartbeats.
    assert seen == [
        (True, True),
        (True, False),
        (True, False),
        (False, True),
        (False, False),
        (True, True),
    ]


async def test_a_backend_never_seen_answering_is_unhealthy_from_the_first_check(
    tmp_path: Path, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The three strikes spare a backend that was answering, not one that never did:
    an agent started beside a dead engine reports it unhealthy at once (and says so)."""
    daemon = _daemon(tmp_path)
    ep = daemon.adapter.endpoints("http://engine:8000", None, None)
    answers = iter([503, 503, 200, 500])

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(next(answers))

    seen = []
    caplog.set_level(logging.INFO, logger="agent")
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as probe:
        for _ in range(4):
            await daemon._probe_health(probe, ep)
            seen.append(daemon.status.backend_healthy)
    assert seen == [False, False, True, True]
    lines = [r.getMessage() for r in caplog.records if "backend_health" in r.getMessage()]
    assert lines == ["backend_health healthy=False", "backend_health healthy=True"]


async def test_discovery_says_once_that_it_waits_for_the_engine(
    tmp_path: Path, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = _daemon(tmp_path)
    ep = daemon.adapter.endpoints("http://engine:8000", None, None)
    answers = iter([503, 503, 200])

    def handle(request: httpx.Request) -> httpx.Response:
        status = next(answers)
        listing = {"data": [{"id": MODEL}]} if status == 200 else {}
        return httpx.Response(status, json=listing)

    caplog.set_level(logging.INFO, logger="agent")
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as probe:
        assert await daemon._discover(probe, ep) == MODEL
    lines = [r.getMessage().split(" ")[0] for r in caplog.records if "model_disc" in r.getMessage()]
    assert lines == ["model_discovery_pending", "model_discovered"]


async def test_an_engine_still_starting_is_checked_every_second(
    tmp_path: Path, autojump_clock: Any
) -> None:
    """Until its first answer the engine is checked every second, then every 2 s (the Go
    agent's cadence) while heartbeats are slower."""
    daemon = _daemon(tmp_path)
    daemon.settings.heartbeat_interval = 5.0
    ep = daemon.adapter.endpoints("http://engine:8000", None, None)
    answers = iter([503, 503, 503, 200, 200, 200])
    checked: list[float] = []

    def handle(request: httpx.Request) -> httpx.Response:
        checked.append(trio.current_time())
        return httpx.Response(next(answers))

    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as probe:
        with trio.move_on_after(9.5):
            await daemon._health_loop(probe, ep)
    assert checked == [1.0, 2.0, 3.0, 4.0, 6.0, 8.0]
    assert daemon.status.backend_healthy is True


class _Frames:
    """Stands in for the FramedStream of a RouterSession: records what the agent sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, dict]] = []
        self.closed = trio.Event()

    def send_nowait(self, msg: dict) -> None:
        self.sent.append((trio.current_time(), msg))

    def close(self, reason: str) -> None:
        self.closed.set()


def _kv_text(kv: float) -> str:
    return f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {kv}\n'


async def test_heartbeats_carry_changes_at_once_and_confirm_values_each_period(
    tmp_path: Path, autojump_clock: Any
) -> None:
    daemon = _daemon(tmp_path, engine_sample_interval=0.5, heartbeat_interval=5.0)
    ep = daemon.adapter.endpoints("http://engine:8000", None, None)
    kv = {"value": 0.1, "status": 200}

    page = _Page(lambda: (kv["status"], _kv_text(kv["value"])))
    session = RouterSession(None, {}, daemon.status, None, 5.0, 60.0)  # type: ignore[arg-type]
    frames = session.fs = _Frames()  # type: ignore[assignment]
    session.welcomed.set()

    async def router_pings() -> None:
        while True:
            session.last_rx = trio.current_time()
            await trio.sleep(0.5)

    def full() -> list[tuple[float, dict]]:
        return [(t, msg) for t, msg in frames.sent if "backend_healthy" in msg]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(router_pings)
        nursery.start_soon(daemon._engine_loop, ep, page)
        await trio.sleep(0.1)
        nursery.start_soon(session._keepalive)
        await trio.sleep(3.0)
        # Unchanged values: one heartbeat, re-sent each heartbeat period; it carries the
        # sample's own age and the period the agent vouches for the values.
        sent = full()
        assert len(sent) == 1
        assert sent[0][1]["engine"]["age"] < 0.5
        assert sent[0][1]["engine"]["interval"] == 5.0
        await trio.sleep(2.5)  # past the first heartbeat period
        assert len(full()) == 2

        changed_at = trio.current_time()
        kv["value"] = 0.95
        await trio.sleep(0.6)
        first = next(t for t, msg in full() if msg["engine"]["kv_cache_utilization"] == 0.95)
        assert first - changed_at <= 0.5 + 1e-6  # at the next sample, not the next 5 s beat

        # Scrapes failing: once the values are three sample periods old, they go out as
        # missing at once, not with the next heartbeat.
        kv["status"] = 500
        failing_from = trio.current_time()
        await trio.sleep(3.0)
        gone = [t for t, msg in full() if msg["engine"]["kv_cache_utilization"] is None]
        assert gone
        assert gone[0] - failing_from <= 4 * 0.5 + 1e-6
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "ollama"])
@pytest.mark.parametrize(
    "text",
    [
        VLLM_CURRENT_1,
        VLLM_OLDER_1,
        VLLM_TWO_MODELS,
        SGLANG_1,
        LLAMACPP_WITH_KV,
        LLAMACPP_CURRENT,
        # Typed families, a counter among them, and a line of the sampler's indented.
        "# HELP sglang_num_running_reqs Running.\n# TYPE sglang_num_running_reqs gauge\n"
        "  sglang_num_running_reqs 3\n# TYPE vllm:num_preemptions counter\n"
        "vllm:num_preemptions_total 4\nvllm:num_preemptions_created 1.7e9\n",
    ],
)
def test_the_sampler_reads_from_its_own_lines_what_the_whole_page_holds(
    engine: str, text: str
) -> None:
    """The sampler hands the parser only the lines of the samples it reads; the series
    it gets are those the whole page's parse gives (what it parsed before)."""
    sampler = get_adapter(engine).new_sampler(MODEL)
    whole: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sampler._wanted:
                whole.setdefault(sample.name, []).append((sample.labels, sample.value))
    assert sampler._collect(text) == {n: sampler._select(s) for n, s in whole.items()}
    assert sampler._lines.findall(text) or not whole


_FIXTURES = (
    VLLM_CURRENT_1,
    VLLM_CURRENT_2,
    VLLM_OLDER_1,
    VLLM_OLDER_2,
    VLLM_TWO_MODELS,
    SGLANG_1,
    SGLANG_2,
    LLAMACPP_WITH_KV,
    LLAMACPP_CURRENT,
)
# What a line of the format is made of, and what its edge cases are made of.
_LINE_PIECES = ' \t{}",=\\_#:.eE+-0123456789nNaIfa\x0c\r\u0661\uff15'


def _reading(read: Callable[[str], list], line: str) -> Any:
    """A line's samples, NaN and the int/float difference told apart; or the error."""
    try:
        return [(name, labels, type(value), repr(value)) for name, labels, value in read(line)]
    except (ValueError, TypeError, IndexError):
        return "refused"


def test_plain_sample_lines_read_as_prometheus_client_reads_them() -> None:
    """The fast reading of a plain line gives what prometheus_client gives, and every
    other line gets prometheus_client's own verdict: over the engines' lines, hand-made
    edge cases and 20,000 random mutations of both."""
    import random

    from agent.engines import sample_lines

    lines = [line for text in _FIXTURES for line in text.splitlines() if line[:1].isalpha()]
    # Every engine line here is plain: the fast reading is the one being compared.
    assert all(sample_lines._plain(line.strip()) for line in lines)
    lines += [
        'a{b="c",} 1',
        'a{b="c"d="e"} 1',
        'a{b="c",b="d"} 1',
        'a{__name__="a"} 1',
        'a{__x="1"} 1',
        "a{} 1",
        "a{,} 1",
        'a{b="x\\\\"} 1',
        'a{b="x\\"y"} 1',
        'a{b="\\n\\t"} 1',
        'a{b="}"} 1 1700000000000',
        "a 1 2 3",
        "a  1",
        "a\t1",
        "a 1_000",
        "a 0x10",
        "a +Inf",
        "a -inf",
        "a NaN",
        "a 1e999",
        "a 123456789012345678901234567890",
        "a \u0661\u0662",
        "a \x0c5",
        "a 5\x0c 7",
        'a 5 # {t="1"} 1',
        ' a{b="c"} 1 ',
        "a{b=c} 1",
        "1a 1",
    ]
    # Long hostile lines, each read in time linear in its length by both readings.
    hostile = [
        'a{b="' + '\\"' * 20_000 + "} 1",
        'a{b="' + "x" * 50_000 + " 1",
        "a{" + 'b="c",' * 5_000 + " 1",
        "a{" + ",".join(f'l{i}="v"' for i in range(2_000)) + "} 1",
        "a " + "1" * 50_000,
    ]
    rng = random.Random(26)
    for _ in range(20_000):
        line = list(rng.choice(lines))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(line) + 1)
            kind = rng.random()
            if kind < 0.4:
                line.insert(at, rng.choice(_LINE_PIECES))
            elif line and kind < 0.7:
                del line[min(at, len(line) - 1)]
            elif line:
                line[min(at, len(line) - 1)] = rng.choice(_LINE_PIECES)
        lines.append("".join(line))
    plain = 0
    for line in [*lines, *hostile]:
        assert _reading(sample_lines.read_sample, line) == _reading(sample_lines.read_page, line), (
            repr(line)
        )
        plain += sample_lines._plain(line.strip()) is not None
    assert plain > 1_500  # plenty of the mutations stayed plain: both readings compared


def test_a_page_without_a_line_of_the_sampler_s_is_parsed_whole() -> None:
    """A page that is not Prometheus text at all (a proxy's HTML) still fails the scrape,
    and one of other metrics only is read as holding none of the fields; a broken line
    of another metric no longer fails a page that has the sampler's."""
    sampler = get_adapter("vllm").new_sampler(MODEL)
    with pytest.raises(ValueError, match="malformed"):
        sampler.update('<html><a href="x">', now=0.0)
    assert sampler.update("other_metric 1\n", now=0.0) == dict.fromkeys(FIELDS)
    # A broken line of a metric the sampler does not read is not parsed at all.
    ours = f'vllm:num_requests_running{{model_name="{MODEL}"}} 3\n'
    assert sampler.update(ours + "other_metric{ 1\n", now=0.5)["running_requests"] == 3.0


async def test_a_metrics_url_the_agent_cannot_fetch_is_a_failing_scrape_not_a_stop(
    tmp_path: Path, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = _daemon(tmp_path, engine_sample_interval=0.5)
    ep = daemon.adapter.endpoints("http://engine:8000", None, "engine:8000/metrics")
    with trio.move_on_after(2.0) as scope:
        await daemon._engine_loop(ep)
    assert scope.cancelled_caught  # still scraping, not ended by the URL
    failed = [r.getMessage() for r in caplog.records if "engine_metrics_failed" in r.getMessage()]
    assert len(failed) == 1 and "not an http:// or https:// URL" in failed[0], failed
    assert daemon.status.engine is None or not any(daemon.status.engine.values())


def test_a_scrape_reads_only_the_lines_that_changed_and_forgets_past_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lines the sampler has read are not parsed again: the same page gives the same
    fields from the lines remembered; a malformed line is refused on every scrape; the
    memory is bounded."""
    from agent.engines import base

    sampler = get_adapter("vllm").new_sampler(MODEL)
    read: list[str] = []
    real = base.read_sample

    def counting(line: str) -> list:
        read.append(line)
        return real(line)

    monkeypatch.setattr(base, "read_sample", counting)
    # Beside it, one that reads every line of every page.
    reference = get_adapter("vllm").new_sampler(MODEL)
    reference._read = real  # type: ignore[method-assign]
    first = sampler.update(VLLM_CURRENT_1, now=0.0)
    parsed = len(read)
    assert parsed > 10
    assert first == reference.update(VLLM_CURRENT_1, now=0.0)
    read.clear()
    assert sampler.update(VLLM_CURRENT_1, now=0.5) == reference.update(VLLM_CURRENT_1, now=0.5)
    assert read == []
    # The second page's changed lines are read, and only those.
    assert sampler.update(VLLM_CURRENT_2, now=1.0) == reference.update(VLLM_CURRENT_2, now=1.0)
    assert 0 < len(read) < parsed
    broken = f'vllm:num_requests_running{{model_name="{MODEL}"}} 3 x y\n'
    for now in (1.5, 2.0):
        with pytest.raises(ValueError, match="malformed"):
            sampler.update(broken, now=now)
    monkeypatch.setattr(base, "PARSED_LINES", 8)
    for i in range(20):
        sampler.update(f'vllm:num_requests_running{{model_name="{MODEL}"}} {i}\n', now=3.0 + i)
        assert len(sampler._parsed) <= 8
