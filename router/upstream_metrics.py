"""`--metrics-compat upstream`: the Go router's series beside this router's own.

Dashboards and alerts written for upstream (its `deploy/grafana/` dashboards, the
PromQL of its metrics page) name `hivenet_*` series with upstream's labels and units.
With the flag, /metrics also carries them; without it none of them appears, and the
default names stay as INTERFACE.md sets them.

Nearly everything is computed at scrape time from what the router already keeps: its
own counters and histograms (renamed, `tenant` relabelled `tenant_id`), the agent table
(per-agent series with upstream's `organization`, `machine`, `region` labels; SRTT and
RTTVAR in milliseconds, CPU, memory and GPU use as percentages 0-100, the last heartbeat
in Unix milliseconds), the auth file's limits and the day's token counts. The request
path pays nothing for it when the flag is off. With the flag on, three things are
counted as they happen, because nothing else holds them: requests in flight per method
and route (`http_server_active_requests`), each tenant's last request, and provider call
durations (`http_client_request_duration_seconds`). The engines' own histograms, finish
reasons and llama.cpp throughputs come from the agents' heartbeats
(`engine.upstream`, router/agent_detail.py `upstream_of`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from router.http.client import ENDPOINTS
from router.peers import Peer, PeerTable

MODE = "upstream"
AGENT_LABELS = ("peer_id", "model", "engine", "organization", "machine", "region")
GPU_LABELS = (*AGENT_LABELS, "gpu_index", "gpu_id")
# This router's families renamed to upstream's: (ours, upstream's, kind).
_RENAMED = (
    ("hivenet_router_routing_requests_routed", "hivenet_routing_requests_routed", "counter"),
    ("hivenet_router_policy_primary_routed", "hivenet_policy_primary_routed", "counter"),
    ("hivenet_router_policy_fallback_routed", "hivenet_policy_fallback_routed", "counter"),
    ("hivenet_router_policy_provider_fallback", "hivenet_policy_provider_fallback", "counter"),
    ("hivenet_router_policy_exhausted", "hivenet_policy_exhausted", "counter"),
    ("hivenet_router_agent_connection_resets", "hivenet_agent_connection_resets", "counter"),
    ("hivenet_router_policy_reloads", "hivenet_policy_reload", "counter"),
    ("hivenet_router_queue_depth", "hivenet_queue_depth", "gauge"),
    ("hivenet_router_queue_wait_seconds", "hivenet_queue_wait_seconds", "histogram"),
    ("hivenet_router_admission_rejections", "hivenet_admission_rejections", "counter"),
    ("hivenet_router_admission_occupancy_tokens", "hivenet_admission_occupancy_tokens", "gauge"),
    ("hivenet_router_admission_budget_tokens", "hivenet_admission_budget_tokens", "gauge"),
    ("hivenet_router_admission_inflight_requests", "hivenet_admission_inflight_requests", "gauge"),
    ("hivenet_router_admission_max_inflight", "hivenet_admission_max_inflight", "gauge"),
)
# Labelled by model and tenant; shown at 0 for each served model before its first count.
_PER_MODEL = {ours for ours, _, kind in _RENAMED[:6] if kind == "counter"}
# Per-agent families of router/agent_metrics.py: (ours without the prefix, upstream's,
# factor, kind). The factor turns this router's unit into upstream's.
_AGENT = (
    ("requests_success", "hivenet_agent_requests_success", 1.0, "counter"),
    ("requests_failed", "hivenet_agent_requests_failed", 1.0, "counter"),
    ("input_tokens", "hivenet_agent_input_tokens", 1.0, "counter"),
    ("output_tokens", "hivenet_agent_output_tokens", 1.0, "counter"),
    ("rejected_requests", "hivenet_agent_rejected_requests", 1.0, "counter"),
    ("disconnections", "hivenet_agent_disconnections", 1.0, "counter"),
    ("failure", "hivenet_agent_failure", 1.0, "counter"),
    ("backend_failure", "hivenet_model_backend_failure", 1.0, "counter"),
    ("success_rate", "hivenet_agent_success_rate", 1.0, "gauge"),
    ("capacity_utilization", "hivenet_agent_capacity_utilization", 1.0, "gauge"),
    ("srtt_seconds", "hivenet_agent_srtt_ms", 1000.0, "gauge"),
    ("rttvar_seconds", "hivenet_agent_rttvar_ms", 1000.0, "gauge"),
    ("cpu_usage_percent", "hivenet_agent_cpu_usage_percent", 100.0, "gauge"),
    ("memory_used_percent", "hivenet_agent_memory_used_percent", 100.0, "gauge"),
    ("memory_total_bytes", "hivenet_agent_memory_total_bytes", 1.0, "gauge"),
    ("healthy", "hivenet_routing_agent_healthy", 1.0, "gauge"),
    ("last_seen_timestamp_seconds", "hivenet_routing_agent_last_seen_timestamp", 1000.0, "gauge"),
    ("kv_cache_utilization", "hivenet_agent_engine_kv_cache_utilization", 1.0, "gauge"),
    ("running_requests", "hivenet_agent_engine_running_requests", 1.0, "gauge"),
    ("waiting_requests", "hivenet_agent_engine_waiting_requests", 1.0, "gauge"),
    ("avg_ttft_seconds", "hivenet_agent_engine_avg_ttft_seconds", 1.0, "gauge"),
    ("p90_ttft_seconds", "hivenet_agent_engine_p90_ttft_seconds", 1.0, "gauge"),
    ("avg_itl_seconds", "hivenet_agent_engine_avg_itl_seconds", 1.0, "gauge"),
    ("p90_itl_seconds", "hivenet_agent_engine_p90_itl_seconds", 1.0, "gauge"),
    # Upstream exports the engine's cumulative value as a gauge (its metrics page says so).
    ("preemptions", "hivenet_agent_engine_preemptions_total", 1.0, "gauge"),
)
# Per-GPU values of the heartbeat: (field, upstream's name, factor). NVML's utilization
# is already 0-100 in the GPU records (agent/hardware.py).
_GPU = (
    ("util_percent", "hivenet_agent_gpu_utilization_percent", 1.0),
    ("vram_used_bytes", "hivenet_agent_gpu_vram_used_bytes", 1.0),
    ("vram_free_bytes", "hivenet_agent_gpu_vram_free_bytes", 1.0),
    ("vram_total_bytes", "hivenet_agent_gpu_vram_total_bytes", 1.0),
    ("temperature_c", "hivenet_agent_gpu_temperature_celsius", 1.0),
    ("power_watts", "hivenet_agent_gpu_power_watts", 1.0),
)
# Engine histograms the agents re-export (vLLM's), by upstream's name.
ENGINE_HISTOGRAMS = (
    "ttft_seconds",
    "itl_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
)
_PROVIDER_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass
class Activity:
    """What upstream's series need that nothing else keeps; moved only with the flag."""

    # (method, route) → requests in flight.
    active: dict[tuple[str, str], int] = field(default_factory=dict)
    # tenant → Unix time of its latest inference request.
    last_request: dict[str, float] = field(default_factory=dict)

    def saw(self, tenant: str) -> None:
        if tenant and tenant != "-":
            self.last_request[tenant] = time.time()


