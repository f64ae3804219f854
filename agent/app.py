"""The agent daemon: engine probes, samplers and one session per router."""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import Any

import httpx
import trio
from libp2p import new_host
from libp2p.network.config import ConnectionConfig

from agent.capacity import SharedCapacity
from agent.engine_http import EnginePool, EngineTimeouts, MetricsPage
from agent.engines import EngineEndpoints, HealthTracker, get_adapter
from agent.engines.endpoints import MissingRoutes
from agent.hardware import HardwareSampler
from agent.http_proxy import dial_through_http_proxy
from agent.link import (
    RouterConnection,
    RouterSession,
    Status,
    hello_for,
    parse_router_address,
)
from agent.settings import AgentSettings
from protocol.logs import label_lines, quote
from protocol.messages import VERSION
from protocol.p2p import load_or_create_identity, peer_id_of, tune_libp2p
from protocol.router_proof import new_challenge, proof_valid
from protocol.sdnotify import sd_notify
from protocol.tracing import tracer_from_env

log = logging.getLogger("agent")

# Workers added from welcomes, over the agent's life, at most (router --workers allows 64
# per host): a router that names new ones on every welcome cannot grow this list.
MAX_WORKERS = 64
# Seconds between health checks of an engine never yet seen answering (at most the
# heartbeat interval).
STARTING_PROBE_INTERVAL = 1.0
# Seconds between health checks of an engine that has answered (at most the heartbeat
# interval): the Go agent's cadence, so three failed checks in a row, a fault, are
# reported within about 6 s, not three heartbeats.
PROBE_INTERVAL = 2.0


async def _tick(next_at: float, interval: float) -> float:
    """Sleep until the next period starts; returns its start.

    Periods are kept on a fixed schedule, so a slow scrape does not stretch the sample
    period the router's freshness limit is computed from; after an overrun the next
    period starts at once, and missed ones are not made up in a burst.
    """
    next_at += interval
    now = trio.current_time()
    if next_at < now:
        next_at = now
    await trio.sleep_until(next_at)
    return next_at


