"""The peer table: one record per agent session, indexed by model.

The routing core reads it; the link writes it. Each model's pool is kept in peer-ID
order as agents join and leave, so a routing decision never sorts and ties in the
least-loaded ranking fall to the lowest peer ID, as the seeds specify.

A pool is a tuple, replaced (never changed in place) when an agent of the model joins
or leaves, so its identity is its version: the gates keep what they work out from the
agents' frozen metadata per pool and know it is still true while the pool is the same
object (router/policy/gates.py). A join or leave in a pool of 10,000 agents costs about
0.3 ms (the sorted insert already walked the pool), a seventh of one decision; joins are
rare, decisions are not.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from router.agent_detail import Gpu

UNIVERSAL_FIELDS = ("capacity_utilization", "success_rate", "srtt", "consecutive_failures")
CAPABILITIES = ("llm", "embedding", "reranker")


@dataclass(frozen=True)
class AgentMetadata:
    model: str
    capability: str
    engine: str
    capacity: int
    region: str = ""
    organization: str = ""
    machine: str = ""
    gpu_model: str = ""
    tags: tuple[str, ...] = ()
    version: str = ""
    # The Go agent's registration extras (--deployment-id, --llm-pretty-name, …).
    deployment_id: str = ""
    replica_id: str = ""
    hide_llm: bool = False
    llm_pretty_name: str = ""
    llm_info: str = ""

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "capability": self.capability,
            "engine": self.engine,
            "region": self.region,
            "organization": self.organization,
            "machine": self.machine,
            "gpu_model": self.gpu_model,
            "tags": list(self.tags),
            "capacity": self.capacity,
            "version": self.version,
            "deployment_id": self.deployment_id,
            "replica_id": self.replica_id,
            "hide_llm": self.hide_llm,
            "llm_pretty_name": self.llm_pretty_name,
            "llm_info": self.llm_info,
        }


# How long the history gates (`success_rate`, `consecutive_failures`) keep excluding an
# agent after its latest failure before one request may probe it (--failure-cooldown).
# 30 s is Envoy's outlier-detection base ejection time, and about how long a crashed
# engine takes to come back under systemd (RestartSec=5 plus loading an 8B model):
# a shorter cool-down spends probes, which are real requests, on an engine still loading.
DEFAULT_FAILURE_COOLDOWN = 30.0
HISTORY_FIELDS = ("success_rate", "consecutive_failures")


@dataclass
class UniversalStats:
    """Router-side history of one agent (RFC 6298 SRTT in milliseconds).

    The history gates exclude an agent while the router clock is before `probe_at`, a
    circuit breaker: a failure that is charged to the agent opens it for the cool-down
    (`probe_at = now + cooldown`); after that the breaker is half-open and one request,
    the probe, may reach the agent whatever its history says (`probe_at` is +inf while
    it runs, so no second one follows); the probe's success closes the breaker
    (`probe_at = -inf`: the history gates wait for the next failure) and its failure
    re-opens it. +inf is also the start: history recorded by other means than a failure
    (a record built by hand) is judged as it stands.
    """

    successes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    srtt_ms: float | None = None
    rttvar_ms: float | None = None
    # Lifetime counts kept by router/lifetime.py across restarts: tokens as the engine
    # reported them, answers the engine refused (4xx), sessions that ended.
    input_tokens: int = 0
    output_tokens: int = 0
    rejections: int = 0
    disconnections: int = 0
    # Upstream's lifetime failure counts: times the router found the agent silent past
    # --unhealthy-after, and times the agent's heartbeat said its engine went unhealthy.
    agent_failures: int = 0
    backend_failures: int = 0
    probe_at: float = math.inf

    @property
    def success_rate(self) -> float | None:
        total = self.successes + self.failures
        return self.successes / total if total else None

    def record_rtt(self, sample_ms: float) -> None:
        if self.srtt_ms is None or self.rttvar_ms is None:
            self.srtt_ms = sample_ms
            self.rttvar_ms = sample_ms / 2
        else:
            self.rttvar_ms = 0.75 * self.rttvar_ms + 0.25 * abs(self.srtt_ms - sample_ms)
            self.srtt_ms = 0.875 * self.srtt_ms + 0.125 * sample_ms

    def record_success(self, probe: bool) -> None:
        self.successes += 1
        self.consecutive_failures = 0
        if probe:
            self.probe_at = -math.inf

    def record_failure(self, now: float, cooldown: float) -> None:
        """A failure the agent is to blame for; client-caused ones are never recorded."""
        self.failures += 1
        self.consecutive_failures += 1
        self.probe_at = now + cooldown

    def history_gated(self, now: float) -> bool:
        """Whether the history gates judge this agent now (the breaker is not letting a
        probe through, or is not closed)."""
        return now < self.probe_at

    def half_open(self, now: float) -> bool:
        """The cool-down after a failure has passed and no probe is running."""
        return -math.inf < self.probe_at <= now

    def start_probe(self) -> float:
        """Hold the breaker while a probe runs; returns what `end_probe` restores."""
        held = self.probe_at
        self.probe_at = math.inf
        return held

    def end_probe(self, held: float) -> None:
        """A probe that ended with no verdict on the agent (the client's error, a broken
        link, a cancelled request): half-open again, unless a failure re-opened it."""
        if self.probe_at == math.inf:
            self.probe_at = held

    def record_tokens(self, prompt: int, completion: int) -> None:
        self.input_tokens += prompt
        self.output_tokens += completion

    def reset(self) -> None:
        """POST /admin/metrics/reset: back to an agent never seen."""
        for name, value in vars(UniversalStats()).items():
            setattr(self, name, value)


@dataclass(eq=False)
class Peer:
    """One agent session. `send` writes a link message to that agent's stream."""

    peer_id: str
    metadata: AgentMetadata
    send: Callable[[dict], Awaitable[None]]
    connected_at: float
    last_seen: float
    healthy: bool = True
    backend_healthy: bool = True
    draining: bool = False
    connected: bool = True
    # The agent's whole load as this router sees it: its own requests on the agent plus
    # `elsewhere`, what the agent last said the other routers hold (router/capacity.py).
    active: int = 0
    elsewhere: int = 0
    # Latest engine and hardware values in policy units; None = not reported.
    engine: dict[str, float | None] = field(default_factory=dict)
    hardware: dict[str, float | None] = field(default_factory=dict)
    # Router clock time each snapshot was taken, and the agent's sampling period.
    engine_at: float = 0.0
    hardware_at: float = 0.0
    engine_interval: float = 0.5
    hardware_interval: float = 2.0
    stats: UniversalStats = field(default_factory=UniversalStats)
    # Heartbeat values no gate reads (router/agent_detail.py), of the same snapshots.
    gpus: tuple[Gpu, ...] = ()
    memory: dict[str, float | None] = field(default_factory=dict)
    preemptions: float | None = None
    # The engine's histograms, finish reasons and throughputs for upstream's series
    # (router/agent_detail.py upstream_of); empty unless the agent sends them.
    engine_upstream: dict = field(default_factory=dict)
    # `host:port` the router saw the agent's connection come from (a NAT's, a proxy's).
    remote_addr: str = ""
    # API paths its engine answered `endpoint_not_supported` for → until when (router
    # clock) the router sends them elsewhere without asking (router/session.py).
    lacks: dict[str, float] = field(default_factory=dict)

    def lacks_path(self, path: str, now: float) -> bool:
        until = self.lacks.get(path) if self.lacks else None
        return until is not None and until > now

    @property
    def capacity(self) -> int:
        return self.metadata.capacity

    @property
    def load_ratio(self) -> float:
        return self.active / self.metadata.capacity

    @property
    def routable(self) -> bool:
        """Gate 2: the agent, its link and its backend are all healthy."""
        return self.healthy and self.backend_healthy and self.connected and not self.draining


