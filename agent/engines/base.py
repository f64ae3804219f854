"""What every engine adapter shares: endpoints, health, model discovery, metric sampling.

An adapter knows where its engine answers and which Prometheus names carry the policy's
engine fields. The sampler turns one `/metrics` text after another into those fields in
policy units: fractions 0-1 for cache use, counts for queues, seconds for latencies. A
field no known name provides is None, never zero, so a gate on it is skipped rather than
passed on a made-up value. Prometheus text may carry NaN and ±Inf samples: they are
unknown too (dropped as they are read), so no field is ever a non-finite number, which
no JSON document (the router's routing table) could hold.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

import httpx

from agent.engines.endpoints import lacks
from agent.engines.sample_lines import Sample, read_page, read_sample
from protocol.fields import ENGINE_FIELDS
from protocol.paths import API_PATHS

# What the sampler reports: the policy's fields, and `preemptions_total` (the engine's
# lifetime count of requests preempted for lack of KV cache), which the routing table
# and /metrics show and no gate reads.
FIELDS = (*ENGINE_FIELDS, "preemptions_total")

# Series of the served model are picked by this label (vLLM and SGLang both use it).
MODEL_LABEL = "model_name"
# Latencies are averaged over the requests the engine completed in this many seconds. A
# scrape interval alone (half a second) holds no completion most of the time at low
# traffic, and a gate on a missing value passes: the agent would be excluded for a
# moment after each slow answer and taken again the next. Past the window without a
# completion the value is missing again, so an agent excluded for its latency, which
# then gets no requests to measure, is tried again after it rather than never.
LATENCY_WINDOW = 30.0
# Sample lines a sampler remembers read (MetricSampler._read): a page holds a few dozen
# it wants, so this is only a bound against an engine whose values never repeat.
PARSED_LINES = 1024


@dataclass(frozen=True)
class EngineEndpoints:
    backend_url: str
    health_url: str | None
    metrics_url: str | None


@dataclass(frozen=True)
class MetricNames:
    """Prometheus names per policy field, the current name first.

    Engines rename metrics between releases; the first name present in a scrape wins, so
    an engine exposing both an old and a new name during a deprecation is read once.
    """

    kv_cache_utilization: tuple[str, ...] = ()
    running_requests: tuple[str, ...] = ()
    waiting_requests: tuple[str, ...] = ()
    ttft_histogram: tuple[str, ...] = ()
    itl_histogram: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()
    # For an engine with no ITL histogram: (seconds spent decoding, tokens decoded)
    # counters, whose change over a scrape interval is the average time per token.
    itl_counters: tuple[tuple[str, str], ...] = ()
    # Read for upstream's re-exported series only (`engine.upstream` of a heartbeat):
    # request length histograms, finished requests by `finished_reason`, and llama.cpp's
    # throughput gauges.
    prompt_tokens_histogram: tuple[str, ...] = ()
    generation_tokens_histogram: tuple[str, ...] = ()
    finish_reasons: tuple[str, ...] = ()
    predicted_tps: tuple[str, ...] = ()
    prompt_tps: tuple[str, ...] = ()

    def __or__(self, other: MetricNames) -> MetricNames:
        def join(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
            return a + tuple(n for n in b if n not in a)

        return MetricNames(
            kv_cache_utilization=join(self.kv_cache_utilization, other.kv_cache_utilization),
            running_requests=join(self.running_requests, other.running_requests),
            waiting_requests=join(self.waiting_requests, other.waiting_requests),
            ttft_histogram=join(self.ttft_histogram, other.ttft_histogram),
            itl_histogram=join(self.itl_histogram, other.itl_histogram),
            preemptions=join(self.preemptions, other.preemptions),
            itl_counters=self.itl_counters
            + tuple(p for p in other.itl_counters if p not in self.itl_counters),
            prompt_tokens_histogram=join(
                self.prompt_tokens_histogram, other.prompt_tokens_histogram
            ),
            generation_tokens_histogram=join(
                self.generation_tokens_histogram, other.generation_tokens_histogram
            ),
            finish_reasons=join(self.finish_reasons, other.finish_reasons),
            predicted_tps=join(self.predicted_tps, other.predicted_tps),
            prompt_tps=join(self.prompt_tps, other.prompt_tps),
        )

    def sample_names(self) -> frozenset[str]:
        gauges = self.kv_cache_utilization + self.running_requests + self.waiting_requests
        gauges += self.preemptions + self.finish_reasons + self.predicted_tps + self.prompt_tps
        histograms = self.ttft_histogram + self.itl_histogram
        histograms += self.prompt_tokens_histogram + self.generation_tokens_histogram
        suffixed = (h + s for h in histograms for s in ("_sum", "_count", "_bucket"))
        counters = (name for pair in self.itl_counters for name in pair)
        return frozenset((*gauges, *suffixed, *counters))


Series = list[tuple[dict[str, str], float]]


@dataclass(frozen=True)
class _HistogramSnapshot:
    name: str
    total: float
    count: float
    # (upper bound, cumulative count), sorted by bound; the last bound is +Inf when present
    buckets: tuple[tuple[float, float], ...]

    def restarted_since(self, earlier: _HistogramSnapshot) -> bool:
        """Another series, or a counter that fell: an engine restart."""
        if self.name != earlier.name or self.count < earlier.count or self.total < earlier.total:
            return True
        before = dict(earlier.buckets)
        return any(count < before.get(bound, 0.0) for bound, count in self.buckets)


@dataclass(frozen=True)
class _CounterSnapshot:
    name: str
    spent: float
    done: float

    def restarted_since(self, earlier: _CounterSnapshot) -> bool:
        return self.name != earlier.name or self.spent < earlier.spent or self.done < earlier.done


Snapshot = TypeVar("Snapshot", _HistogramSnapshot, _CounterSnapshot)


class _Window(Generic[Snapshot]):
    """An engine's cumulative counters over the last LATENCY_WINDOW seconds of scrapes."""

    def __init__(self) -> None:
        self._scrapes: deque[tuple[float, Snapshot]] = deque()

    def baseline(self, now: float, current: Snapshot | None) -> Snapshot | None:
        """The scrape `current` is compared with: the newest at least a window old, or the
        oldest kept. None without an earlier scrape of the same counters since the
        engine (re)started."""
        scrapes = self._scrapes
        if current is None:
            scrapes.clear()
            return None
        if scrapes and current.restarted_since(scrapes[-1][1]):
            scrapes.clear()
        scrapes.append((now, current))
        while len(scrapes) > 1 and scrapes[1][0] <= now - LATENCY_WINDOW:
            scrapes.popleft()
        return scrapes[0][1] if len(scrapes) > 1 else None


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Quantile of cumulative buckets, interpolated linearly as Prometheus does.

    Returns None where Prometheus would answer NaN: no +Inf bucket, fewer than two
    buckets, or no observations.
    """
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        return None
    observed = ordered[-1][1]
    if observed <= 0:
        return None
    rank = q * observed
    # First bucket whose cumulative count reaches the rank; the +Inf bucket is never
    # interpolated into, as in Prometheus's bucketQuantile.
    index = next((i for i, (_, c) in enumerate(ordered[:-1]) if c >= rank), len(ordered) - 1)
    if index == len(ordered) - 1:
        return ordered[-2][0]
    upper, cumulative = ordered[index]
    if index == 0 and upper <= 0:
        return upper
    lower, below = (0.0, 0.0) if index == 0 else ordered[index - 1]
    in_bucket = cumulative - below
    if in_bucket <= 0:
        return upper
    return lower + (upper - lower) * ((rank - below) / in_bucket)


class MetricSampler:
    """Turns successive `/metrics` scrapes of one engine into the policy's engine fields.

    Stateful: histogram averages and P90s cover the requests completed in the last
    LATENCY_WINDOW seconds, so the first scrape, and a window without a completion,
    give None.
    """

    def __init__(self, names: MetricNames, model: str | None) -> None:
        self._names = names
        self._model = model or None
        self._wanted = names.sample_names()
        # The lines of the wanted samples. An engine's page is hundreds of lines of which
        # the sampler reads a few dozen, each in a few µs where it is plain
        # (sample_lines.py): a scrape every half second, parsed whole by
        # prometheus_client, was most of an idle agent's CPU.
        alternatives = "|".join(re.escape(name) for name in sorted(self._wanted))
        self._lines = re.compile(rf"^[ \t]*(?:{alternatives})[ \t{{][^\n]*", re.MULTILINE)
        self._parsed: dict[str, list[Sample]] = {}
        self._windows: dict[str, _Window[_HistogramSnapshot]] = {
            "ttft": _Window(),
            "itl": _Window(),
        }
        self._itl_counters: _Window[_CounterSnapshot] = _Window()

    def update(self, text: str, now: float) -> dict:
        """Fields from one scrape taken at `now` (monotonic seconds).

        Raises ValueError when `text` is not Prometheus text exposition format; the
        histogram history is then left as it was.
        """
        series = self._collect(text)
        avg_ttft, p90_ttft = self._latency("ttft", now, series, self._names.ttft_histogram)
        avg_itl, p90_itl = self._latency("itl", now, series, self._names.itl_histogram)
        if self._names.itl_counters:
            # Kept every scrape; read only where no histogram answered (`custom` knows
            # every engine's names).
            per_token = self._per_token(now, series, self._names.itl_counters)
            if avg_itl is None:
                avg_itl = per_token
        values = {
            # Cache use of several series (data-parallel engines) is a pressure: the worst counts.
            "kv_cache_utilization": self._gauge(series, self._names.kv_cache_utilization, max),
            "running_requests": self._gauge(series, self._names.running_requests, sum),
            "waiting_requests": self._gauge(series, self._names.waiting_requests, sum),
            "avg_ttft_seconds": avg_ttft,
            "p90_ttft_seconds": p90_ttft,
            "avg_itl_seconds": avg_itl,
            "p90_itl_seconds": p90_itl,
            "preemptions_total": self._gauge(series, self._names.preemptions, sum),
        }
        # Finite samples can still add up past the largest float (1e308 + 1e308).
        out: dict = {k: v if v is None or math.isfinite(v) else None for k, v in values.items()}
        upstream = self._upstream(series)
        if upstream:
            out["upstream"] = upstream
        return out

    def _upstream(self, series: dict[str, Series]) -> dict:
        """What upstream's router re-exports from an engine, as the engine counts it
        (cumulative): its histograms, finish reasons and llama.cpp's throughputs. A few
        hundred bytes per heartbeat; the router reads them only for
        `--metrics-compat upstream` (router/agent_detail.py upstream_of)."""
        names = self._names
        out: dict = {}
        histograms = {}
        for key, candidates in (
            ("ttft_seconds", names.ttft_histogram),
            ("itl_seconds", names.itl_histogram),
            ("request_prompt_tokens", names.prompt_tokens_histogram),
            ("request_generation_tokens", names.generation_tokens_histogram),
        ):
            snapshot = _snapshot(series, candidates)
            if snapshot is None or not math.isfinite(snapshot.total + snapshot.count):
                continue
            # The +Inf bucket travels as `count`: JSON (the agent's own pages) has no
            # infinity.
            finite = [[le, n] for le, n in snapshot.buckets if math.isfinite(le + n)]
            if len(finite) < 64:
                histograms[key] = {
                    "buckets": finite,
                    "sum": snapshot.total,
                    "count": snapshot.count,
                }
        if histograms:
            out["histograms"] = histograms
        for name in names.finish_reasons:
            reasons: dict[str, float] = {}
            for labels, value in series.get(name, ()):
                reason = labels.get("finished_reason", "")
                if reason:
                    reasons[reason] = reasons.get(reason, 0.0) + value
            if reasons:
                out["finish_reasons"] = dict(list(reasons.items())[:16])
                break
        for key, candidates in (
            ("predicted_tps", names.predicted_tps),
            ("prompt_tps", names.prompt_tps),
        ):
            value = self._gauge(series, candidates, max)
            if value is not None:
                out[key] = value
        return out

    def _collect(self, text: str) -> dict[str, Series]:
        # Indexed by sample name, not family name: untyped exposition (no # TYPE line)
        # puts each `_bucket`/`_sum` sample in its own family.
        series: dict[str, Series] = {}
        if not self._wanted:
            return series
        # Text without a line of ours is parsed whole: what is not Prometheus text at all
        # still fails the scrape (a line of another metric no longer can).
        lines = self._lines.findall(text)
        try:
            samples = [s for line in lines for s in self._read(line)] if lines else read_page(text)
            for name, labels, value in samples:
                if name in self._wanted and math.isfinite(value):
                    series.setdefault(name, []).append((labels, value))
        except (ValueError, TypeError, IndexError) as exc:
            raise ValueError(f"malformed Prometheus text: {exc}") from exc
        return {name: self._select(samples) for name, samples in series.items()}

    def _read(self, line: str) -> list[Sample]:
        """`read_sample(line)`, remembered: between two scrapes most lines of a page are
        the same text (every one, on an idle engine), read once instead of twice a
        second. What is remembered is forgotten at once past PARSED_LINES lines."""
        samples = self._parsed.get(line)
        if samples is None:
            samples = read_sample(line)
            if len(self._parsed) >= PARSED_LINES:
                self._parsed.clear()
            self._parsed[line] = samples
        return samples

    def _select(self, samples: Series) -> Series:
        """The served model's series when the engine labels them, else all of them.

        The agent's public model name may differ from the engine's served name; then no
        series matches and the engine's whole load is the best estimate.
        """
        if self._model is None:
            return samples
        mine = [s for s in samples if s[0].get(MODEL_LABEL) == self._model]
        return mine or samples

    @staticmethod
    def _gauge(
        series: dict[str, Series],
        names: tuple[str, ...],
        combine: Callable[[Iterable[float]], float],
    ) -> float | None:
        for name in names:
            samples = series.get(name)
            if samples:
                return float(combine(value for _, value in samples))
        return None

    def _latency(
        self, key: str, now: float, series: dict[str, Series], names: tuple[str, ...]
    ) -> tuple[float | None, float | None]:
        current = _snapshot(series, names)
        earlier = self._windows[key].baseline(now, current)
        if current is None or earlier is None:
            return None, None
        observed = current.count - earlier.count
        if observed <= 0:
            return None, None
        before = dict(earlier.buckets)
        deltas = [(bound, count - before.get(bound, 0.0)) for bound, count in current.buckets]
        return (current.total - earlier.total) / observed, histogram_quantile(0.9, deltas)

    def _per_token(
        self, now: float, series: dict[str, Series], pairs: tuple[tuple[str, str], ...]
    ) -> float | None:
        """Seconds spent over tokens done in the window (llama.cpp counts a request's
        decode time and tokens as it ends); None on the first scrape, when no token was
        done, and after a counter fell (an engine restart)."""
        current = None
        for seconds, tokens in pairs:
            spent, done = series.get(seconds), series.get(tokens)
            if spent and done:
                current = _CounterSnapshot(
                    seconds, sum(v for _, v in spent), sum(v for _, v in done)
                )
                break
        earlier = self._itl_counters.baseline(now, current)
        if current is None or earlier is None or current.done <= earlier.done:
            return None
        return (current.spent - earlier.spent) / (current.done - earlier.done)


def _snapshot(series: dict[str, Series], names: tuple[str, ...]) -> _HistogramSnapshot | None:
    for name in names:
        counts = series.get(name + "_count")
        if not counts:
            continue
        sums = series.get(name + "_sum")
        if not sums:
            # Its sum was not finite (or not there): an average of zero would be made up.
            return None
        buckets: dict[float, float] = {}
        for labels, value in series.get(name + "_bucket", ()):
            bound = float(labels.get("le", "nan"))
            if not math.isnan(bound):
                buckets[bound] = buckets.get(bound, 0.0) + value
        return _HistogramSnapshot(
            name=name,
            total=sum(v for _, v in sums),
            count=sum(v for _, v in counts),
            buckets=tuple(sorted(buckets.items())),
        )
    return None


@dataclass
class HealthTracker:
    """Backend health from single checks: unhealthy until a check passes, then after
    `threshold` failures in a row.

    One failed check of a backend that was answering is often a blip (a GC pause, a
    slow load); a success clears the streak at once so a recovered backend takes
    traffic again on the next heartbeat. A backend never yet seen answering gets no
    such benefit of the doubt: the agent reports what the latest check found.
    """

    threshold: int = 3
    healthy: bool = False
    checked: bool = False  # a check was recorded
    seen_healthy: bool = False
    _failures: int = field(default=0, repr=False)

    def record(self, ok: bool) -> bool:
        self.checked = True
        if ok:
            self._failures = 0
            self.healthy = self.seen_healthy = True
        else:
            self._failures += 1
            if self._failures >= self.threshold:
                self.healthy = False
        return self.healthy


def join_url(base: str, path: str) -> str:
    return base.rstrip("/") + path


class EngineAdapter:
    """Engine knowledge the agent needs; subclasses set the class attributes."""

    name: ClassVar[str]
    default_backend_url: ClassVar[str | None] = None
    health_path: ClassVar[str | None] = "/health"
    metrics_path: ClassVar[str | None] = "/metrics"
    metric_names: ClassVar[MetricNames] = MetricNames()
    # The client API endpoints the engine serves (agent/engines/endpoints.py).
    api_paths: ClassVar[frozenset[str]] = API_PATHS

    def serves(self, path: str) -> bool:
        return not lacks(self.api_paths, path)

    def endpoints(
        self, backend_url: str | None, health_url: str | None, metrics_url: str | None
    ) -> EngineEndpoints:
        """Operator overrides win; otherwise the engine's defaults.

        Raises ValueError when the engine has no default for a URL it needs.
        """
        backend = (backend_url or self.default_backend_url or "").rstrip("/")
        if not backend:
            raise ValueError(f"engine {self.name}: --backend-url is required")
        return EngineEndpoints(
            backend_url=backend,
            health_url=health_url or _default(backend, self.health_path),
            metrics_url=metrics_url or _default(backend, self.metrics_path),
        )

    async def check_health(
        self, client: httpx.AsyncClient, ep: EngineEndpoints, model: str | None = None
    ) -> bool:
        """The engine's health URL answers 2xx, and what it says is fit (`answers_for`;
        `model`, the agent's)."""
        if ep.health_url is None:
            return True
        try:
            response = await client.get(ep.health_url)
        except httpx.HTTPError:
            return False
        return response.is_success and self.answers_for(response, model)

    def answers_for(self, response: httpx.Response, model: str | None) -> bool:
        """Whether a 2xx health answer means the engine serves `model`: for engines
        whose health page names no model, it does."""
        return True

    async def discover_model(self, client: httpx.AsyncClient, ep: EngineEndpoints) -> str | None:
        """The first model of the OpenAI-compatible `/v1/models` list."""
        body = await get_json(client, join_url(ep.backend_url, "/v1/models"))
        data = body.get("data") if isinstance(body, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict):
            model = data[0].get("id")
            if isinstance(model, str) and model:
                return model
        return None

    def new_sampler(self, model: str | None) -> MetricSampler:
        return MetricSampler(self.metric_names, model)


def _default(backend: str, path: str | None) -> str | None:
    return None if path is None else join_url(backend, path)


async def get_json(client: httpx.AsyncClient, url: str) -> object:
    """JSON body of a successful GET, or None: discovery failures are not fatal."""
    try:
        response = await client.get(url)
        if not response.is_success:
            return None
        return response.json()
    except (httpx.HTTPError, ValueError):
        return None
