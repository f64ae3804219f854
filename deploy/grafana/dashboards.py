"""The three Grafana dashboards, written as data and rendered to deploy/grafana/dashboards/.

`python deploy/grafana/dashboards.py` rewrites the JSON files; `--markdown` prints the
panel list that docs/observability.md shows. tests/test_deploy.py checks that the JSON
is what this file renders, that promtool parses every expression, and that each metric
an expression names is one a running router exports. Panels hold PromQL only: Grafana
variables (`$model`, `$tenant`, …) filter by the router's own labels.

A panel is written once as a `Panel`; rows lay panels out left to right in a 24-column
grid, so adding one never means editing coordinates.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "hivenet-prometheus"}
ROUTER = 'job="hivenet-router"'
# Grafana 11.2, the image deploy/compose.yaml runs.
SCHEMA_VERSION = 39


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str
    targets: tuple[Target, ...]
    unit: str = "short"
    width: int = 8
    height: int = 8
    description: str = ""
    max: float | None = None
    text: str = ""
    stack: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    name: str
    label: str
    query: str


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = field(default=("hivenet-router",))


def t(expr: str, legend: str = "", instant: bool = False) -> Target:
    return Target(" ".join(expr.split()), legend, instant)


def stat(title: str, expr: str, unit: str = "short", description: str = "") -> Panel:
    return Panel(title, "stat", (t(expr),), unit, width=4, height=4, description=description)


def series(title: str, *targets: Target, unit: str = "short", **kw: Any) -> Panel:
    return Panel(title, "timeseries", targets, unit, **kw)


def quantiles(metric: str, by: str, selector: str, qs: tuple[float, ...]) -> tuple[Target, ...]:
    legend = "{{" + by + "}} " if by else ""
    return tuple(
        t(
            f"histogram_quantile({q}, sum by (le{', ' + by if by else ''}) "
            f"(rate({metric}_bucket{{{selector}}}[$__rate_interval])))",
            f"{legend}p{round(q * 100)}",
        )
        for q in qs
    )


def rate(metric: str, selector: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[$__rate_interval]))"


def agent_gauge(field_name: str) -> str:
    return f'hivenet_router_agent_{field_name}{{model=~"$model", peer_id=~"$peer_id"}}'


AGENT_LEGEND = "{{model}} {{peer_id}}"
M = 'model=~"$model"'
MT = 'model=~"$model", tenant=~"$tenant"'
T = 'tenant=~"$tenant"'

FLEET = Dashboard(
    uid="hivenet-fleet",
    title="Hivenet Router: fleet and routing",
    description="Agents, routing paths, latency, engines and hardware, per model and agent",
    variables=(
        Variable("model", "Model", "label_values(hivenet_router_agent_capacity, model)"),
        Variable(
            "peer_id",
            "Agent",
            'label_values(hivenet_router_agent_capacity{model=~"$model"}, peer_id)',
        ),
    ),
    rows=(
        Row(
            "Fleet",
            (
                stat("Agents connected", "hivenet_router_agents_connected"),
                stat("Agents healthy", "hivenet_router_agents_healthy"),
                stat(
                    "Healthy agents of $model",
                    f"sum(hivenet_router_agent_healthy{{{M}}}) or vector(0)",
                ),
                stat(
                    "Routed requests/s",
                    f"sum(rate(hivenet_router_routing_requests_routed_total{{{M}}}"
                    "[$__rate_interval])) or vector(0)",
                    "reqps",
                ),
                stat(
                    "Client 5xx share",
                    '(sum(rate(hivenet_router_http_requests_total{status=~"5.."}'
                    "[$__rate_interval])) or vector(0)) / "
                    "sum(rate(hivenet_router_http_requests_total[$__rate_interval]))",
                    "percentunit",
                    "Answers with a 5xx over all client answers",
                ),
                stat(
                    "Fleet capacity in use",
                    f"sum(hivenet_router_agent_active_requests{{{M}}}) / "
                    f"sum(hivenet_router_agent_capacity{{{M}}})",
                    "percentunit",
                    "In-flight requests over the agents' declared capacity",
                ),
            ),
        ),
        Row(
            "Routing",
            (
                series(
                    "Requests by routing path",
                    t(
                        rate("hivenet_router_policy_primary_routed_total", M, "model"),
                        "{{model}} primary",
                    ),
                    t(
                        rate("hivenet_router_policy_fallback_routed_total", M, "model"),
                        "{{model}} fallback step",
                    ),
                    t(
                        rate("hivenet_router_policy_provider_fallback_total", M, "model"),
                        "{{model}} provider",
                    ),
                    t(
                        rate("hivenet_router_policy_exhausted_total", M, "model"),
                        "{{model}} exhausted",
                    ),
                    unit="reqps",
                    description="A rising fallback or provider share means the primary step drains",
                ),
                series(
                    "Forward failures by code",
                    t(
                        rate("hivenet_router_forward_failures_total", M, "model, code"),
                        "{{model}} {{code}}",
                    ),
                    unit="reqps",
                ),
                series(
                    "Agent connection resets",
                    t(
                        f"sum by (model) (increase(hivenet_router_agent_connection_resets_total"
                        f"{{{M}}}[$__rate_interval]))",
                        "{{model}}",
                    ),
                    description="Stale agent connections discarded: agents reconnecting",
                ),
                series(
                    "Broken streams, by what followed",
                    t(
                        rate("hivenet_router_stream_continuations_total", M, "model, outcome"),
                        "{{model}} {{outcome}}",
                    ),
                    unit="reqps",
                    description="continued: spliced on another agent; unsupported, no_agent: "
                    "ended with the error event",
                ),
                stat(
                    "Primary, this range",
                    f"sum(increase(hivenet_router_policy_primary_routed_total{{{M}}}"
                    "[$__range])) or vector(0)",
                ),
                stat(
                    "Fallback step, this range",
                    f"sum(increase(hivenet_router_policy_fallback_routed_total{{{M}}}"
                    "[$__range])) or vector(0)",
                ),
                stat(
                    "Provider, this range",
                    f"sum(increase(hivenet_router_policy_provider_fallback_total{{{M}}}"
                    "[$__range])) or vector(0)",
                ),
                stat(
                    "Exhausted, this range",
                    f"sum(increase(hivenet_router_policy_exhausted_total{{{M}}}"
                    "[$__range])) or vector(0)",
                    description="No local agent and no provider: the client got a 503",
                ),
                stat(
                    "Shed, this range",
                    f"sum(increase(hivenet_router_policy_shed_total{{{M}}}"
                    "[$__range])) or vector(0)",
                ),
                stat(
                    "Agent hellos refused, this range",
                    "sum(increase(hivenet_router_agent_sessions_refused_total[$__range]))"
                    " or vector(0)",
                ),
            ),
        ),
        Row(
            "Latency and capacity queue",
            (
                series(
                    "Client request duration",
                    *quantiles(
                        "hivenet_router_request_duration_seconds", "endpoint", "", (0.5, 0.95, 0.99)
                    ),
                    unit="s",
                    description="First byte read to last byte sent, engine time included",
                ),
                series(
                    "Router overhead",
                    *quantiles(
                        "hivenet_router_router_overhead_seconds", "endpoint", "", (0.5, 0.99)
                    ),
                    unit="s",
                    description="Arrival to the forward written to the agent: parsing, "
                    "keys, gates, queue wait, failed tries",
                ),
                series(
                    "Capacity queue",
                    t(f"hivenet_router_queue_depth{{{M}}}", "{{model}} waiting"),
                    *quantiles("hivenet_router_queue_wait_seconds", "model", M, (0.95,)),
                    description="Requests waiting for a free agent slot, and their p95 wait (s)",
                ),
            ),
        ),
        Row(
            "Agents",
            (
                Panel(
                    "Routing table",
                    "table",
                    tuple(
                        Target(agent_gauge(name), name, instant=True)
                        for name in (
                            "healthy",
                            "backend_healthy",
                            "active_requests",
                            "capacity",
                            "capacity_utilization",
                            "success_rate",
                            "srtt_seconds",
                            "consecutive_failures",
                        )
                    ),
                    width=24,
                    description="One row per agent, the values the policy gates see",
                ),
                series(
                    "Capacity utilization",
                    t(agent_gauge("capacity_utilization"), AGENT_LEGEND),
                    unit="percentunit",
                    max=1,
                ),
                series(
                    "Success rate",
                    t(agent_gauge("success_rate"), AGENT_LEGEND),
                    unit="percentunit",
                    max=1,
                ),
                series(
                    "SRTT",
                    t(agent_gauge("srtt_seconds"), AGENT_LEGEND),
                    unit="s",
                    description="Smoothed time to the response head (RFC 6298)",
                ),
            ),
        ),
        Row(
            "Agent history",
            (
                Panel(
                    "Agents",
                    "table",
                    (
                        Target(agent_gauge("info"), "info", instant=True),
                        Target(
                            f"time() - {agent_gauge('last_seen_timestamp_seconds')}",
                            "seconds since last seen",
                            instant=True,
                        ),
                    ),
                    width=24,
                    description="Metadata labels (deployment and replica ids) and "
                    "time since the latest heartbeat",
                ),
                series(
                    "Lifetime requests",
                    t(agent_gauge("requests_success_total"), AGENT_LEGEND + " ok"),
                    t(agent_gauge("requests_failed_total"), AGENT_LEGEND + " failed"),
                    t(agent_gauge("rejected_requests_total"), AGENT_LEGEND + " rejected"),
                    description="Kept across router restarts; POST /admin/metrics/reset "
                    "zeroes them",
                ),
                series(
                    "Lifetime tokens",
                    t(agent_gauge("input_tokens_total"), AGENT_LEGEND + " input"),
                    t(agent_gauge("output_tokens_total"), AGENT_LEGEND + " output"),
                    description="As the engines reported them",
                ),
                series(
                    "Disconnections and RTTVAR",
                    t(agent_gauge("disconnections_total"), AGENT_LEGEND + " disconnections"),
                    t(agent_gauge("rttvar_seconds"), AGENT_LEGEND + " rttvar s"),
                ),
                series(
                    "Lifetime agent and backend failures",
                    t(agent_gauge("failure_total"), AGENT_LEGEND + " silent past unhealthy-after"),
                    t(agent_gauge("backend_failure_total"), AGENT_LEGEND + " engine unhealthy"),
                    description="Each fall counted once; kept across router restarts",
                ),
            ),
        ),
        Row(
            "Engines",
            (
                series(
                    "KV cache",
                    t(agent_gauge("kv_cache_utilization"), AGENT_LEGEND),
                    unit="percentunit",
                    max=1,
                ),
                series(
                    "Running and waiting requests",
                    t(agent_gauge("running_requests"), AGENT_LEGEND + " running"),
                    t(agent_gauge("waiting_requests"), AGENT_LEGEND + " waiting"),
                ),
                series(
                    "Time to first token",
                    t(agent_gauge("avg_ttft_seconds"), AGENT_LEGEND + " avg"),
                    t(agent_gauge("p90_ttft_seconds"), AGENT_LEGEND + " p90"),
                    unit="s",
                ),
                series(
                    "Inter-token latency",
                    t(agent_gauge("avg_itl_seconds"), AGENT_LEGEND + " avg"),
                    t(agent_gauge("p90_itl_seconds"), AGENT_LEGEND + " p90"),
                    unit="s",
                ),
                series(
                    "Metrics age",
                    t(agent_gauge("engine_age_seconds"), AGENT_LEGEND + " engine"),
                    t(agent_gauge("hardware_age_seconds"), AGENT_LEGEND + " hardware"),
                    unit="s",
                    description="Older than three sample periods: the gates treat the "
                    "value as missing",
                ),
                series(
                    "Preemptions",
                    t(
                        f"rate({agent_gauge('preemptions_total')}[$__rate_interval])",
                        AGENT_LEGEND,
                    ),
                    unit="reqps",
                    description="Requests the engine preempted for lack of KV cache (vLLM)",
                ),
            ),
        ),
        Row(
            "Hardware",
            (
                series(
                    "GPU temperature",
                    t(agent_gauge("gpu_temperature_c"), AGENT_LEGEND),
                    unit="celsius",
                ),
                series(
                    "GPU utilization",
                    t(agent_gauge("gpu_util_percent"), AGENT_LEGEND),
                    unit="percentunit",
                    max=1,
                ),
                series(
                    "GPU VRAM used",
                    t(agent_gauge("gpu_vram_used_percent"), AGENT_LEGEND),
                    unit="percentunit",
                    max=1,
                ),
                series(
                    "CPU",
                    t(agent_gauge("cpu_usage_percent"), AGENT_LEGEND),
                    unit="percentunit",
                    max=1,
                ),
                series(
                    "Memory used",
                    t(agent_gauge("memory_used_percent"), AGENT_LEGEND),
                    unit="percentunit",
                    max=1,
                ),
                series(
                    "GPU power",
                    t(agent_gauge("gpu_power_watts"), AGENT_LEGEND + " gpu {{gpu_index}}"),
                    unit="watt",
                ),
                series(
                    "GPU VRAM bytes",
                    t(agent_gauge("gpu_vram_used_bytes"), AGENT_LEGEND + " gpu {{gpu_index}} used"),
                    t(
                        agent_gauge("gpu_vram_total_bytes"),
                        AGENT_LEGEND + " gpu {{gpu_index}} total",
                    ),
                    unit="bytes",
                ),
                series(
                    "Host memory bytes",
                    t(agent_gauge("memory_used_bytes"), AGENT_LEGEND + " used"),
                    t(agent_gauge("memory_total_bytes"), AGENT_LEGEND + " total"),
                    unit="bytes",
                ),
            ),
        ),
        Row(
            "Router process",
            (
                series(
                    "CPU",
                    t(
                        f"rate(process_cpu_seconds_total{{{ROUTER}}}[$__rate_interval])",
                        "{{instance}}",
                    ),
                    unit="percentunit",
                    width=6,
                ),
                series(
                    "Resident memory",
                    t(f"process_resident_memory_bytes{{{ROUTER}}}", "{{instance}}"),
                    unit="bytes",
                    width=6,
                ),
                series(
                    "Open file descriptors",
                    t(f"process_open_fds{{{ROUTER}}}", "{{instance}}"),
                    width=6,
                ),
                series(
                    "Trio tasks",
                    t(f"hivenet_router_trio_tasks{{{ROUTER}}}", "{{instance}}"),
                    width=6,
                    description="Should follow the agents and requests in flight; a "
                    "steady climb is a leak",
                ),
            ),
        ),
    ),
)

TENANTS = Dashboard(
    uid="hivenet-tenants",
    title="Hivenet Router: tenants and admission",
    description="Traffic, tokens and refusals per tenant; load shedding and the capacity queue",
    variables=(
        Variable("tenant", "Tenant", "label_values(hivenet_router_http_requests_total, tenant)"),
        Variable(
            "model", "Model", "label_values(hivenet_router_routing_requests_routed_total, model)"
        ),
    ),
    rows=(
        Row(
            "Tenants",
            (
                stat(
                    "Requests/s",
                    f"sum(rate(hivenet_router_http_requests_total{{{T}}}"
                    "[$__rate_interval])) or vector(0)",
                    "reqps",
                ),
                stat(
                    "Tenant-limit refusals/s",
                    f"sum(rate(hivenet_router_tenant_rejections_total{{{T}}}"
                    "[$__rate_interval])) or vector(0)",
                    "reqps",
                    "Refused by the auth file's limits (rate, concurrency, tokens, models)",
                ),
                stat(
                    "Shed/s",
                    f"sum(rate(hivenet_router_policy_shed_total{{{MT}}}"
                    "[$__rate_interval])) or vector(0)",
                    "reqps",
                ),
                stat(
                    "Tokens, this range",
                    f"sum(increase(hivenet_router_tenant_tokens_total{{{T}}}[$__range]))"
                    " or vector(0)",
                ),
                stat(
                    "Shared state store",
                    "min(hivenet_router_state_store_up)",
                    description="1: tenant counts shared in Redis; 0: this router counts "
                    "alone; no value: no --state-url",
                ),
                stat(
                    "Auth reload failures, this range",
                    'sum(increase(hivenet_router_auth_reloads_total{result="failure"}'
                    "[$__range])) or vector(0)",
                ),
                series(
                    "Requests by tenant",
                    t(rate("hivenet_router_http_requests_total", T, "tenant"), "{{tenant}}"),
                    unit="reqps",
                ),
                series(
                    "Tenant-limit refusals",
                    t(
                        rate("hivenet_router_tenant_rejections_total", T, "tenant, code"),
                        "{{tenant}} {{code}}",
                    ),
                    unit="reqps",
                ),
                series(
                    "Tokens",
                    t(
                        rate("hivenet_router_tenant_tokens_total", T, "tenant, kind"),
                        "{{tenant}} {{kind}}",
                    ),
                    description="Tokens/s the engines reported, prompt and completion",
                    stack=True,
                ),
                Panel(
                    "Tokens per tenant, this range",
                    "bargauge",
                    (
                        t(
                            f"sum by (tenant) (increase(hivenet_router_tenant_tokens_total{{{T}}}"
                            "[$__range]))",
                            "{{tenant}}",
                            instant=True,
                        ),
                    ),
                ),
                Panel(
                    "Prompt and completion, this range",
                    "piechart",
                    (
                        t(
                            f"sum by (kind) (increase(hivenet_router_tenant_tokens_total{{{T}}}"
                            "[$__range]))",
                            "{{kind}}",
                            instant=True,
                        ),
                    ),
                ),
                series(
                    "Request duration p95 by tenant",
                    *quantiles("hivenet_router_request_duration_seconds", "tenant", T, (0.95,)),
                    unit="s",
                ),
            ),
        ),
        Row(
            "Admission",
            (
                series(
                    "Shed by policy step",
                    t(
                        rate("hivenet_router_policy_shed_total", MT, "model, step"),
                        "{{model}} {{step}}",
                    ),
                    unit="reqps",
                    description="Refused by a step's shed_if under router-wide load",
                ),
                series(
                    "Capacity queue depth", t(f"hivenet_router_queue_depth{{{M}}}", "{{model}}")
                ),
                series(
                    "Queue wait p95 by tenant",
                    *quantiles("hivenet_router_queue_wait_seconds", "tenant", MT, (0.95,)),
                    unit="s",
                ),
                series(
                    "Served locally, by tenant",
                    t(
                        rate("hivenet_router_routing_requests_routed_total", MT, "tenant"),
                        "{{tenant}}",
                    ),
                    unit="reqps",
                ),
                series(
                    "Provider fallback, by tenant",
                    t(
                        rate("hivenet_router_policy_provider_fallback_total", MT, "tenant"),
                        "{{tenant}}",
                    ),
                    unit="reqps",
                ),
                series(
                    "Exhausted, by tenant",
                    t(rate("hivenet_router_policy_exhausted_total", MT, "tenant"), "{{tenant}}"),
                    unit="reqps",
                ),
                series(
                    "Token admission refusals, by gate",
                    t(
                        rate("hivenet_router_admission_rejections_total", M, "model, reason"),
                        "{{model}} {{reason}}",
                    ),
                    unit="reqps",
                    description="b1: request caps; b2: pool occupancy; b4_*: serverless keys",
                ),
                series(
                    "Token occupancy and budget",
                    t(
                        f"sum by (model) (hivenet_router_admission_occupancy_tokens{{{M}}})",
                        "{{model}} occupancy",
                    ),
                    t(
                        f"max by (model) (hivenet_router_admission_budget_tokens{{{M}}})",
                        "{{model}} budget",
                    ),
                    description="Occupancy summed over routers (each reports its own "
                    "admissions); budget: the largest any router applies",
                ),
                series(
                    "Admitted in flight and the cap",
                    t(
                        f"sum by (model) (hivenet_router_admission_inflight_requests{{{M}}})",
                        "{{model}} in flight",
                    ),
                    t(
                        f"max by (model) (hivenet_router_admission_max_inflight{{{M}}})",
                        "{{model}} max",
                    ),
                ),
            ),
        ),
    ),
)

AUDIT = Dashboard(
    uid="hivenet-audit",
    title="Hivenet Router: audit",
    description="Who was answered and how, who was refused and why, what changed",
    variables=(
        Variable("tenant", "Tenant", "label_values(hivenet_router_http_requests_total, tenant)"),
        Variable(
            "endpoint", "Endpoint", "label_values(hivenet_router_http_requests_total, endpoint)"
        ),
    ),
    rows=(
        Row(
            "Answers",
            (
                Panel(
                    "Per-request audit log",
                    "text",
                    (),
                    width=24,
                    height=4,
                    text="One JSON line per inference request (tenant, model, policy step, "
                    "agent, status, refusal code, tokens, duration) is written by "
                    "`--audit-log PATH`; these panels are the same traffic counted by "
                    "Prometheus. `jq 'select(.status >= 400)' audit.jsonl` lists the "
                    "refused requests (docs: Admission and tenants).",
                ),
                series(
                    "Answers by status",
                    t(
                        rate(
                            "hivenet_router_http_requests_total",
                            'tenant=~"$tenant", endpoint=~"$endpoint"',
                            "status",
                        ),
                        "{{status}}",
                    ),
                    unit="reqps",
                    width=12,
                    stack=True,
                ),
                series(
                    "Errors by endpoint",
                    t(
                        rate(
                            "hivenet_router_http_requests_total",
                            'tenant=~"$tenant", endpoint=~"$endpoint", status!~"2.."',
                            "endpoint, status",
                        ),
                        "{{endpoint}} {{status}}",
                    ),
                    unit="reqps",
                    width=12,
                ),
                Panel(
                    "Answers this range, by tenant, endpoint and status",
                    "table",
                    (
                        t(
                            "sum by (tenant, endpoint, status) (increase("
                            'hivenet_router_http_requests_total{tenant=~"$tenant", '
                            'endpoint=~"$endpoint"}[$__range])) > 0',
                            instant=True,
                        ),
                    ),
                    width=24,
                ),
            ),
        ),
        Row(
            "Refusals",
            (
                series(
                    "Tenant-limit refusals by code",
                    t(rate("hivenet_router_tenant_rejections_total", T, "code"), "{{code}}"),
                    unit="reqps",
                ),
                series(
                    "Forward failures by code",
                    t(rate("hivenet_router_forward_failures_total", T, "code"), "{{code}}"),
                    unit="reqps",
                ),
                series(
                    "Agent hellos refused by reason",
                    t(
                        "sum by (reason) (increase(hivenet_router_agent_sessions_refused_total"
                        "[$__rate_interval]))",
                        "{{reason}}",
                    ),
                    description="A wrong shared secret, an expired token or bad metadata",
                ),
            ),
        ),
        Row(
            "Changes",
            (
                series(
                    "Policy reloads",
                    t(
                        "sum by (result) (increase(hivenet_router_policy_reloads_total"
                        "[$__rate_interval]))",
                        "{{result}}",
                    ),
                    width=12,
                    description="SIGHUP and PUT /admin/policy; a failure keeps the old policy",
                ),
                series(
                    "Auth file reloads",
                    t(
                        "sum by (result) (increase(hivenet_router_auth_reloads_total"
                        "[$__rate_interval]))",
                        "{{result}}",
                    ),
                    width=12,
                ),
                stat(
                    "Router restarts, this range",
                    f"sum(changes(process_start_time_seconds{{{ROUTER}}}[$__range]))",
                ),
                stat("Agents connected", "sum(hivenet_router_agents_connected)"),
            ),
        ),
        Row(
            "Event loop",
            (
                series(
                    "Event-loop lag",
                    *quantiles("hivenet_router_event_loop_lag_seconds", "", ROUTER, (0.99, 0.999)),
                    unit="s",
                    description="How long one turn of the router's loop kept every other task"
                    " waiting (wall clock); a long turn delays every request in flight",
                ),
                series(
                    "Event-loop turn CPU",
                    *quantiles("hivenet_router_event_loop_busy_seconds", "", ROUTER, (0.99, 0.999)),
                    unit="s",
                    description="CPU time of one turn: lag without it is the host's scheduler",
                ),
                series(
                    "Collector pauses by generation",
                    t(
                        "histogram_quantile(0.99, sum by (le, generation)"
                        " (rate(hivenet_router_gc_pause_seconds_bucket"
                        f"{{{ROUTER}}}[$__rate_interval])))",
                        "gen {{generation}} p99",
                    ),
                    unit="s",
                ),
            ),
        ),
    ),
)

DASHBOARDS = {"fleet-routing": FLEET, "tenants-admission": TENANTS, "audit": AUDIT}


def _target(target: Target, ref: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "datasource": DATASOURCE,
        "expr": target.expr,
        "legendFormat": target.legend or "__auto",
        "refId": chr(ord("A") + ref),
    }
    if target.instant:
        out.update(instant=True, range=False, format="table")
    return out


def _panel(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
    }
    if panel.description:
        out["description"] = panel.description
    if panel.kind == "text":
        out["options"] = {"mode": "markdown", "content": panel.text}
        return out
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.max is not None:
        defaults.update(min=0, max=panel.max)
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "fillOpacity": 10,
            "showPoints": "never",
            "stacking": {"mode": "normal" if panel.stack else "none"},
        }
    out["datasource"] = DATASOURCE
    out["fieldConfig"] = {"defaults": defaults, "overrides": []}
    out["targets"] = [_target(target, i) for i, target in enumerate(panel.targets)]
    if panel.kind == "table" and len(panel.targets) > 1:
        # One instant query per column, joined on the agent's labels.
        out["transformations"] = [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {"excludeByName": {"Time": True}}},
        ]
    elif panel.kind == "table":
        out["transformations"] = [{"id": "organize", "options": {"excludeByName": {"Time": True}}}]
    if panel.kind == "timeseries":
        out["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif panel.kind == "stat":
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"}
    return out


def _variable(var: Variable) -> dict[str, Any]:
    return {
        "name": var.name,
        "label": var.label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": var.query, "refId": "var"},
        "definition": var.query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def render(dash: Dashboard) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    pid = 1
    for row in dash.rows:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid += 1
        y += 1
        x = 0
        line_height = 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y, line_height = 0, y + line_height, 0
            panels.append(_panel(panel, pid, x, y))
            pid += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return {
        "uid": dash.uid,
        "title": dash.title,
        "description": dash.description,
        "tags": list(dash.tags),
        "editable": False,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "timezone": "browser",
        "graphTooltip": 1,
        "templating": {"list": [_variable(v) for v in dash.variables]},
        "annotations": {"list": []},
        "panels": panels,
    }


def rendered() -> dict[str, str]:
    """File name → JSON text, exactly as committed."""
    return {
        f"{name}.json": json.dumps(render(dash), indent=2, ensure_ascii=False) + "\n"
        for name, dash in DASHBOARDS.items()
    }


def markdown() -> str:
    lines: list[str] = []
    for name, dash in DASHBOARDS.items():
        lines.append(
            f"**{dash.title}** (`deploy/grafana/dashboards/{name}.json`; "
            f"variables {', '.join('$' + v.name for v in dash.variables)})"
        )
        lines.append("")
        for row in dash.rows:
            titles = "; ".join(p.title for p in row.panels)
            lines.append(f"- *{row.title}*: {titles}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if argv == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    OUT.mkdir(exist_ok=True)
    for name, text in rendered().items():
        (OUT / name).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