def counted(app: Any, activity: Activity) -> Any:
    """`app` with its HTTP requests in flight counted per method and route; the daemon
    wraps its app only with the flag, so without it no request passes here."""

    async def wrapped(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        key = (scope["method"], _route(scope["path"]))
        active = activity.active
        active[key] = active.get(key, 0) + 1
        try:
            await app(scope, receive, send)
        finally:
            active[key] -= 1

    return wrapped


def _route(path: str) -> str:
    """A bounded route label: clients choose paths, and each would be a series."""
    if path in ENDPOINTS or path in ("/v1/models", "/health"):
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/:model"
    if path.startswith("/admin/"):
        return "/admin/*"
    return "other"


class UpstreamCollector(Collector):
    """Upstream's series, computed from `sources` (this router's collectors), the agent
    table and the tenant gate at each scrape."""

    def __init__(
        self,
        registry: CollectorRegistry,
        sources: Iterable[Any],
        table: PeerTable,
        tenants: Callable[[], Any],
        activity: Activity,
    ) -> None:
        self.sources = list(sources)
        self.table = table
        self.tenants = tenants
        self.activity = activity
        self.provider_latency = Histogram(
            "http_client_request_duration_seconds",
            "Calls to external providers (fallback), by provider and status code",
            ["provider", "status_code"],
            buckets=_PROVIDER_BUCKETS,
            registry=registry,
        )
        registry.register(self)

    def observe_provider(self, provider: str, status: int, seconds: float) -> None:
        self.provider_latency.labels(provider, str(status)).observe(seconds)

    def describe(self) -> Iterable[Metric]:
        return []  # the families depend on what the sources hold at each scrape

    def collect(self) -> Iterator[Metric]:
        samples = _samples(self.sources)
        peers = {p.peer_id: p for p in self.table.all()}
        yield from self._renamed(samples)
        yield from self._agents(samples, peers)
        yield from self._engines(peers)
        yield from self._tenants(samples)
        yield from self._http(samples)

    # -- this router's own families, renamed ------------------------------------------

    def _renamed(self, samples: dict[str, list[tuple[str, dict, float]]]) -> Iterator[Metric]:
        models = sorted(self.table.models())
        for ours, theirs, kind in _RENAMED:
            rows = samples.get(ours, [])
            text = f"upstream's {theirs} ({ours})"
            if kind == "histogram":
                yield _histogram(theirs, text, rows, ours, _tenant_labels)
                continue
            picked = [
                (_tenant_labels(labels), value)
                for name, labels, value in rows
                if not name.endswith("_created")
            ]
            if ours in _PER_MODEL:
                # A served model's counters exist from its first agent on, at 0, so
                # that upstream's dashboards and alerts find them before any traffic.
                counted = {labels.get("model") for labels, _ in picked}
                picked += [
                    ({"model": model, "tenant_id": ""}, 0.0)
                    for model in models
                    if model not in counted
                ]
            if theirs == "hivenet_routing_requests_routed":
                picked = [({**labels, "region": "", "engine": ""}, v) for labels, v in picked]
            names = list(picked[0][0]) if picked else []
            family = _family(kind, theirs, text, names)
            for labels, value in picked:
                family.add_metric([labels[n] for n in names], value)
            yield family
        failed = CounterMetricFamily(
            "hivenet_routing_requests_failed",
            "Inference requests the router could not forward successfully (its chain"
            " exhausted with no provider after it)",
            labels=["model", "tenant_id", "region", "engine"],
        )
        for name, labels, value in samples.get("hivenet_router_policy_exhausted", []):
            if name.endswith("_total"):
                failed.add_metric(
                    [labels.get("model", ""), labels.get("tenant", ""), "", ""], value
                )
        yield failed

    # -- the agent table ---------------------------------------------------------------

    def _agents(
        self, samples: dict[str, list[tuple[str, dict, float]]], peers: dict[str, Peer]
    ) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "hivenet_routing_agent_info",
            "1 while the agent is registered, its metadata as labels",
            labels=["peer_id", "region", "engine", "model", "capacity", "organization", "machine"],
        )
        for peer in peers.values():
            md = peer.metadata
            info.add_metric(
                [
                    peer.peer_id,
                    md.region,
                    md.engine,
                    md.model,
                    str(md.capacity),
                    md.organization,
                    md.machine,
                ],
                1.0,
            )
        yield info
        for ours, theirs, factor, kind in _AGENT:
            family = _family(kind, theirs, f"upstream's {theirs}", AGENT_LABELS)
            for name, labels, value in samples.get("hivenet_router_agent_" + ours, []):
                if name.endswith("_created"):
                    continue
                peer = peers.get(labels.get("peer_id", ""))
                if peer is not None:
                    family.add_metric(_agent_labels(peer), value * factor)
            yield family
        available = GaugeMetricFamily(
            "hivenet_agent_memory_available_bytes",
            "Host memory available, bytes",
            labels=AGENT_LABELS,
        )
        gpus = {
            theirs: GaugeMetricFamily(theirs, f"upstream's {theirs}", labels=GPU_LABELS)
            for _, theirs, _ in _GPU
        }
        fresh = {
            labels["peer_id"]
            for _, labels, _ in samples.get("hivenet_router_agent_memory_total_bytes", [])
        }
        fresh |= {
            labels["peer_id"]
            for _, labels, _ in samples.get("hivenet_router_agent_gpu_vram_total_bytes", [])
        }
        for peer_id in sorted(fresh):
            peer = peers.get(peer_id)
            if peer is None:
                continue
            labels = _agent_labels(peer)
            memory = peer.memory
            free = memory.get("memory_available_bytes")
            if free is None and memory.get("memory_total_bytes") is not None:
                free = memory["memory_total_bytes"] - (memory.get("memory_used_bytes") or 0.0)
            if free is not None:
                available.add_metric(labels, free)
            for gpu in peer.gpus:
                values = dict(gpu.values)
                if values.get("vram_free_bytes") is None and values.get("vram_total_bytes"):
                    values["vram_free_bytes"] = values["vram_total_bytes"] - (
                        values.get("vram_used_bytes") or 0.0
                    )
                for field_name, theirs, factor in _GPU:
                    value = values.get(field_name)
                    if value is not None:
                        gpus[theirs].add_metric([*labels, str(gpu.index), ""], value * factor)
        yield available
        yield from gpus.values()

    def _engines(self, peers: dict[str, Peer]) -> Iterator[Metric]:
        histograms = {
            name: HistogramMetricFamily(
                "hivenet_agent_engine_" + name,
                f"The engine's own {name} histogram, as the agent last read it",
                labels=AGENT_LABELS,
            )
            for name in ENGINE_HISTOGRAMS
        }
        reasons = GaugeMetricFamily(
            "hivenet_agent_engine_request_success_total",
            "Requests the engine finished, by finish reason (the engine's cumulative value)",
            labels=[*AGENT_LABELS, "finished_reason"],
        )
        tps = {
            name: GaugeMetricFamily(
                "hivenet_agent_engine_" + name,
                f"llama.cpp's latest {name.replace('_', ' ')} (tokens per second)",
                labels=AGENT_LABELS,
            )
            for name in ("predicted_tps", "prompt_tps")
        }
        for peer in peers.values():
            extra = peer.engine_upstream
            if not extra:
                continue
            labels = _agent_labels(peer)
            for name, (buckets, total) in extra.get("histograms", {}).items():
                histograms[name].add_metric(
                    labels, [(_bound(le), count) for le, count in buckets], total
                )
            for reason, count in extra.get("finish_reasons", {}).items():
                reasons.add_metric([*labels, reason], count)
            for name, family in tps.items():
                if extra.get(name) is not None:
                    family.add_metric(labels, extra[name])
        yield from histograms.values()
        yield reasons
        yield from tps.values()

    # -- tenants -----------------------------------------------------------------------

    def _tenants(self, samples: dict[str, list[tuple[str, dict, float]]]) -> Iterator[Metric]:
        gate = self.tenants()
        config = gate.config if gate is not None else None
        tenants = list(config.tenants.values()) if config is not None else []
        rpm = GaugeMetricFamily(
            "hivenet_tenant_quota_rpm_limit",
            "Requests per minute allowed (0: unlimited)",
            labels=["tenant_id"],
        )
        tpd = GaugeMetricFamily(
            "hivenet_tenant_quota_tpd_limit",
            "Tokens per UTC day allowed (0: unlimited)",
            labels=["tenant_id"],
        )
        model_rpm = GaugeMetricFamily(
            "hivenet_tenant_per_model_quota_rpm_limit",
            "Requests per minute per healthy replica for one model",
            labels=["tenant_id", "model"],
        )
        model_tpd = GaugeMetricFamily(
            "hivenet_tenant_per_model_quota_tpd_limit",
            "Tokens per UTC day for one model",
            labels=["tenant_id", "model"],
        )
        used = GaugeMetricFamily(
            "hivenet_tenant_tokens_used_today",
            "Tokens counted today (UTC) by this router",
            labels=["tenant_id"],
        )
        for tenant in tenants:
            rpm.add_metric([tenant.name], tenant.requests_per_minute)
            tpd.add_metric([tenant.name], tenant.tokens_per_day)
            used.add_metric([tenant.name], gate.state.local.used_today(tenant.name))
            for model, per_replica, tokens in tenant.per_model:
                model_rpm.add_metric([tenant.name, model], per_replica)
                model_tpd.add_metric([tenant.name, model], tokens)
        yield from (rpm, tpd, model_rpm, model_tpd, used)
        names = [t.name for t in tenants]
        yield from self._tenant_counts(samples, names)

    def _tenant_counts(
        self, samples: dict[str, list[tuple[str, dict, float]]], names: list[str]
    ) -> Iterator[Metric]:
        success = CounterMetricFamily(
            "hivenet_tenant_requests_success",
            "Requests served (by an agent or the provider), by tenant and model",
            labels=["tenant_id", "key_id", "deployment_id", "model"],
        )
        served: dict[tuple[str, str], float] = {}
        for family in (
            "hivenet_router_routing_requests_routed",
            "hivenet_router_policy_provider_fallback",
        ):
            for name, labels, value in samples.get(family, []):
                if name.endswith("_total"):
                    key = (labels.get("tenant", ""), labels.get("model", ""))
                    served[key] = served.get(key, 0.0) + value
        for (tenant, model), value in sorted(served.items()):
            success.add_metric([tenant, "", "", model], value)
        yield success
        failed: dict[str, float] = {}
        for name, labels, value in samples.get("hivenet_router_http_requests", []):
            error = labels.get("status", "0") >= "400"  # three-digit statuses
            if name.endswith("_total") and labels.get("endpoint") in ENDPOINTS and error:
                tenant = labels.get("tenant", "")
                failed[tenant] = failed.get(tenant, 0.0) + value
        failures = CounterMetricFamily(
            "hivenet_tenant_requests_failed",
            "Inference requests answered with an error, by tenant (model not kept: empty)",
            labels=["tenant_id", "key_id", "deployment_id", "model"],
        )
        for tenant, value in sorted(failed.items()):
            failures.add_metric([tenant, "", "", ""], value)
        yield failures
        refused: dict[tuple[str, str], float] = {}
        for name, labels, value in samples.get("hivenet_router_tenant_rejections", []):
            if name.endswith("_total"):
                key = (labels.get("tenant", ""), labels.get("code", ""))
                refused[key] = refused.get(key, 0.0) + value
        for theirs, code in (
            ("hivenet_tenant_rate_limited", "rate_limit_exceeded"),
            ("hivenet_tenant_token_limited", "token_limit_exceeded"),
        ):
            family = CounterMetricFamily(
                theirs, f"Requests refused with {code}", labels=["tenant_id"]
            )
            seen = sorted({t for t, _ in refused} | set(names))
            for tenant in seen:
                family.add_metric([tenant], refused.get((tenant, code), 0.0))
            yield family
        tokens = {
            kind: CounterMetricFamily(
                f"hivenet_tenant_{kind}_tokens",
                f"{kind.capitalize()} tokens the engines reported, by tenant (model: empty)",
                labels=["tenant_id", "key_id", "deployment_id", "model"],
            )
            for kind in ("input", "output")
        }
        for name, labels, value in samples.get("hivenet_router_tenant_tokens", []):
            if name.endswith("_total"):
                kind = "input" if labels.get("kind") == "prompt" else "output"
                tokens[kind].add_metric([labels.get("tenant", ""), "", "", ""], value)
        yield from tokens.values()
        last = GaugeMetricFamily(
            "hivenet_tenant_last_request_timestamp",
            "Unix time of the tenant's latest request (seconds)",
            labels=["tenant_id", "key_id", "deployment_id"],
        )
        for tenant, when in sorted(self.activity.last_request.items()):
            last.add_metric([tenant, "", ""], when)
        yield last
        yield _histogram(
            "hivenet_tenant_request_duration_seconds",
            "Whole inference request time by tenant (model: empty)",
            [
                row
                for row in samples.get("hivenet_router_request_duration_seconds", [])
                if row[1].get("endpoint") in ENDPOINTS
            ],
            "hivenet_router_request_duration_seconds",
            lambda labels: {"tenant_id": labels.get("tenant", ""), "model": ""},
        )

    # -- HTTP --------------------------------------------------------------------------

    def _http(self, samples: dict[str, list[tuple[str, dict, float]]]) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            "http_server_active_requests",
            "Requests in flight on the client API",
            labels=["method", "route"],
        )
        for (method, route), count in sorted(self.activity.active.items()):
            active.add_metric([method, route], count)
        yield active
        yield _histogram(
            "http_server_request_duration_seconds",
            "Client request time by route",
            samples.get("hivenet_router_request_duration_seconds", []),
            "hivenet_router_request_duration_seconds",
            lambda labels: {"method": "POST", "route": labels.get("endpoint", "")},
        )


