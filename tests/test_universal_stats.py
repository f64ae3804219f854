"""Router-side signals: RFC 6298 SRTT, success rate, consecutive failures, freshness.

The hand-computed sequences use binary fractions, so every value is exact in floating
point. The link tests drive `AgentLink.forward` through a fake agent session on trio's
autojump clock, so the time a response head takes is exactly what the test says.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

from protocol import messages as m
from protocol.conversation import SessionState
from router.agent_metrics import AgentCollector
from router.capacity import WaitQueue
from router.http.admin import agent_view
from router.link import AgentLink, AgentResponse, AgentSession, LinkSettings
from router.metrics import RouterMetrics
from router.peers import AgentMetadata, Peer, PeerTable, UniversalStats
from router.policy.gates import metric_value
from router.policy.schema import DEFAULT_POLICY_YAML, load_policy
from router.session import (
    BackendRejected,
    ForwardFailure,
    RouteRequest,
    RoutingSession,
    Served,
    Slot,
)

DEFAULT = load_policy(DEFAULT_POLICY_YAML)

# --- UniversalStats ------------------------------------------------------------------


def test_srtt_follows_rfc_6298_by_hand() -> None:
    stats = UniversalStats()
    assert stats.srtt_ms is None
    assert stats.rttvar_ms is None
    # First sample R: SRTT = R, RTTVAR = R/2.
    stats.record_rtt(100.0)
    assert (stats.srtt_ms, stats.rttvar_ms) == (100.0, 50.0)
    # Then RTTVAR = 3/4 RTTVAR + 1/4 |SRTT - R| (with the old SRTT), SRTT = 7/8 SRTT + 1/8 R.
    # R=200: RTTVAR = 37.5 + 25 = 62.5; SRTT = 87.5 + 25 = 112.5
    stats.record_rtt(200.0)
    assert (stats.srtt_ms, stats.rttvar_ms) == (112.5, 62.5)
    # R=50: RTTVAR = 46.875 + 15.625 = 62.5; SRTT = 98.4375 + 6.25 = 104.6875
    stats.record_rtt(50.0)
    assert (stats.srtt_ms, stats.rttvar_ms) == (104.6875, 62.5)
    # R=400: RTTVAR = 46.875 + 0.25 * 295.3125 = 120.703125; SRTT = 91.6015625 + 50
    stats.record_rtt(400.0)
    assert (stats.srtt_ms, stats.rttvar_ms) == (141.6015625, 120.703125)


def test_srtt_converges_on_a_steady_rtt() -> None:
    stats = UniversalStats()
    stats.record_rtt(1000.0)
    for _ in range(200):
        stats.record_rtt(40.0)
    assert stats.srtt_ms == pytest.approx(40.0)
    assert stats.rttvar_ms == pytest.approx(0.0, abs=1e-6)


def test_success_rate_and_consecutive_failures_by_hand() -> None:
    stats = UniversalStats()
    assert stats.success_rate is None  # no history: missing, not 0 or 1
    outcomes = "SSFSFFFS"
    rates = [1 / 1, 2 / 2, 2 / 3, 3 / 4, 3 / 5, 3 / 6, 3 / 7, 4 / 8]
    streaks = [0, 0, 1, 0, 1, 2, 3, 0]
    for outcome, rate, streak in zip(outcomes, rates, streaks, strict=True):
        if outcome == "S":
            stats.record_success(probe=False)
        else:
            stats.record_failure(now=0.0, cooldown=30.0)
        assert stats.success_rate == pytest.approx(rate)
        assert stats.consecutive_failures == streak
    assert (stats.successes, stats.failures) == (4, 4)


def test_gate_values_without_history_are_missing() -> None:
    peer = _peer()
    for name in ("success_rate", "srtt", "consecutive_failures"):
        assert metric_value(peer, name, 0.0) is None
    assert metric_value(peer, "capacity_utilization", 0.0) == 0.0
    peer.stats.record_failure(now=0.0, cooldown=30.0)
    assert metric_value(peer, "consecutive_failures", 0.0) == 1
    assert metric_value(peer, "success_rate", 0.0) == 0.0


# --- through the link: where a sample starts and ends ----------------------------------


class _FakeStream:
    """The FramedStream surface AgentLink.forward uses; records what the router sends."""

    def __init__(self) -> None:
        self.closed = trio.Event()
        self.sent: list[dict] = []
        self.arrived = trio.Event()

    def send_nowait(self, msg: dict) -> None:
        self.sent.append(msg)
        self.arrived.set()
        self.arrived = trio.Event()

    async def send(self, msg: dict) -> None:
        self.send_nowait(msg)

    def close(self, reason: str) -> None:
        self.closed.set()


def _peer(peer_id: str = "12D3KooWTest", capacity: int = 4, engine: str = "sim") -> Peer:
    async def send(msg: dict) -> None:
        pass

    return Peer(
        peer_id=peer_id,
        metadata=AgentMetadata(model="m1", capability="llm", engine=engine, capacity=capacity),
        send=send,
        connected_at=0.0,
        last_seen=0.0,
    )


def _link() -> tuple[AgentLink, AgentSession, _FakeStream, Peer]:
    table = PeerTable()
    link = AgentLink(
        table,
        RouterMetrics(),
        LinkSettings(
            secret=b"s" * 32,
            heartbeat_interval=5.0,
            unhealthy_after=15.0,
            remove_after=30.0,
            router_peer_id="router",
        ),
    )
    fs = _FakeStream()
    peer = _peer()
    session = AgentSession(link, fs, peer.peer_id)  # type: ignore[arg-type]
    session.peer = peer
    session._enter(SessionState.JOINED)  # as if its hello had been welcomed
    link.sessions[peer] = session
    table.add(peer)
    return link, session, fs, peer


def _request(stream: bool) -> RouteRequest:
    return RouteRequest(
        request_id="req",
        model="m1",
        capability="llm",
        tenant="t",
        method="POST",
        path="/v1/chat/completions",
        headers={},
        body=b"{}",
        stream=stream,
    )


async def _agent(session: AgentSession, fs: _FakeStream, script: list[tuple[float, Any]]) -> None:
    """Answer the next request: each step sleeps, then delivers a frame built from its id."""
    while not any(msg["type"] == m.REQUEST for msg in fs.sent):
        await fs.arrived.wait()
    req_id = next(msg["id"] for msg in reversed(fs.sent) if msg["type"] == m.REQUEST)
    for delay, build in script:
        await trio.sleep(delay)
        session.on_message(build(req_id))


async def _forward(
    link: AgentLink, session: AgentSession, fs: _FakeStream, peer: Peer, stream: bool, script: list
) -> tuple[AgentResponse | ForwardFailure, bytes]:
    """One request routed to `peer` over the link, as the router sends it: the routing
    session counts the outcome against the agent, the link times it."""
    fs.sent.clear()
    body = b""
    outcomes: list[AgentResponse | ForwardFailure] = []

    async def forward(peer: Peer, req: RouteRequest, slot: Slot) -> AgentResponse | ForwardFailure:
        outcomes.append(await link.forward(peer, req, slot))
        return outcomes[-1]

    routing = RoutingSession(link.table, WaitQueue(0), link.metrics, forward, 1, lambda p: None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_agent, session, fs, script)
        with contextlib.suppress(BackendRejected):
            served = await routing.route(DEFAULT, _request(stream))
            if isinstance(served, Served):
                body = await served.response.read_all()  # type: ignore[attr-defined]
    return outcomes[-1], body


def _streamed(head_after: float, tokens: int, gap: float) -> list[tuple[float, Any]]:
    script: list[tuple[float, Any]] = [(head_after, lambda i: m.response_head(i, 200, {}))]
    script += [(gap, lambda i: m.response_chunk(i, b"data: x\n\n"))] * tokens
    script.append((0.0, lambda i: m.response_end(i)))
    return script


async def test_stream_srtt_sample_ends_at_the_response_head(autojump_clock: Any) -> None:
    link, session, fs, peer = _link()
    started = trio.current_time()
    # Head after 250 ms, then 20 tokens 100 ms apart: the stream lasts 2.25 s.
    result, body = await _forward(link, session, fs, peer, True, _streamed(0.25, 20, 0.1))
    assert isinstance(result, AgentResponse)
    assert body == b"data: x\n\n" * 20
    assert trio.current_time() - started == pytest.approx(2.25)
    assert peer.stats.srtt_ms == pytest.approx(250.0)
    assert peer.stats.rttvar_ms == pytest.approx(125.0)
    assert (peer.stats.successes, peer.stats.consecutive_failures) == (1, 0)
    assert peer.active == 0

    # A non-streamed answer's head comes when the engine is done: 1 s here.
    whole = [
        (1.0, lambda i: m.response_head(i, 200, {})),
        (0.0, lambda i: m.response_chunk(i, b"{}")),
        (0.0, lambda i: m.response_end(i)),
    ]
    result, body = await _forward(link, session, fs, peer, False, whole)
    assert isinstance(result, AgentResponse)
    assert body == b"{}"
    # RTTVAR = 0.75 * 125 + 0.25 * 750 = 281.25; SRTT = 0.875 * 250 + 0.125 * 1000 = 343.75
    assert peer.stats.srtt_ms == pytest.approx(343.75)
    assert peer.stats.rttvar_ms == pytest.approx(281.25)
    assert metric_value(peer, "srtt", trio.current_time()) == pytest.approx(343.75)


async def test_link_outcomes_feed_success_rate_and_failure_streak(autojump_clock: Any) -> None:
    link, session, fs, peer = _link()
    ok = _streamed(0.01, 1, 0.01)
    overloaded = [
        (0.02, lambda i: m.response_head(i, 503, {})),
        (0.0, lambda i: m.response_chunk(i, b'{"error":"busy"}')),
        (0.0, lambda i: m.response_end(i)),
    ]
    unreachable = [(0.03, lambda i: m.error(i, "backend_unavailable", "engine unreachable"))]
    too_long = [
        (0.01, lambda i: m.response_head(i, 400, {})),
        (0.0, lambda i: m.response_chunk(i, b"maximum context length is 4096 tokens")),
        (0.0, lambda i: m.response_end(i)),
    ]
    await _forward(link, session, fs, peer, True, ok)
    assert (peer.stats.success_rate, peer.stats.consecutive_failures) == (1.0, 0)

    result, _ = await _forward(link, session, fs, peer, False, overloaded)
    assert isinstance(result, ForwardFailure)
    assert (peer.stats.successes, peer.stats.failures, peer.stats.consecutive_failures) == (
        1,
        1,
        1,
    )
    result, _ = await _forward(link, session, fs, peer, False, unreachable)
    assert isinstance(result, ForwardFailure)
    assert peer.stats.consecutive_failures == 2
    assert peer.stats.success_rate == pytest.approx(1 / 3)

    # The client's own mistake says nothing about the agent: neither success nor failure.
    result, _ = await _forward(link, session, fs, peer, False, too_long)
    assert isinstance(result, ForwardFailure)
    assert result.code == "context_length_exceeded"
    assert (peer.stats.successes, peer.stats.failures, peer.stats.consecutive_failures) == (
        1,
        2,
        2,
    )

    # Nor when the agent itself reports a request-level code in an error frame.
    refused = [(0.01, lambda i: m.error(i, "invalid_parameter", "n must be at least 1"))]
    result, _ = await _forward(link, session, fs, peer, False, refused)
    assert isinstance(result, ForwardFailure)
    assert result.code == "invalid_parameter"
    assert (peer.stats.successes, peer.stats.failures, peer.stats.consecutive_failures) == (
        1,
        2,
        2,
    )

    await _forward(link, session, fs, peer, False, ok)
    assert peer.stats.consecutive_failures == 0
    assert peer.stats.success_rate == pytest.approx(2 / 4)
    assert peer.active == 0


# --- heartbeats, freshness and the per-agent gauges ------------------------------------

ENGINE = {
    "kv_cache_utilization": 0.91,
    "running_requests": 3,
    "waiting_requests": 0,
    "avg_ttft_seconds": 0.2,
    "p90_ttft_seconds": None,
    "avg_itl_seconds": 0.03,
    "p90_itl_seconds": None,
}
HARDWARE = {
    "gpu_temperature_c": None,
    "gpu_util_percent": None,
    "gpu_vram_used_percent": None,
    "memory_used_percent": 0.5,
    "cpu_usage_percent": 0.25,
}


def _heartbeat(engine_age: float, hardware_age: float) -> dict:
    engine = {**ENGINE, "age": engine_age, "interval": 0.5}
    hardware = {**HARDWARE, "age": hardware_age, "interval": 2.0}
    return m.heartbeat(0.0, True, engine, hardware)


async def test_values_older_than_three_sample_periods_are_missing(autojump_clock: Any) -> None:
    link, _, _, peer = _link()
    link.heartbeat(peer, _heartbeat(engine_age=0.2, hardware_age=1.0))
    now = trio.current_time()
    assert peer.engine_at == pytest.approx(now - 0.2)
    assert peer.hardware_at == pytest.approx(now - 1.0)
    assert metric_value(peer, "kv_cache_utilization", now) == pytest.approx(0.91)
    assert metric_value(peer, "p90_ttft_seconds", now) is None  # reported missing
    assert metric_value(peer, "memory_used_percent", now) == pytest.approx(0.5)
    view = agent_view(peer, now)
    assert view["engine"]["kv_cache_utilization"] == pytest.approx(0.91)
    assert view["engine"]["age_seconds"] == pytest.approx(0.2)
    assert view["hardware"]["age_seconds"] == pytest.approx(1.0)
    assert view["hardware"]["gpu_temperature_c"] is None
    # Upstream's nested objects beside the flat fields, in percent as upstream shows them.
    assert view["hardware"]["cpu"] == {"usage_percent": 25.0}
    assert view["hardware"]["memory"]["used_percent"] == 50.0
    assert view["hardware"]["timestamp"].endswith("Z")

    # Engine limit 3 x 0.5 s = 1.5 s from the sample: 1.2 s after this heartbeat it is
    # 1.4 s old and counts; at 1.6 s old it no longer does. Hardware: 3 x 2 s.
    await trio.sleep(1.2)
    assert metric_value(peer, "kv_cache_utilization", trio.current_time()) is not None
    await trio.sleep(0.2)
    now = trio.current_time()
    assert metric_value(peer, "kv_cache_utilization", now) is None
    assert metric_value(peer, "running_requests", now) is None
    assert metric_value(peer, "cpu_usage_percent", now) == pytest.approx(0.25)
    view = agent_view(peer, now)
    assert view["engine"]["kv_cache_utilization"] is None
    assert view["engine"]["age_seconds"] == pytest.approx(1.6)
    await trio.sleep(4.5)
    assert metric_value(peer, "cpu_usage_percent", trio.current_time()) is None

    # A heartbeat whose values are old already (the agent's scrapes are failing) is not
    # made fresh by arriving: the age the agent reports counts.
    link.heartbeat(peer, _heartbeat(engine_age=2.0, hardware_age=0.0))
    now = trio.current_time()
    assert metric_value(peer, "kv_cache_utilization", now) is None
    assert metric_value(peer, "cpu_usage_percent", now) == pytest.approx(0.25)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    out = {}
    for family in registry.collect():
        for sample in family.samples:
            out[(sample.name, sample.labels.get("peer_id", ""))] = sample.value
    return out


async def test_per_agent_gauges(autojump_clock: Any) -> None:
    link, _, _, peer = _link()
    ollama = _peer("12D3KooWOllama", capacity=8, engine="ollama")
    link.table.add(ollama)
    registry = CollectorRegistry()
    AgentCollector(link.table, registry)

    link.heartbeat(peer, _heartbeat(engine_age=0.1, hardware_age=0.1))
    link.heartbeat(ollama, m.heartbeat(0.0, False, {}, {**HARDWARE, "age": 0.0}))
    peer.active = 1
    peer.stats.record_rtt(250.0)
    peer.stats.record_success(probe=False)
    peer.stats.record_failure(now=trio.current_time(), cooldown=30.0)

    p = "hivenet_router_agent_"
    got = _samples(registry)
    a, o = peer.peer_id, ollama.peer_id
    assert got[(p + "active_requests", a)] == 1.0
    assert got[(p + "capacity", a)] == 4.0
    assert got[(p + "capacity_utilization", a)] == 0.25
    assert got[(p + "success_rate", a)] == 0.5
    assert got[(p + "srtt_seconds", a)] == 0.25
    assert got[(p + "consecutive_failures", a)] == 1.0
    assert got[(p + "healthy", a)] == 1.0
    assert got[(p + "backend_healthy", a)] == 1.0
    assert got[(p + "kv_cache_utilization", a)] == pytest.approx(0.91)
    assert got[(p + "running_requests", a)] == 3.0
    assert got[(p + "avg_ttft_seconds", a)] == pytest.approx(0.2)
    assert got[(p + "memory_used_percent", a)] == pytest.approx(0.5)
    assert got[(p + "engine_age_seconds", a)] == pytest.approx(0.1)
    # Missing is no sample, never zero.
    for name in ("p90_ttft_seconds", "gpu_temperature_c", "gpu_util_percent"):
        assert (p + name, a) not in got
    for name in ("kv_cache_utilization", "engine_age_seconds", "success_rate", "srtt_seconds"):
        assert (p + name, o) not in got
    assert (p + "consecutive_failures", o) not in got
    assert got[(p + "backend_healthy", o)] == 0.0
    assert got[(p + "capacity_utilization", o)] == 0.0
    assert got[(p + "cpu_usage_percent", o)] == pytest.approx(0.25)

    # Stale engine values leave the gauges as they leave the gates; the age stays.
    await trio.sleep(2.0)
    got = _samples(registry)
    assert (p + "kv_cache_utilization", a) not in got
    assert got[(p + "engine_age_seconds", a)] == pytest.approx(2.1)

    text = generate_latest(registry).decode()
    assert f'{p}srtt_seconds{{engine="sim",model="m1",peer_id="{a}"}} 0.25' in text
    assert "# TYPE hivenet_router_agent_kv_cache_utilization gauge" in text
    # The agent's latencies cover its engine's last 30 s (agent/engines/base.py
    # LATENCY_WINDOW), not one sample period.
    for name in ("avg_ttft_seconds", "p90_ttft_seconds", "avg_itl_seconds", "p90_itl_seconds"):
        assert re.search(rf"# HELP {p}{name} .* over the engine's last 30 s\n", text), name


def test_gauges_scraped_outside_trio_skip_what_needs_the_clock() -> None:
    table = PeerTable()
    peer = _peer()
    peer.engine = dict(ENGINE)
    peer.engine_at = 1.0
    table.add(peer)
    registry = CollectorRegistry()
    AgentCollector(table, registry)
    got = _samples(registry)
    assert ("hivenet_router_agent_active_requests", peer.peer_id) in got
    assert ("hivenet_router_agent_kv_cache_utilization", peer.peer_id) not in got


async def test_agent_and_backend_failures_count_transitions(autojump_clock: Any) -> None:
    """Upstream's lifetime failure counts: the router finding the agent silent past
    --unhealthy-after, and the agent's heartbeat turning its engine unhealthy; each
    counted once per fall, in the routing table and on /metrics."""
    link, _, _, peer = _link()
    registry = CollectorRegistry()
    AgentCollector(link.table, registry)
    down = m.heartbeat(0.0, False, {}, {})
    up = m.heartbeat(0.0, True, {}, {})
    for msg in (down, down, up, down, up, up):
        link.heartbeat(peer, msg)
    assert peer.stats.backend_failures == 2
    await trio.sleep(16)  # past --unhealthy-after
    link._sweep_table(trio.current_time())
    link._sweep_table(trio.current_time())
    assert not peer.healthy and peer.stats.agent_failures == 1
    link.heartbeat(peer, up)
    await trio.sleep(16)
    link._sweep_table(trio.current_time())
    universal = agent_view(peer, trio.current_time())["universal"]
    assert (universal["agent_failures_total"], universal["backend_failures_total"]) == (2, 2)
    got = _samples(registry)
    assert got[("hivenet_router_agent_failure_total", peer.peer_id)] == 2
    assert got[("hivenet_router_agent_backend_failure_total", peer.peer_id)] == 2


async def test_the_engines_upstream_histograms_are_kept_only_with_metrics_compat(
    autojump_clock: Any,
) -> None:
    """Only `--metrics-compat upstream` reads `engine.upstream`: without it a heartbeat's
    histograms are not checked per heartbeat for nothing."""
    upstream = {"finish_reasons": {"stop": 3}, "predicted_tps": 41.5}
    msg = m.heartbeat(0.0, True, {**ENGINE, "age": 0.0, "upstream": upstream}, HARDWARE)
    link, _, _, peer = _link()
    link.heartbeat(peer, msg)
    assert peer.engine_upstream == {}
    link.settings.engine_upstream = True
    link.heartbeat(peer, msg)
    assert peer.engine_upstream == {"finish_reasons": {"stop": 3}, "predicted_tps": 41.5}