class PeerTable:
    def __init__(self) -> None:
        self._by_id: dict[str, Peer] = {}
        self._by_model: dict[str, tuple[Peer, ...]] = {}
        # Every model an agent has registered since the router started: the names a
        # metric may carry (a client's own name for a model is not one).
        self._registered: set[str] = set()
        self._listeners: list[Callable[[str], None]] = []
        self._removed: list[Callable[[str], None]] = []

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, peer_id: str) -> Peer | None:
        return self._by_id.get(peer_id)

    def all(self) -> list[Peer]:
        return list(self._by_id.values())

    def models(self) -> list[str]:
        return sorted(m for m, peers in self._by_model.items() if peers)

    def for_model(self, model: str) -> tuple[Peer, ...]:
        """Gate 1's pool, in peer-ID order."""
        return self._by_model.get(model, ())

    def registered(self, model: str) -> bool:
        """An agent has registered `model` since the router started (it may be gone)."""
        return model in self._registered

    def add(self, peer: Peer) -> Peer | None:
        """Insert `peer`; returns the record it replaced when the peer reconnected."""
        old = self._by_id.get(peer.peer_id)
        if old is not None:
            self.remove(old)
        self._by_id[peer.peer_id] = peer
        model = peer.metadata.model
        self._registered.add(model)
        peers = self._by_model.get(model, ())
        at = bisect.bisect([p.peer_id for p in peers], peer.peer_id)
        self._by_model[model] = (*peers[:at], peer, *peers[at:])
        self.changed(model)
        return old

    def remove(self, peer: Peer) -> bool:
        """Remove this exact session; a newer session of the same peer stays."""
        if self._by_id.get(peer.peer_id) is not peer:
            return False
        del self._by_id[peer.peer_id]
        peer.connected = False
        model = peer.metadata.model
        peers = tuple(p for p in self._by_model.get(model, ()) if p is not peer)
        if peers:
            self._by_model[model] = peers
        else:
            self._by_model.pop(model, None)
        self.changed(model)
        for listener in self._removed:
            listener(peer.peer_id)
        return True

    def on_change(self, listener: Callable[[str], None]) -> None:
        """Call `listener(model)` whenever that model's pool may have gained room."""
        self._listeners.append(listener)

    def on_remove(self, listener: Callable[[str], None]) -> None:
        """Call `listener(peer_id)` when an agent's session leaves the table."""
        self._removed.append(listener)

    def changed(self, model: str) -> None:
        for listener in self._listeners:
            listener(model)