def _samples(sources: Iterable[Any]) -> dict[str, list[tuple[str, dict, float]]]:
    """Every sample of `sources` as (sample name, labels, value), by family name."""
    out: dict[str, list[tuple[str, dict, float]]] = {}
    for source in sources:
        for family in source.collect():
            rows = out.setdefault(family.name, [])
            rows.extend((s.name, s.labels, s.value) for s in family.samples)
    return out


def _family(kind: str, name: str, text: str, labels: Iterable[str]) -> Metric:
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(name, text, labels=list(labels))


def _tenant_labels(labels: dict[str, str]) -> dict[str, str]:
    return {("tenant_id" if k == "tenant" else k): v for k, v in labels.items()}


def _agent_labels(peer: Peer) -> list[str]:
    md = peer.metadata
    return [peer.peer_id, md.model, md.engine, md.organization, md.machine, md.region]


def _bound(le: float) -> str:
    return "+Inf" if le == float("inf") else repr(float(le))


def _histogram(
    name: str,
    text: str,
    rows: list[tuple[str, dict, float]],
    ours: str,
    relabel: Callable[[dict[str, str]], dict[str, str]],
) -> Metric:
    """A histogram of `rows` (our family `ours`) under `name`, relabelled; series that
    fall on one label set after relabelling are summed (same bounds: one family)."""
    series: dict[tuple, dict[str, Any]] = {}
    for sample, labels, value in rows:
        base = {k: v for k, v in labels.items() if k != "le"}
        key = tuple(sorted(relabel(base).items()))
        entry = series.setdefault(key, {"buckets": {}, "sum": 0.0})
        if sample == ours + "_bucket":
            le = labels["le"]
            entry["buckets"][le] = entry["buckets"].get(le, 0.0) + value
        elif sample == ours + "_sum":
            entry["sum"] += value
    label_names = [k for k, _ in next(iter(series))] if series else []
    family = HistogramMetricFamily(name, text, labels=label_names)
    for key, entry in series.items():
        buckets = sorted(entry["buckets"].items(), key=lambda kv: float(kv[0]))
        family.add_metric([v for _, v in key], buckets, entry["sum"])
    return family
