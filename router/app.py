"""The router daemon: p2p host, HTTP API, metrics and signals in one trio nursery."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import Any

import multiaddr
import redis
import trio

from protocol.collector import Freezer
from protocol.logs import quote
from protocol.messages import PROTOCOL_ID
from protocol.p2p import load_or_create_identity, peer_id_of
from protocol.sdnotify import sd_notify
from protocol.secrets import load_previous_secret, load_secret
from protocol.tracing import tracer_from_env
from router import state_url
from router.admission.control import Admission
from router.admission.crosscheck import below_serverless_cap
from router.admission.idle import sweep_idle
from router.admission.limits import AdmitSettings
from router.admission.shared import SharedAdmission
from router.agent_metrics import AgentCollector
from router.capacity import WaitQueue
from router.dispatch import Dispatcher
from router.fleet.config_sync import CALL_TIMEOUT, ConfigSync
from router.fleet.view import FleetView
from router.forward_limit import ForwardLimit
from router.http.app import RouterApp, metrics_only, protocol_of, with_lifespan
from router.http.auth import AdminKeys
from router.http.client import ClientApi, ClientSettings
from router.http.client_ip import TrustedProxies
from router.http.console_setup import console_for, story_capture
from router.http.server import HttpServer
from router.lifetime import LifetimeStore, history_path
from router.link import AgentLink, LinkSettings
from router.loop_watch import LoopWatch
from router.metrics import RouterMetrics
from router.metrics_page import metrics_page
from router.p2p_host import check_listening, close_listeners, router_host
from router.peers import Peer, PeerTable
from router.policy.describe import policy_warnings
from router.policy.rank import Ranking
from router.policy.schema import Policy
from router.policy.store import PolicyStore
from router.providers import ProviderClient
from router.registrations import RegistrationFeed
from router.session import RoutingSession
from router.settings import RouterSettings, read_admin_keys
from router.tenants.gate import GateSettings, TenantGate
from router.tenants.keys import ClientKeys
from router.tenants.registry import KeyRegistry, RegistryFile, registry_path
from router.tls import server_context
from router.unjoined import UnjoinedLimits
from router.upstream_metrics import MODE as COMPAT_MODE
from router.upstream_metrics import Activity, UpstreamCollector, counted

log = logging.getLogger("router")

# After --drain-timeout the router closes its agent sessions, so every request still in
# flight ends with a clear error (an error event on a started stream, a 503 otherwise);
# this is how long those answers get to reach their clients before HTTP stops.
DRAIN_CUT_GRACE = 5.0


def listen_multiaddrs(settings: RouterSettings) -> list[multiaddr.Multiaddr]:
    addrs = [multiaddr.Multiaddr(f"/ip4/{settings.p2p_listen_addr}/tcp/{settings.p2p_port}")]
    if settings.p2p_ws_port:
        ws = f"/ip4/{settings.p2p_listen_addr}/tcp/{settings.p2p_ws_port}/ws"
        addrs.append(multiaddr.Multiaddr(ws))
    if settings.p2p_wss_port:
        wss = f"/ip4/{settings.p2p_listen_addr}/tcp/{settings.p2p_wss_port}/wss"
        addrs.append(multiaddr.Multiaddr(wss))
    return addrs


# Keep-alive as load balancers expect (longer than their own idle timeouts); on stop,
# requests still open after the drain get this long before HTTP closes.
KEEP_ALIVE_TIMEOUT = 75.0
GRACEFUL_TIMEOUT = 1.0
# A worker started again waits for its agents before it opens the shared HTTP port:
# agents redial within their 5 s backoff cap, so 15 s in all is ample; it opens once
# no agent has joined for 1 s.
AGENTS_WAIT = 15.0
AGENTS_SETTLE = 1.0
# The drain waits for what was accepted, or begun, this recently and is not done yet.
ARRIVING = 2.0


class RouterDaemon:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        self.freezer = Freezer()
        self.table = PeerTable()
        agent_collector = self.agent_collector = AgentCollector(self.table, self.metrics.registry)
        self.queue = WaitQueue(settings.queue_depth)
        self.table.on_change(self.queue.notify)
        self.store = PolicyStore(self.metrics, settings.policy_file, settings.policy_model_dir)
        self.key_pair = load_or_create_identity(settings.identity_path)
        self.peer_id = str(peer_id_of(self.key_pair))
        self.tls_context = (
            server_context(settings.tls_cert_file, settings.tls_key_file)
            if settings.p2p_wss_port and settings.tls_cert_file and settings.tls_key_file
            else None
        )
        self.registrations = RegistrationFeed()
        self.tracer = tracer_from_env("hivenet-router")
        self.lifetime = LifetimeStore(
            history_path(settings),
            self.table,
            interval=settings.universal_flush_interval,
            ttl_days=settings.disk_db_ttl,
            reset=settings.reset_disk_db,
        )
        self.lifetime.load()
        self.link = AgentLink(
            self.table,
            self.metrics,
            LinkSettings(
                secret=settings.jwt_secret,
                heartbeat_interval=settings.heartbeat_interval,
                unhealthy_after=settings.unhealthy_after,
                remove_after=settings.remove_after,
                router_peer_id=self.peer_id,
                release_stream_slot_at_head=settings.stream_slot_release == "head",
                health_check_interval=settings.health_check_interval,
                unjoined=UnjoinedLimits(per_address=settings.max_unjoined_per_ip),
                workers=settings.workers,
                previous_secret=settings.jwt_secret_previous,
                engine_upstream=settings.metrics_compat == COMPAT_MODE,
            ),
            self.registrations,
            self.lifetime,
        )
        self.ranking = Ranking()
        self.table.on_remove(self.ranking.forget)
        self.session = RoutingSession(
            self.table,
            self.queue,
            self.metrics,
            self.link.forward,
            settings.max_tries_per_step,
            self._released,
            settings.failure_cooldown,
            self.ranking,
        )
        self.providers = ProviderClient(
            settings.openai_api_key,
            settings.anthropic_api_key,
            settings.openai_base_url,
            settings.anthropic_base_url,
        )
        self.dispatcher = Dispatcher(
            self.table,
            self.session,
            self.store,
            self.metrics,
            provider_call=self.providers,
            provider_available=self.providers.available,
            limit=ForwardLimit(settings.max_concurrent, settings.queue_size),
        )
        self._warn_about_policy(self.store.current, None)
        for name, named in self.store.models.named.items():
            self._warn_about_policy(named.policy, name)
        self.store.listeners.append(self._warn_about_policy)
        self.client = ClientApi(
            self.dispatcher,
            self.table,
            self.metrics,
            ClientSettings(
                settings.max_request_bytes, settings.request_timeout, settings.idempotency_window
            ),
        )
        self.admission = Admission(
            AdmitSettings(settings.admit_fraction, settings.admit_park_timeout),
            self.metrics,
            self._healthy_replicas,
            label=self.dispatcher.model_label,
        )
        self.client.admission = self.admission
        self.tenants = TenantGate(
            GateSettings(
                auth_file=settings.auth_file,
                state_url=settings.state_url,
                audit_log=settings.audit_log,
                audit_log_max_bytes=settings.audit_log_max_bytes,
                audit_log_backups=settings.audit_log_backups,
                lease=settings.request_timeout + 60.0,
                rpm_burst_seconds=settings.rpm_burst_seconds,
            ),
            ClientKeys(settings.client_api_keys),
            self.metrics,
        )
        self.tenants.replicas = self._quota_replicas
        if self.tenants.state.client is not None:
            lease = settings.request_timeout + 60.0
            self.admission.shared = SharedAdmission(self.tenants.state, lease)
        auth = self.tenants.store.current
        # Upstream's dynamic mode: the auth file says so, or the variable without a file.
        dynamic = auth.dynamic if auth is not None else settings.auth_mode == "dynamic"
        if dynamic:
            if not settings.admin_api_keys:
                raise ValueError(
                    "dynamic mode needs HIVENET_ROUTER_ADMIN_API_KEYS: /admin/api-keys holds"
                    " the client keys"
                )
            saved = RegistryFile(registry_path(history_path(settings)))
            self.tenants.registry = KeyRegistry(self.metrics, saved, settings.rpm_burst_seconds)
            self.tenants.registry.policies = self.store.caps
        # Upstream's cross-config check, now and on every change of either side.
        self.store.cross_check = lambda caps: below_serverless_cap(self.tenants.config, caps)
        self.tenants.store.cross_check = lambda config: below_serverless_cap(
            config, self.store.caps()
        )
        broken = below_serverless_cap(self.tenants.config, self.store.caps())
        if broken:
            raise ValueError("keys and policies disagree: " + "; ".join(broken))
        if auth is not None and auth.admin_mode == "api-key" and not settings.admin_api_keys:
            raise ValueError(
                "the auth file sets admin.mode api-key but HIVENET_ROUTER_ADMIN_API_KEYS is empty"
            )
        self.admin_keys = AdminKeys(settings.admin_api_keys, settings.allow_insecure_admin)
        self.config_sync: ConfigSync | None = None
        fleet_redis: redis.Redis | None = None
        if settings.state_url:
            fleet_redis = state_url.connect(settings.state_url, CALL_TIMEOUT)
            self.config_sync = ConfigSync(fleet_redis, self.peer_id)
            self.config_sync.add(self.store)
            if settings.auth_file:
                self.config_sync.add(self.tenants.store)
            if self.tenants.registry is not None:
                self.config_sync.add(self.tenants.registry)
            self.config_sync.add_named_policies(self.store)
        self.fleet_redis = fleet_redis
        self.fleet = FleetView(self.table, self.peer_id, fleet_redis)
        self.app = RouterApp(
            self.client,
            self.table,
            self.queue,
            self.store,
            self.metrics,
            self.admin_keys,
            self.tenants.client_keys,
            self.tenants,
            self.registrations,
            self.lifetime,
            self.tracer,
            self.fleet,
            TrustedProxies.parse(settings.trusted_proxies),
        )
        self.compat: UpstreamCollector | None = None
        if settings.metrics_compat == COMPAT_MODE:
            # Upstream's series beside ours, computed from these at each scrape.
            sources = [
                v
                for v in vars(self.metrics).values()
                if hasattr(v, "collect") and v is not self.metrics.registry
            ]
            self.compat = UpstreamCollector(
                self.metrics.registry,
                [*sources, agent_collector],
                self.table,
                lambda: self.tenants,
                Activity(),
            )
            self.app.activity = self.compat.activity
            self.providers.observe = self.compat.observe_provider
        self.app.console = console_for(self, settings.ui)
        self.app.health_min_agents = settings.health_min_agents
        self._delay = settings.drain_delay
        self._api_server: HttpServer | None = None
        self._stop = trio.Event()  # SIGTERM: /health fails, the drain delay begins
        self._accept_stop = trio.Event()  # the delay is over: the HTTP listener closes
        self._http_stop = trio.Event()

    def _healthy_replicas(self, model: str) -> int:
        return sum(1 for peer in self.table.for_model(model) if peer.routable)

    def _quota_replicas(self, model: str) -> int:
        """The replicas `requests_per_minute_per_replica` scales by. None healthy skips
        the rate check (upstream), unless the model's fallback provider will answer:
        it then counts as one replica, or a provider-only model would have no rate
        limit at all, at the provider's price."""
        healthy = self._healthy_replicas(model)
        if healthy:
            return healthy
        provider = self.store.for_model(model).fallback_provider
        return 1 if provider is not None and self.providers.available(provider.engine) else 0

    def _warn_about_policy(self, policy: Policy, name: str | None) -> None:
        """A provider without its key is skipped, not fatal: say so at load, for the
        global policy and for each named (per-model) one, which `name=` tells apart."""
        named = "" if name is None else f"name={quote(name)} "
        for warning in policy_warnings(policy):
            log.warning("policy_warning %s%s", named, quote(warning))
        provider = policy.fallback_provider
        if provider is not None and not self.providers.available(provider.engine):
            log.warning(
                "provider_fallback_disabled %sengine=%s reason=%s",
                named,
                provider.engine,
                quote(f"HIVENET_ROUTER_{provider.engine.upper()}_API_KEY is not set"),
            )

    def _reload_credentials(self) -> bool:
        """SIGHUP: the admin keys and JWT secrets that come from files are read again,
        so both rotate without a restart. All or nothing: a file that cannot be read
        keeps every running credential. False when rejected (logged)."""
        s = self.settings
        try:
            admin = s.admin_api_keys
            if s.admin_api_keys_file:
                from_file = read_admin_keys(s.admin_api_keys_file)
                if not from_file:
                    raise ValueError(f"{s.admin_api_keys_file} holds no admin key")
                admin = [*s.admin_api_keys_env, *from_file]
            secret = load_secret(s.jwt_secret_file) if s.jwt_secret_file else s.jwt_secret
            previous = s.jwt_secret_previous
            if s.jwt_secret_previous_file:
                previous = load_previous_secret(s.jwt_secret_previous_file, {}, missing_ok=True)
        except (OSError, ValueError) as exc:
            log.warning("credentials_reload_failed reason=%s", quote(str(exc)))
            return False
        if s.admin_api_keys_file:
            self.admin_keys.replace(admin)
        link = self.link.settings
        link.secret, link.previous_secret = secret, b"" if previous == secret else previous
        retired = self.link.retire_secrets()
        log.info(
            "credentials_reloaded admin_keys=%d jwt_secrets=%d sessions_retired=%d",
            len(self.admin_keys.digests),
            1 + bool(link.previous_secret),
            retired,
        )
        return True

    def _released(self, peer: Peer) -> None:
        self.queue.notify(peer.metadata.model)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        # The console's stories read the log lines while the router runs (router/recent.py).
        m = self.metrics
        watch = LoopWatch(
            m.loop_lag.labels(), m.loop_busy.labels(), [m.gc_pause.labels(str(g)) for g in "012"]
        )
        watch.install()
        m.trio_tasks.set_function(lambda: float(watch.tasks))
        try:
            with story_capture(self.app.console):
                await self._run(task_status=task_status)
        finally:
            watch.uninstall()

    async def _run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        s = self.settings
        addrs = listen_multiaddrs(s)
        host = router_host(
            self.key_pair,
            addrs,
            websocket=bool(s.p2p_ws_port),
            tls=self.tls_context,
            max_conns_per_ip=s.p2p_max_conns_per_ip,
        )
        async with host.run(listen_addrs=addrs):
            check_listening(host, addrs)
            host.set_stream_handler(PROTOCOL_ID, self.link.handle_stream)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.link.sweep)
                    nursery.start_soon(self.freezer.run)
                    nursery.start_soon(self.tenants.run)
                    nursery.start_soon(sweep_idle, self.admission, self.tenants.state.local)
                    if self.tenants.registry is not None:
                        nursery.start_soon(self.tenants.registry.run)
                    nursery.start_soon(self.lifetime.run)
                    if self.tracer.enabled:
                        nursery.start_soon(self.tracer.run)
                    if self.config_sync is not None:
                        nursery.start_soon(self.config_sync.run)
                    nursery.start_soon(self.fleet.run)
                    nursery.start_soon(self._signals, nursery.cancel_scope)
                    if s.worker_wait_agents:
                        await self._wait_for_agents()
                    app = (
                        self.app if self.compat is None else counted(self.app, self.compat.activity)
                    )
                    await nursery.start(self._serve_http, app, s.http_addr, True)
                    page = metrics_page(
                        self.metrics.registry, self.agent_collector, self.freezer.freeze
                    )
                    metrics_app = with_lifespan(metrics_only(page))
                    await nursery.start(self._serve_http, metrics_app, s.metrics_addr)
                    for addr in self.announce_addrs(host):
                        log.info("router_listening p2p=%s", addr)
                    log.info(
                        "router_ready peer_id=%s http=%s:%d metrics=%s:%d policy_chain=[%s]",
                        self.peer_id,
                        *s.http_addr,
                        *s.metrics_addr,
                        "→".join(self.store.current.chain_names()),
                    )
                    sd_notify(f"READY=1\nSTATUS=serving http={s.http_addr[0]}:{s.http_addr[1]}")
                    if s.supervisor_fd is not None:
                        nursery.start_soon(self._supervised, s.supervisor_fd, nursery.cancel_scope)
                    task_status.started()
                    await self._stop.wait()
                    await self._drain_delay()
                    await self._drain(host)
                    self._http_stop.set()
                    nursery.cancel_scope.cancel()
            finally:
                self.link.close_all("router shutting down")
                with trio.CancelScope(shield=True):
                    await close_listeners(host)
                    await self.providers.aclose()
                    await self.lifetime.write()
                    await self.tracer.flush()
                    await self.fleet.leave()
                    # What this router leased of tenants' limits goes back to the others.
                    with trio.move_on_after(1.0):
                        await self.tenants.state.give_back()
                self.tenants.close()
                self.lifetime.close()
                if self.fleet_redis is not None:
                    self.fleet_redis.close()
        log.info("router_stopped")

    def announce_addrs(self, host: Any) -> list[str]:
        if self.settings.p2p_announce_addr:
            return [f"{self.settings.p2p_announce_addr}/p2p/{self.peer_id}"]
        return [f"{a}/p2p/{self.peer_id}" for a in listen_multiaddrs(self.settings)]

    async def _serve_http(
        self,
        app: Any,
        addr: tuple[str, int],
        api: bool = False,
        *,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        server = HttpServer(
            app,
            KEEP_ALIVE_TIMEOUT,
            GRACEFUL_TIMEOUT,
            write_timeout=self.settings.http_write_timeout,
            protocol_of=protocol_of,
            answer_timeout=self.settings.request_timeout,
        )
        # The API's listener closes after the drain delay; its connections stay up while
        # draining, so in-flight streams can finish. Metrics are served to the end. The
        # workers of one host share the HTTP port, a socket each that their supervisor
        # bound (the metrics ports differ).
        if api:
            self._api_server = server
        await server.serve(
            addr,
            self._http_stop.wait,
            accept_until=self._accept_stop.wait if api else None,
            listen_fd=self.settings.listen_fd if api else None,
            task_status=task_status,
        )

    async def _signals(self, cancel_scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    # systemd's `reload` (ExecReload=kill -HUP): tell it while we reload.
                    sd_notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
                    errors = self.store.reload_file()
                    if errors:
                        log.warning("sighup_reload_rejected errors=%d", len(errors))
                    status = "reload rejected, running policy kept" if errors else "reloaded"
                    if self.tenants.store.reload_file():
                        status += "; auth file reload rejected, running tenants kept"
                    if not self._reload_credentials():
                        status += "; credentials reload rejected, running ones kept"
                    sd_notify(f"READY=1\nSTATUS=serving, policy {status}")
                elif self._stop.is_set():
                    log.warning("router_stop_now signal=%s", signal.Signals(signum).name)
                    cancel_scope.cancel()
                else:
                    self.begin_drain(signal.Signals(signum).name)

    def begin_drain(self, cause: str, delay: float | None = None) -> None:
        """The first step of a stop: /health answers 503 from now on (load balancers
        take the router out), while new requests are still served for --drain-delay.
        `delay` 0: a worker rolled by its supervisor, whose siblings go on serving the
        same port, so the host stays in the pool and the listener closes at once."""
        if self._stop.is_set():
            return
        self._delay = self.settings.drain_delay if delay is None else delay
        log.info(
            "router_draining signal=%s inflight=%d drain_delay_s=%g drain_timeout_s=%g",
            cause,
            self.app.inflight,
            self._delay,
            self.settings.drain_timeout,
        )
        sd_notify(f"STOPPING=1\nSTATUS=draining {self.app.inflight} requests")
        self.app.draining = delay is None
        self._stop.set()

    async def _drain_delay(self) -> None:
        """Serve on through --drain-delay while balancers see /health fail; then close
        the HTTP listener: a new connection is refused (a balancer retries it on another
        router at once), where a 503 would reach the client."""
        if self._delay > 0:
            await trio.sleep(self._delay)
        self._accept_stop.set()
        # The listener closes in the HTTP server's task; let it run before the log says so.
        await trio.lowlevel.checkpoint()
        log.info("router_http_closed inflight=%d", self.app.inflight)

    async def _wait_for_agents(self) -> None:
        """A worker started again (after a crash, or by a rolling restart) shares the
        HTTP port with siblings that serve: the kernel would hand it clients at once,
        which it could only answer 404 until the agents have rejoined it. So it takes
        no connection before its agents are back: one at least, then none more for
        AGENTS_SETTLE (they rejoin within a few seconds of each other), up to
        AGENTS_WAIT in all (a host without agents still answers)."""
        started = trio.current_time()
        with trio.move_on_after(AGENTS_WAIT):
            count, settled = 0, False
            while not settled:
                await trio.sleep(0.1 if not count else AGENTS_SETTLE)
                now = sum(p.routable for p in self.table.all())
                settled, count = bool(count) and now == count, now
        log.info(
            "worker_agents_back index=%d agents=%d waited_s=%.1f",
            self.settings.worker_index,
            sum(p.routable for p in self.table.all()),
            trio.current_time() - started,
        )

    async def _supervised(self, fd: int, cancel_scope: trio.CancelScope) -> None:
        """A `serve --workers N` worker's line to its supervisor, one end of a socket
        pair (router/fleet/workers.py): `R` tells it this worker is ready; `D` from it
        starts a drain (a rolling restart); its end of file means the supervisor is
        gone, killed even (SIGKILL, the OOM killer), and the worker stops at once
        rather than hold the shared HTTP port as an orphan no one restarts or stops.
        A socket rather than PR_SET_PDEATHSIG: trio starts processes from a worker
        thread, and that signal follows the thread, which ends when idle."""
        sock = trio.socket.fromfd(fd, socket.AF_UNIX, socket.SOCK_STREAM)
        os.close(fd)
        with sock:
            try:
                await sock.send(b"R")
                while data := await sock.recv(64):
                    if b"D" in data:
                        self.begin_drain("supervisor", delay=0.0)
            except OSError:
                pass
        log.warning(
            "worker_orphaned index=%d reason=%s",
            self.settings.worker_index,
            quote("the supervisor is gone; stopping now"),
        )
        cancel_scope.cancel()

    async def _drain(self, host: Any) -> None:
        """Let in-flight requests finish, up to --drain-timeout; then end the rest clearly.

        The HTTP listener is closed by now; a request that still arrives on an open
        connection is served, and its connection then closes. What outlives the
        timeout is not cut off silently: the p2p listener closes (no agent rejoins) and
        every agent session closes, so each request still waiting on an agent ends the
        way a lost agent ends it: an `agent_disconnected` error event on a started
        stream, a 503 otherwise. HTTP stays up for DRAIN_CUT_GRACE to deliver those.
        """
        timeout = self.settings.drain_timeout
        with trio.move_on_after(timeout):
            await self._until_idle()
        if not self.app.inflight:
            log.info("router_drained")
            return
        log.warning(
            "router_drain_timeout inflight=%d drain_timeout_s=%g", self.app.inflight, timeout
        )
        sd_notify(f"STATUS=drain timeout, ending {self.app.inflight} requests")
        # The sessions learn why first: closing the listener also ends the connections
        # it accepted, and a session that saw its end first would tell its clients
        # only that the agent's stream ended.
        self.link.close_all(f"router shutting down: drain timeout ({timeout:g}s) reached")
        await close_listeners(host)
        with trio.move_on_after(DRAIN_CUT_GRACE):
            await self._until_idle()
        if self.app.inflight:
            log.warning("router_drain_cut inflight=%d", self.app.inflight)

    async def _until_idle(self) -> None:
        """No request in flight, and none on its way: a connection accepted just before
        the listener closed, or a request read just then, may not have reached the app's
        count yet (ARRIVING seconds are ample on a busy host)."""
        while True:
            while self.app.inflight:
                await self.app.idle.wait()
            server = self._api_server
            if server is None or not server.arriving(ARRIVING):
                return
            await trio.sleep(0.05)
