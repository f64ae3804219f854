"""Per-agent gauges on `--metrics-port`, read from the peer table at scrape time.

Every policy gate field of an agent is exported as `hivenet_router_agent_<field>` with
the labels `peer_id`, `model` and `engine`, in the policy's own units, so a threshold
in a policy file reads the same on a dashboard:

- fractions 0-1 for `capacity_utilization`, `success_rate`, `kv_cache_utilization` and
  the hardware `*_percent` fields (the names are the policy's; the values are not
  percentages);
- seconds for TTFT and ITL, degrees Celsius for `gpu_temperature_c`, counts for requests
  and failures;
- seconds for SRTT and RTTVAR, `hivenet_router_agent_srtt_seconds` (the one field
  whose policy unit, milliseconds, is not the unit here: Prometheus asks for base units,
  and `promtool check metrics` fails a `_milliseconds` name; `srtt: {gt: 500}` is
  `> 0.5` on a dashboard).

A value the gates would treat as missing (never reported, no history yet, or older than
three sample periods) has no sample at all, never a zero. `..._engine_age_seconds` and
`..._hardware_age_seconds` say how old the latest snapshots are, as the routing table
does. Health is `hivenet_router_agent_healthy` (agent and link) and
`hivenet_router_agent_backend_healthy` (its inference backend), 1 or 0.

Lifetime counts (router/lifetime.py keeps them across restarts; POST /admin/metrics/reset
zeroes them) are counters: `..._requests_success_total`, `..._requests_failed_total`,
`..._input_tokens_total`, `..._output_tokens_total`, `..._rejected_requests_total`,
`..._disconnections_total`, and upstream's `..._failure_total` (marked unhealthy for
missed heartbeats) and `..._backend_failure_total` (its engine reported unhealthy).
`..._info` is 1 with the agent's metadata as labels, and
`..._last_seen_timestamp_seconds` the wall time of its latest heartbeat.

From the same snapshots, while they are fresh, and read by no gate: per GPU (label
`gpu_index`) `..._gpu_power_watts`, `..._gpu_vram_used_bytes` and
`..._gpu_vram_total_bytes`; the host's `..._memory_used_bytes` and
`..._memory_total_bytes`; and the engine's `..._preemptions_total` (vLLM's count of
requests preempted for lack of KV cache).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.fields import ENGINE_FIELDS, HARDWARE_FIELDS
from router.metrics_page import PREPARED, Pace
from router.peers import Peer, PeerTable
from router.policy.gates import STALE_AFTER_PERIODS, metric_value

PREFIX = "hivenet_router_agent_"
LABELS = ("peer_id", "model", "engine")
INFO_LABELS = (
    *LABELS,
    "capability",
    "region",
    "gpu_model",
    "version",
    "deployment_id",
    "replica_id",
    # Upstream's registered-agent labels, which its dashboards filter on.
    "organization",
    "machine",
    "capacity",
)
GPU_LABELS = (*LABELS, "gpu_index")
# (gauge name, per-GPU field, help text)
_PER_GPU = (
    ("gpu_power_watts", "power_watts", "GPU power draw, watts"),
    ("gpu_vram_used_bytes", "vram_used_bytes", "GPU memory in use, bytes"),
    ("gpu_vram_total_bytes", "vram_total_bytes", "GPU memory, bytes"),
)
# (counter name without _total, UniversalStats field, help text)
_LIFETIME = (
    ("requests_success", "successes", "Successful forwards (lifetime)"),
    ("requests_failed", "failures", "Failed forwards counted against the agent (lifetime)"),
    ("input_tokens", "input_tokens", "Prompt tokens the engine reported (lifetime)"),
    ("output_tokens", "output_tokens", "Completion tokens the engine reported (lifetime)"),
    (
        "rejected_requests",
        "rejections",
        "Tries to take a capacity slot the agent did not have (lifetime)",
    ),
    ("disconnections", "disconnections", "Agent sessions that ended (lifetime)"),
    (
        "failure",
        "agent_failures",
        "Times the agent was marked unhealthy for missed heartbeats (lifetime)",
    ),
    (
        "backend_failure",
        "backend_failures",
        "Times the agent reported its inference backend unhealthy (lifetime)",
    ),
)

# (metric name suffix, policy field, help text)
_UNIVERSAL = (
    ("capacity_utilization", "capacity_utilization", "Active requests over declared capacity"),
    ("success_rate", "success_rate", "Successful forwards over completed forwards (lifetime)"),
    ("srtt_seconds", "srtt", "RFC 6298 smoothed request time to the response head, seconds"),
    ("consecutive_failures", "consecutive_failures", "Failed forwards since the last success"),
)
_HELP = {
    "kv_cache_utilization": "Engine KV-cache use, fraction 0-1",
    "running_requests": "Requests running in the engine",
    "waiting_requests": "Requests queued in the engine",
    "avg_ttft_seconds": "Average time to first token over the engine's last 30 s",
    "p90_ttft_seconds": "P90 time to first token over the engine's last 30 s",
    "avg_itl_seconds": "Average inter-token latency over the engine's last 30 s",
    "p90_itl_seconds": "P90 inter-token latency over the engine's last 30 s",
    "gpu_temperature_c": "Highest GPU temperature, degrees Celsius",
    "gpu_util_percent": "Highest GPU compute utilization, fraction 0-1",
    "gpu_vram_used_percent": "Highest GPU VRAM use, fraction 0-1",
    "memory_used_percent": "System memory use, fraction 0-1",
    "cpu_usage_percent": "CPU utilization, fraction 0-1",
}


class AgentCollector(Collector):
    """Exports the table's agents; registered once on the router's registry."""

    def __init__(self, table: PeerTable, registry: CollectorRegistry | None = None) -> None:
        self.table = table
        if registry is not None:
            registry.register(self)

    def describe(self) -> Iterable[Metric]:
        # Without describe() the registry would collect once at registration; the names
        # are fixed, so describing them is cheap and lets duplicates be caught early.
        return list(self._families().values())

    def collect(self) -> Iterator[Metric]:
        prepared = PREPARED.get()
        if prepared is not None:  # the scrape built them ahead, in steps
            yield from prepared
            return
        try:
            now = trio.current_time()
        except RuntimeError:
            # Scraped outside the router's trio thread: ages cannot be judged, so only
            # the values that need no clock are exported.
            now = None
        families = self._families()
        for peer in sorted(self.table.all(), key=lambda p: p.peer_id):
            self._add(families, peer, now)
        yield from families.values()

    async def prepare(self, pace: Pace) -> list[Metric]:
        """The families `collect` yields, built with a checkpoint at `pace` (about 0.1 ms
        an agent here: 1,000 agents in one go stop the event loop for 100 ms)."""
        now = trio.current_time()
        families = self._families()
        for peer in sorted(self.table.all(), key=lambda p: p.peer_id):
            self._add(families, peer, now)
            await pace.step()
        return list(families.values())

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
        def gauge(name: str, text: str) -> tuple[str, GaugeMetricFamily]:
            return name, GaugeMetricFamily(PREFIX + name, text, labels=LABELS)

        def counter(name: str, text: str) -> tuple[str, CounterMetricFamily]:
            return name, CounterMetricFamily(PREFIX + name, text, labels=LABELS)

        text = "1, with the agent's metadata as labels"
        info = GaugeMetricFamily(PREFIX + "info", text, labels=INFO_LABELS)
        return dict(
            [
                ("info", info),
                gauge("last_seen_timestamp_seconds", "Wall time of the latest heartbeat"),
                *(counter(name, text) for name, _, text in _LIFETIME),
                gauge("rttvar_seconds", "RFC 6298 RTTVAR of the request time, seconds"),
                *(
                    (name, GaugeMetricFamily(PREFIX + name, text, labels=GPU_LABELS))
                    for name, _, text in _PER_GPU
                ),
                gauge("memory_used_bytes", "Host memory in use, bytes"),
                gauge("memory_total_bytes", "Host memory, bytes"),
                counter(
                    "preemptions", "Requests the engine preempted (vLLM, lifetime of the engine)"
                ),
                gauge("healthy", "1 when the agent is connected and heartbeating, else 0"),
                gauge("backend_healthy", "1 when the agent's inference backend is healthy"),
                gauge("active_requests", "Requests the router has in flight on the agent"),
                gauge("capacity", "Declared capacity (concurrent requests)"),
                *(gauge(name, text) for name, _, text in _UNIVERSAL),
                *(gauge(f, _HELP[f]) for f in ENGINE_FIELDS),
                gauge("engine_age_seconds", "Age of the latest engine metrics snapshot"),
                *(gauge(f, _HELP[f]) for f in HARDWARE_FIELDS),
                gauge("hardware_age_seconds", "Age of the latest hardware snapshot"),
            ]
        )

    @staticmethod
    def _add(
        families: dict[str, GaugeMetricFamily | CounterMetricFamily],
        peer: Peer,
        now: float | None,
    ) -> None:
        md = peer.metadata
        labels = [peer.peer_id, md.model, md.engine]

        def put(name: str, value: float | None) -> None:
            if value is not None:
                families[name].add_metric(labels, float(value))

        put("healthy", 1.0 if peer.healthy and peer.connected else 0.0)
        put("backend_healthy", 1.0 if peer.backend_healthy else 0.0)
        put("active_requests", peer.active)
        put("capacity", md.capacity)
        put("capacity_utilization", peer.load_ratio)
        stats = peer.stats
        put("success_rate", stats.success_rate)
        put("srtt_seconds", _seconds(stats.srtt_ms))
        put("rttvar_seconds", _seconds(stats.rttvar_ms))
        for name, attr, _ in _LIFETIME:
            put(name, getattr(stats, attr))
        meta = (
            md.capability,
            md.region,
            md.gpu_model,
            md.version,
            md.deployment_id,
            md.replica_id,
            md.organization,
            md.machine,
            str(md.capacity),
        )
        families["info"].add_metric([*labels, *meta], 1.0)
        if stats.successes + stats.failures:
            put("consecutive_failures", stats.consecutive_failures)
        if now is None:
            return
        put("last_seen_timestamp_seconds", time.time() - (now - peer.last_seen))
        for field in (*ENGINE_FIELDS, *HARDWARE_FIELDS):
            put(field, metric_value(peer, field, now))
        if now - peer.hardware_at <= STALE_AFTER_PERIODS * peer.hardware_interval:
            for gpu in peer.gpus:
                for name, attr, _ in _PER_GPU:
                    value = gpu.values.get(attr)
                    if value is not None:
                        families[name].add_metric([*labels, str(gpu.index)], value)
            put("memory_used_bytes", peer.memory.get("memory_used_bytes"))
            put("memory_total_bytes", peer.memory.get("memory_total_bytes"))
        if now - peer.engine_at <= STALE_AFTER_PERIODS * peer.engine_interval:
            put("preemptions", peer.preemptions)
        if peer.engine_at:
            put("engine_age_seconds", now - peer.engine_at)
        if peer.hardware_at:
            put("hardware_age_seconds", now - peer.hardware_at)


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000