class AgentDaemon:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.adapter = get_adapter(settings.engine)
        self.key_pair = load_or_create_identity(settings.identity_path)
        self.peer_id = str(peer_id_of(self.key_pair))
        label_lines(peer_id=self.peer_id)
        self.status = Status(
            engine_interval=settings.engine_sample_interval,
            hardware_interval=settings.hardware_sample_interval,
            changed=trio.Event(),
        )
        self.hardware = HardwareSampler(settings.gpu_devices)
        self.health = HealthTracker()
        self.connections: list[RouterConnection] = []
        self.capacity = SharedCapacity(settings.capacity)
        # The API paths the engine said it has no route for (agent/engines/endpoints.py).
        self.missing = MissingRoutes()
        self.endpoints: EngineEndpoints | None = None
        self.model = settings.model
        self.sim_app: Any = None
        self.tracer = tracer_from_env("hivenet-agent")
        self._dial: tuple[Any, trio.Nursery, Any] | None = None

    def metadata(self) -> dict:
        s = self.settings
        return {
            "model": self.model,
            "capability": s.capability,
            "engine": s.engine,
            "capacity": s.capacity,
            "region": s.region,
            "organization": s.organization,
            "machine": s.machine,
            "gpu_model": s.gpu_model or self.hardware.gpu_model() or "",
            "tags": list(s.tags),
            "version": s.version or VERSION,
            # The Go router's registration fields (its --deployment-id and friends).
            "deployment_id": s.deployment_id,
            "replica_id": s.replica_id,
            "hide_llm": s.hide_llm,
            "llm_pretty_name": s.llm_pretty_name,
            "llm_info": s.llm_info,
        }

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        s = self.settings
        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(5.0), trust_env=False) as probe,
            trio.open_nursery() as nursery,
        ):
            backend_url = s.backend_url
            if s.engine == "sim":
                backend_url = await self._start_sim(nursery)
            ep = self.endpoints = self.adapter.endpoints(backend_url, s.health_url, s.metrics_url)
            timeouts = EngineTimeouts(connect=min(10.0, s.http_timeout), read=s.http_timeout)
            # The engine is never asked through HTTP(S)_PROXY, which names the agent's way
            # out to its routers (agent/http_proxy.py).
            engine = EnginePool(ep.backend_url, timeouts, s.capacity)
            engine.kind = s.engine
            nursery.start_soon(engine.tidy)
            nursery.start_soon(engine.run_pump)
            if not self.model:
                self.model = await self._discover(probe, ep)
            await self._probe_health(probe, ep)
            nursery.start_soon(self._health_loop, probe, ep)
            nursery.start_soon(self._engine_loop, ep)
            nursery.start_soon(self._hardware_loop)
            if self.tracer.enabled:
                nursery.start_soon(self.tracer.run)
            tune_libp2p()
            websocket = any("/ws" in r for r in s.routers)
            host = new_host(
                key_pair=self.key_pair,
                listen_addrs=[],
                enable_websocket=websocket,
                connection_config=ConnectionConfig(max_connections_per_peer=1),
            )
            if websocket:
                dial_through_http_proxy(host, s.proxy)
            async with host.run(listen_addrs=[]), engine:

                def make_session(address: str) -> Any:
                    return lambda stream: self._session(stream, engine, ep, address)

                self._dial = (host, nursery, make_session)
                for address in s.routers:
                    conn = RouterConnection(host, address, make_session(address))
                    self.connections.append(conn)
                    nursery.start_soon(conn.run)
                log.info(
                    "agent_started peer_id=%s model=%s engine=%s backend=%s routers=%d",
                    self.peer_id,
                    quote(self.model),
                    s.engine,
                    ep.backend_url,
                    len(s.routers),
                )
                sd_notify("READY=1")
                task_status.started()
                await self._until_terminated()
                await self._drain()
                await self.tracer.flush()
                nursery.cancel_scope.cancel()

    def _session(
        self, stream: Any, engine: EnginePool, ep: EngineEndpoints, address: str
    ) -> RouterSession:
        s = self.settings
        pinned = parse_router_address(address).pinned
        challenge = new_challenge()
        router_peer_id = str(stream.muxed_conn.peer_id)

        def check_welcome(welcome: dict) -> str | None:
            """A router dialed by address alone must prove the secret; a pinned one
            may, and a wrong proof is refused either way."""
            proof = welcome.get("proof")
            if proof is None and pinned:
                return None
            if proof_valid(s.jwt_secret, router_peer_id, self.peer_id, challenge, proof):
                return None
            return (
                f"router {router_peer_id} did not prove the shared secret"
                " (a different HIVENET_ROUTER_JWT_SECRET, or not the operator's router)"
            )

        return RouterSession(
            stream,
            hello_for(s.jwt_secret, self.peer_id, self.metadata(), challenge),
            self.status,
            engine,
            s.heartbeat_interval,
            s.stream_write_timeout,
            check_welcome,
            tracer=self.tracer,
            capacity=self.capacity,
            on_workers=lambda workers: self._dial_workers(address, workers),
            serves=self.missing.serving(self.adapter.serves),
            missing=self.missing.learn,
        )

    def _dial_workers(self, via: str, workers: list) -> None:
        """Keep a session with each of the router host's other workers too, dialled at
        the host of `via` (the address that welcomed us) on each worker's TCP port."""
        if self._dial is None:
            return
        host, nursery, make_session = self._dial
        prefix = via.split("/tcp/")[0]
        known = {c.address for c in self.connections}
        known_peers = {str(c.router.peer_id) for c in self.connections if c.router.pinned}
        for entry in workers:
            if len(self.connections) >= len(self.settings.routers) + MAX_WORKERS:
                log.warning("router_workers_ignored reason=%s", quote("too many workers"))
                return
            port = entry.get("tcp_port") if isinstance(entry, dict) else None
            peer = entry.get("peer_id") if isinstance(entry, dict) else None
            if not (isinstance(port, int) and 0 < port < 65536 and isinstance(peer, str)):
                log.warning("router_worker_ignored entry=%s", quote(repr(entry)[:200]))
                continue
            address = f"{prefix}/tcp/{port}/p2p/{peer}"
            if address in known or peer in known_peers:
                continue
            try:
                parse_router_address(address)
            except ValueError as exc:
                log.warning("router_worker_ignored entry=%s", quote(str(exc)[:200]))
                continue
            conn = RouterConnection(host, address, make_session(address))
            self.connections.append(conn)
            known.add(address)
            known_peers.add(peer)
            log.info("router_worker_added router=%s via=%s", address, via)
            nursery.start_soon(conn.run)

    async def _start_sim(self, nursery: trio.Nursery) -> str:
        from sim.__main__ import serve_sim
        from sim.app import create_sim_app

        s = self.settings
        self.sim_app = create_sim_app(
            s.model or "sim-model",
            token_latency=s.sim_token_latency,
            ttft=s.sim_ttft,
            capacity=max(64, s.capacity),
        )
        port = await nursery.start(serve_sim, self.sim_app, "127.0.0.1", s.sim_port)
        log.info("sim_engine_listening url=http://127.0.0.1:%d", port)
        return f"http://127.0.0.1:{port}"

    async def _discover(self, probe: httpx.AsyncClient, ep: EngineEndpoints) -> str:
        said = False
        while True:
            try:
                model = await self.adapter.discover_model(probe, ep)
            except Exception as exc:  # engines fail in many ways while starting
                model = None
                log.warning("model_discovery_failed error=%s", quote(repr(exc)))
            if model:
                log.info("model_discovered model=%s", quote(model))
                return model
            if not said:
                # Once: an engine still loading is the common case, not an error.
                log.warning(
                    "model_discovery_pending backend=%s reason=%s",
                    ep.backend_url,
                    quote("engine unreachable or lists no model yet; retrying every 2 s"),
                )
                said = True
            await trio.sleep(2)

    async def _probe_health(self, probe: httpx.AsyncClient, ep: EngineEndpoints) -> None:
        try:
            ok = await self.adapter.check_health(probe, ep, self.model)
        except Exception:  # an engine that cannot answer is unhealthy, nothing more
            ok = False
        first = not self.health.checked
        healthy = self.health.record(ok)
        if healthy != self.status.backend_healthy or first:
            log.info("backend_health healthy=%s", healthy)
            self.status.backend_healthy = healthy
            self._changed()

    async def _health_loop(self, probe: httpx.AsyncClient, ep: EngineEndpoints) -> None:
        while True:
            # An engine still starting is taken into service within a second of its
            # first answer, not a heartbeat later.
            every = PROBE_INTERVAL if self.health.seen_healthy else STARTING_PROBE_INTERVAL
            period = min(self.settings.heartbeat_interval, every)
            await trio.sleep(period)
            await self._probe_health(probe, ep)

    async def _engine_loop(self, ep: EngineEndpoints, page: MetricsPage | None = None) -> None:
        """Scrape the engine every sample period (`page`: its metrics page, by default
        `ep.metrics_url`); only a good scrape refreshes the values.

        A failed scrape (engine down, restarting, answering 5xx or garbage) keeps the last
        values until they are three sample periods old; then they are reported as missing
        at once, so a router never trusts values the agent could not confirm.
        """
        if ep.metrics_url is None:
            return  # Ollama: no engine metrics; the fields stay missing, never zero
        sampler = self.adapter.new_sampler(self.model)
        failing = False
        next_at = trio.current_time()
        with contextlib.closing(page or MetricsPage(ep.metrics_url)) as source:
            while True:
                try:
                    values = sampler.update(await source.text(), trio.current_time())
                except Exception as exc:  # engines fail in many ways; the values age out
                    if not failing:
                        log.warning(
                            "engine_metrics_failed url=%s error=%s",
                            ep.metrics_url,
                            quote(f"{type(exc).__name__}: {exc}"),
                        )
                    failing = True
                    self._expire("engine", self.settings.engine_sample_interval)
                else:
                    if failing:
                        log.info("engine_metrics_recovered url=%s", ep.metrics_url)
                    failing = False
                    self._sampled("engine", values)
                next_at = await _tick(next_at, self.settings.engine_sample_interval)

    async def _hardware_loop(self) -> None:
        failing = False
        next_at = trio.current_time()
        while True:
            try:
                values = await trio.to_thread.run_sync(self.hardware.sample)
            except Exception as exc:  # a sampler error must not stop the agent
                if not failing:
                    log.warning("hardware_sample_failed error=%s", quote(repr(exc)))
                failing = True
                self._expire("hardware", self.settings.hardware_sample_interval)
            else:
                failing = False
                self._sampled("hardware", values)
            next_at = await _tick(next_at, self.settings.hardware_sample_interval)

    def _sampled(self, kind: str, values: dict[str, float | None]) -> None:
        """A good sample: routers hear of a change at once, of the same values with the
        next heartbeat (every frame costs both daemons CPU; an idle fleet is quiet)."""
        setattr(self.status, f"{kind}_at", trio.current_time())
        if values != getattr(self.status, kind):
            setattr(self.status, kind, values)
            self._changed()

    def _expire(self, kind: str, interval: float) -> None:
        """Values not confirmed for three sample periods are reported missing at once."""
        values = getattr(self.status, kind)
        age = trio.current_time() - getattr(self.status, f"{kind}_at")
        if values and any(v is not None for v in values.values()) and age > 3 * interval:
            setattr(self.status, kind, dict.fromkeys(values))
            self._changed()

    def _changed(self) -> None:
        """Wake the sessions' heartbeat loops so routers see new values promptly."""
        event = self.status.changed
        self.status.changed = trio.Event()
        if event is not None:
            event.set()

    async def _until_terminated(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("agent_draining signal=%s", signal.Signals(signum).name)
                return

    async def _drain(self) -> None:
        """Tell every router to stop sending, finish what is in flight, then leave.

        A request a router sent before it read the drain frame is still served. Leaving
        flushes each session: the last response frames reach the router before the
        stream closes, and a request that arrives after that fails over at the router
        (no answer had started). What outlives --drain-timeout ends at the router as
        `agent_disconnected`, an error event on a started stream.
        """
        timeout = self.settings.drain_timeout
        inflight = sum(len(c.session.requests) for c in self.connections if c.session)
        log.info("agent_drain inflight=%d routers=%d", inflight, len(self.connections))
        sd_notify(f"STOPPING=1\nSTATUS=draining {inflight} requests")
        for conn in self.connections:
            conn.stopping = True
            if conn.session is not None:
                conn.session.drain()
        with trio.move_on_after(timeout):
            for conn in self.connections:
                if conn.session is not None:
                    await conn.session.wait_idle()
        left = sum(len(c.session.requests) for c in self.connections if c.session)
        if left:
            log.warning("agent_drain_timeout inflight=%d drain_timeout_s=%g", left, timeout)
        async with trio.open_nursery() as nursery:
            for conn in self.connections:
                if conn.session is not None:
                    nursery.start_soon(conn.session.fs.flush_and_close, "agent leaving")
        log.info("agent_stopped")
