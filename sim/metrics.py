"""The engine's counters and histograms, rendered as `/metrics` under an engine's names.

`vllm` (the default): the names, help texts, labels and bucket bounds of vLLM v1, so
the agent's vLLM adapter reads the sim as it reads vLLM and P90s read from it look like
a real engine's. `sglang`: SGLang's names (`--enable-metrics`), labelled by
`model_name` as SGLang labels them. `llamacpp`: `llama-server --metrics`' names, no
labels, no histograms (its decode time and tokens are counters), and no KV-cache ratio
(current releases dropped it). Ollama has no metrics page. The agent's adapters for
those engines read each from its names alone (agent/engines/).
"""

from __future__ import annotations

import bisect

METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
# The engines the sim can pass for (`python -m sim --kind`); vLLM's API is the default.
KINDS = ("vllm", "sglang", "llamacpp", "ollama")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


class Histogram:
    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.count = 0
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le is inclusive).
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.count += times
        self.total += value * times

    def render(self, name: str, labels: str, out: list[str]) -> None:
        cumulative = 0
        for bound, count in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            cumulative += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(cumulative)}')
        out.append(f"{name}_count{{{labels}}} {float(self.count)}")
        out.append(f"{name}_sum{{{labels}}} {self.total!r}")


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class EngineMetrics:
    """What one engine has done since it started; the gauges come from its scheduler."""

    __slots__ = (
        "generation_tokens",
        "itl",
        "kind",
        "labels",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "prompt_tokens",
        "ttft",
    )

    def __init__(self, model: str, kind: str = "vllm") -> None:
        self.kind = kind
        self.labels = f'model_name="{escape_label(model)}"'
        if kind == "vllm":
            self.labels = f'engine="0",{self.labels}'
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # In tokens, as vLLM counts them: prompt tokens looked up, and those found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def render(self, running: int, waiting: int, kv_cache_usage: float) -> str:
        if self.kind == "sglang":
            return self._render_sglang(running, waiting, kv_cache_usage)
        if self.kind == "llamacpp":
            return self._render_llamacpp(running, waiting)
        return self._render_vllm(running, waiting, kv_cache_usage)

    def _render_vllm(self, running: int, waiting: int, kv_cache_usage: float) -> str:
        labels = self.labels
        out = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {float(kv_cache_usage)!r}",
            # The simulator never preempts a request: its KV cache is not modelled per block.
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{labels}}} 0.0",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(self.prompt_tokens)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(self.generation_tokens)}",
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number "
            "of queried tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(self.prefix_cache_queries)}",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of "
            "cached tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} {float(self.prefix_cache_hits)}",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
        ]
        self.ttft.render("vllm:time_to_first_token_seconds", labels, out)
        out += [
            "# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.",
            "# TYPE vllm:inter_token_latency_seconds histogram",
        ]
        self.itl.render("vllm:inter_token_latency_seconds", labels, out)
        out.append("")
        return "\n".join(out)

    def _render_sglang(self, running: int, waiting: int, kv_cache_usage: float) -> str:
        labels = self.labels
        out = [
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{{{labels}}} {float(running)}",
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
            "# TYPE sglang:num_queue_reqs gauge",
            f"sglang:num_queue_reqs{{{labels}}} {float(waiting)}",
            "# HELP sglang:token_usage The token usage.",
            "# TYPE sglang:token_usage gauge",
            f"sglang:token_usage{{{labels}}} {float(kv_cache_usage)!r}",
            "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE sglang:prompt_tokens_total counter",
            f"sglang:prompt_tokens_total{{{labels}}} {float(self.prompt_tokens)}",
            "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
            "# TYPE sglang:generation_tokens_total counter",
            f"sglang:generation_tokens_total{{{labels}}} {float(self.generation_tokens)}",
            "# HELP sglang:time_to_first_token_seconds Histogram of time to first token in "
            "seconds.",
            "# TYPE sglang:time_to_first_token_seconds histogram",
        ]
        self.ttft.render("sglang:time_to_first_token_seconds", labels, out)
        out += [
            "# HELP sglang:inter_token_latency_seconds Histogram of inter-token latency in "
            "seconds.",
            "# TYPE sglang:inter_token_latency_seconds histogram",
        ]
        self.itl.render("sglang:inter_token_latency_seconds", labels, out)
        out.append("")
        return "\n".join(out)

    def _render_llamacpp(self, running: int, waiting: int) -> str:
        # llama-server adds a request's decode time and tokens as it ends; the sim adds
        # them token by token, which the agent's per-window average reads the same way.
        decode_seconds = self.itl.total
        prompt_seconds = self.ttft.total
        throughput = _rate(self.generation_tokens, decode_seconds)
        return "\n".join(
            [
                "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.",
                "# TYPE llamacpp:prompt_tokens_total counter",
                f"llamacpp:prompt_tokens_total {self.prompt_tokens}",
                "# HELP llamacpp:prompt_seconds_total Prompt process time",
                "# TYPE llamacpp:prompt_seconds_total counter",
                f"llamacpp:prompt_seconds_total {prompt_seconds:f}",
                "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.",
                "# TYPE llamacpp:tokens_predicted_total counter",
                f"llamacpp:tokens_predicted_total {self.generation_tokens}",
                "# HELP llamacpp:tokens_predicted_seconds_total Predict process time",
                "# TYPE llamacpp:tokens_predicted_seconds_total counter",
                f"llamacpp:tokens_predicted_seconds_total {decode_seconds:f}",
                "# HELP llamacpp:predicted_tokens_seconds Average generation throughput in "
                "tokens/s.",
                "# TYPE llamacpp:predicted_tokens_seconds gauge",
                f"llamacpp:predicted_tokens_seconds {throughput:f}",
                "# HELP llamacpp:requests_processing Number of requests processing.",
                "# TYPE llamacpp:requests_processing gauge",
                f"llamacpp:requests_processing {running}",
                "# HELP llamacpp:requests_deferred Number of requests deferred.",
                "# TYPE llamacpp:requests_deferred gauge",
                f"llamacpp:requests_deferred {waiting}",
                "",
            ]
        )


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0
