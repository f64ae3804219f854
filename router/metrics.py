"""Every Prometheus collector of the router, on one registry owned by the daemon."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from router.lean_metrics import LeanCounter, LeanHistogram
from router.loop_watch import count_tasks

P = "hivenet_router_"
# The `model` label of a request for a model no agent has registered (404, or the
# provider's): clients choose those names, and each would be a series for good.
UNREGISTERED_MODEL = "(unregistered)"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
# Fine around the 5 ms a pause must stay under, so a scrape's difference tells the longest.
_LAG_BUCKETS = (
    0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.25, 0.5, 1, 2.5,
)  # fmt: skip


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # What every request moves is lean (router/lean_metrics.py); the rest is
        # prometheus_client's own.
        self.routed = LeanCounter(
            P + "routing_requests_routed_total",
            "Requests served by a local agent",
            ["model", "tenant"],
            registry=r,
        )
        self.primary = LeanCounter(
            P + "policy_primary_routed_total",
            "Requests served by the primary routing_policy step",
            ["model", "tenant"],
            registry=r,
        )
        self.fallback = LeanCounter(
            P + "policy_fallback_routed_total",
            "Requests served by any local fallback step",
            ["model", "tenant"],
            registry=r,
        )
        self.provider = Counter(
            P + "policy_provider_fallback_total",
            "Requests served by the external provider fallback",
            ["model", "tenant"],
            registry=r,
        )
        self.exhausted = Counter(
            P + "policy_exhausted_total",
            "Requests whose local chain was exhausted with no successful result after it",
            ["model", "tenant"],
            registry=r,
        )
        self.resets = Counter(
            P + "agent_connection_resets_total",
            "Stale agent connections discarded by connection-level recovery",
            ["model", "tenant"],
            registry=r,
        )
        self.stream_continuations = Counter(
            P + "stream_continuations_total",
            "Broken streams by what followed: continued on another agent, ended whole,"
            " or ended with the error event (unsupported, no_agent)",
            ["model", "tenant", "outcome"],
            registry=r,
        )
        self.forward_failures = Counter(
            P + "forward_failures_total",
            "Failed forwards to agents by error code",
            ["model", "code", "tenant"],
            registry=r,
        )
        self.requests = LeanCounter(
            P + "http_requests_total",
            "Client requests by endpoint, status and tenant",
            ["endpoint", "status", "tenant"],
            registry=r,
        )
        self.duration = LeanHistogram(
            P + "request_duration_seconds",
            "Whole client request time, from the first byte read to the last byte sent",
            ["endpoint", "tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = LeanHistogram(
            P + "router_overhead_seconds",
            "Time from a request's arrival to its answering forward being written to the "
            "agent: parsing, keys, policy gates, any capacity-queue wait and failed tries "
            "(agent and engine time after the write is excluded)",
            ["endpoint"],
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            P + "queue_depth", "Requests waiting for capacity", ["model"], registry=r
        )
        self.queue_wait = Histogram(
            P + "queue_wait_seconds",
            "Time spent in the capacity queue",
            ["model", "tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.shed = Counter(
            P + "policy_shed_total",
            "Requests refused by a policy step's shed_if under router-wide load",
            ["model", "tenant", "step"],
            registry=r,
        )
        self.agents_connected = Gauge(
            P + "agents_connected", "Agent sessions connected", registry=r
        )
        self.agents_healthy = Gauge(
            P + "agents_healthy", "Agents passing the health gate", registry=r
        )
        self.reloads = Counter(
            P + "policy_reloads_total", "Policy reloads by result", ["result"], registry=r
        )
        ProcessCollector(registry=r)
        # router/loop_watch.py: every loop turn's run batch, and every collector pass.
        self.loop_lag = LeanHistogram(
            P + "event_loop_lag_seconds",
            "Each run batch of the event loop (wall clock): how long the loop went without"
            " reading its sockets or firing its timers",
            [],
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.loop_busy = LeanHistogram(
            P + "event_loop_busy_seconds",
            "The CPU time of each run batch of event_loop_lag_seconds: the loop's own work"
            " (the rest of a lag is the host's scheduler)",
            [],
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.gc_pause = LeanHistogram(
            P + "gc_pause_seconds",
            "The CPU time of each garbage-collector pass, by generation (0 to 2)",
            ["generation"],
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        # A task left behind per past connection is how py-libp2p leaks; watch for it.
        # The daemon counts them with its LoopWatch (router/app.py); this walks the tree.
        self.trio_tasks = Gauge(P + "trio_tasks", "Live trio tasks in the router", registry=r)
        self.trio_tasks.set_function(lambda: float(count_tasks()))
        self.sessions_refused = Counter(
            P + "agent_sessions_refused_total",
            "Agent hellos refused, by reason",
            ["reason"],
            registry=r,
        )
        self.tenant_rejections = Counter(
            P + "tenant_rejections_total",
            "Requests refused by a tenant limit of the auth file, by tenant and code",
            ["tenant", "code"],
            registry=r,
        )
        # Lean: moved twice by every answer that reports usage.
        self.tenant_tokens = LeanCounter(
            P + "tenant_tokens_total",
            "Tokens the engines reported per tenant (kind: prompt or completion)",
            ["tenant", "kind"],
            registry=r,
        )
        self.auth_reloads = Counter(
            P + "auth_reloads_total", "Auth file reloads by result", ["result"], registry=r
        )
        # Labelled so that a router without --state-url exports the family with no
        # sample: an unlabelled gauge would read 0, "Redis unreachable", on every one.
        self.state_store_up = Gauge(
            P + "state_store_up",
            "1 while tenant counts are shared in Redis (--state-url), 0 while this router"
            " counts alone because Redis is unreachable; no sample without --state-url",
            ["store"],
            registry=r,
        )
        # Upstream's admission-control metrics (hivenet_admission_*) under this prefix.
        self.admission_rejections = Counter(
            P + "admission_rejections_total",
            "Requests refused by an admission gate (reason: b1, b2, b4_occupancy, b4_itpm,"
            " b4_otpm)",
            ["reason", "model"],
            registry=r,
        )
        self.admission_occupancy = Gauge(
            P + "admission_occupancy_tokens",
            "Token-weighted occupancy in flight on the model (this router's admissions)",
            ["model"],
            registry=r,
        )
        self.admission_budget = Gauge(
            P + "admission_budget_tokens",
            "Effective occupancy budget: ADMIT_FRACTION * admit_budget_tokens * healthy replicas",
            ["model"],
            registry=r,
        )
        self.admission_inflight = Gauge(
            P + "admission_inflight_requests",
            "Requests holding occupancy on the model",
            ["model"],
            registry=r,
        )
        self.admission_max_inflight = Gauge(
            P + "admission_max_inflight",
            "Effective max_inflight * healthy replicas; 0: no count backstop",
            ["model"],
            registry=r,
        )
