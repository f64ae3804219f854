"""Router settings: flags and environment folded into one object."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.durations import parse_duration
from protocol.files import read_regular
from router.admission.limits import DEFAULT_ADMIT_FRACTION, DEFAULT_PARK_TIMEOUT, parse_fraction
from router.peers import DEFAULT_FAILURE_COOLDOWN

# `hivenet-router serve`'s exit status for a configuration error (router/cli.py), which a
# worker's supervisor passes on (router/fleet/workers.py).
CONFIG_ERROR = 2

DEFAULT_MAX_REQUEST_BYTES = 10 * 1024 * 1024
# HIVENET_ROUTER_MAX_REQUEST_BYTES=0 is the Go router's "no limit". A daemon reading
# bodies into memory still needs a bound: 1 GiB, above any prompt an engine accepts.
UNLIMITED_REQUEST_BYTES = 1024 * 1024 * 1024
AUTH_MODES: tuple[str, ...] = ("none", "api-key", "dynamic")
ENV_PREFIX = "HIVENET_ROUTER_"
# HIVENET_ROUTER_ADMIN_API_KEYS_FILE: a list of keys; a larger file is some other file.
MAX_KEYS_FILE_BYTES = 1024 * 1024


def env_value(
    env: Mapping[str, str], name: str, convert: Callable[[str], Any], default: str
) -> Any:
    """`HIVENET_ROUTER_<name>` converted, or `default`; a bad value is a startup error
    naming the variable (the Go router keeps its default, and says nothing)."""
    key = ENV_PREFIX + name
    raw = env.get(key) or default
    try:
        return convert(raw)
    except ValueError as exc:
        raise ValueError(f"{key}={raw!r}: {exc}") from None


def split_hostport(value: str) -> tuple[str, int]:
    """`host:port` or `:port` (all interfaces)."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "", value
    if not port.isdigit():
        raise ValueError(f"invalid address {value!r}: expected host:port or :port")
    return host or "0.0.0.0", int(port)


@dataclass
class RouterSettings:
    http_addr: tuple[str, int] = ("0.0.0.0", 8080)
    metrics_addr: tuple[str, int] = ("0.0.0.0", 2112)
    p2p_port: int = 9000
    p2p_ws_port: int = 0
    p2p_wss_port: int = 0
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    p2p_listen_addr: str = "127.0.0.1"
    p2p_announce_addr: str | None = None
    identity_path: str = "./router_identity.key"
    policy_file: str | None = None
    policy_model_dir: str | None = None
    max_tries_per_step: int = 3
    queue_depth: int = 30
    # Router-wide forwards in flight (0: unbounded) and how many may wait for one.
    max_concurrent: int = 0
    queue_size: int = 100
    request_timeout: float = 60.0
    # How long a successful answer is replayed to a retry with its key (0: off).
    idempotency_window: float = 60.0
    health_check_interval: float = 1.0
    # --disk-db-path: the directory of the per-agent history file (router/lifetime.py).
    disk_db_path: str | None = None
    disk_db_ttl: int = 30
    universal_flush_interval: float = 30.0
    reset_disk_db: bool = False
    p2p_max_conns_per_ip: int = 32
    http_write_timeout: float = 30.0
    heartbeat_interval: float = 5.0
    unhealthy_after: float = 15.0
    remove_after: float = 30.0
    # Agent sessions from one address (IPv6: one /64) not yet past their hello.
    max_unjoined_per_ip: int = 64
    # On SIGTERM /health fails at once, but the router goes on serving new requests this
    # long, so that a load balancer takes it out of its pool first (HAProxy checking
    # every 500 ms with `fall 3`: 1.5 s, plus a check in flight); then its HTTP listener
    # closes and the in-flight requests drain, up to drain_timeout.
    drain_delay: float = 5.0
    # /health answers 503 {"status":"no_agents"} while fewer agents are routable.
    health_min_agents: int = 0
    drain_timeout: float = 30.0
    failure_cooldown: float = DEFAULT_FAILURE_COOLDOWN
    stream_slot_release: str = "head"
    jwt_secret: bytes = b""
    # A rotation's previous secret and the files both come from (re-read on SIGHUP).
    jwt_secret_previous: bytes = b""
    jwt_secret_file: str | None = None
    jwt_secret_previous_file: str | None = None
    admin_api_keys: list[str] = field(default_factory=list)
    # HIVENET_ROUTER_ADMIN_API_KEYS_FILE: admin keys re-read on SIGHUP (rotation),
    # beside those of HIVENET_ROUTER_ADMIN_API_KEYS (read once).
    admin_api_keys_file: str | None = None
    admin_api_keys_env: list[str] = field(default_factory=list)
    allow_insecure_admin: bool = False
    client_api_keys: str = ""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    openai_api_key: str = ""
    anthropic_api_key: str = ""
    openai_base_url: str = "https://api.openai.com/v1"
    anthropic_base_url: str = "https://api.anthropic.com"
    auth_file: str | None = None
    state_url: str | None = None
    audit_log: str | None = None
    audit_log_max_bytes: int = 100 * 1024 * 1024
    audit_log_backups: int = 5
    # --trusted-proxies: CIDRs whose X-Forwarded-For / X-Real-IP name the client.
    trusted_proxies: str = ""
    # --metrics-compat upstream: also upstream's series on /metrics (router/upstream_metrics.py).
    metrics_compat: str = ""
    # Per-agent lifetime stats (router/lifetime.py); None: beside the identity key.
    history_path: str | None = None
    # HIVENET_ROUTER_AUTH_MODE (read without an auth file): none or api-key.
    auth_mode: str = ""
    # HIVENET_ROUTER_RPM_BURST_SECONDS: a tenant bucket holds this many seconds of its
    # rate (0: a full minute, upstream's default) unless its `burst` says otherwise.
    rpm_burst_seconds: int = 0
    # `--workers`: this process's place among the host's router processes, and the
    # others as worker 0's welcome names them ({"tcp_port", "peer_id"}).
    worker_index: int = 0
    worker_count: int = 1
    # A worker's end of the socket pair its supervisor holds (router/fleet/workers.py).
    supervisor_fd: int | None = None
    # A worker's share of the HTTP port, a listening socket its supervisor bound and
    # holds (router/fleet/shared_port.py).
    listen_fd: int | None = None
    # A worker its supervisor started again: it opens the HTTP port once agents are back.
    worker_wait_agents: bool = False
    # HIVENET_ROUTER_ADMIT_FRACTION and HIVENET_ROUTER_ADMIT_PARK_TIMEOUT (admission B2).
    admit_fraction: float = DEFAULT_ADMIT_FRACTION
    admit_park_timeout: float = DEFAULT_PARK_TIMEOUT
    workers: list[dict] = field(default_factory=list)
    # The operator console at /ui and its recent-requests ring (--no-ui, HIVENET_ROUTER_UI).
    ui: bool = True

    def apply_environment(self, env: Mapping[str, str] | None = None) -> None:
        """Environment-only settings (keys, provider endpoints, limits)."""
        e = os.environ if env is None else env
        self.admin_api_keys = [
            k.strip() for k in e.get("HIVENET_ROUTER_ADMIN_API_KEYS", "").split(",") if k.strip()
        ]
        self.admin_api_keys_env = list(self.admin_api_keys)
        self.admin_api_keys_file = e.get("HIVENET_ROUTER_ADMIN_API_KEYS_FILE") or None
        if self.admin_api_keys_file:
            self.admin_api_keys = [*self.admin_api_keys, *read_admin_keys(self.admin_api_keys_file)]
        self.allow_insecure_admin = e.get("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN", "").lower() in (
            "1",
            "true",
            "yes",
        )
        self.client_api_keys = e.get("HIVENET_ROUTER_API_KEYS", "")
        self.openai_api_key = e.get("HIVENET_ROUTER_OPENAI_API_KEY", "")
        self.anthropic_api_key = e.get("HIVENET_ROUTER_ANTHROPIC_API_KEY", "")
        self.openai_base_url = e.get("HIVENET_ROUTER_OPENAI_BASE_URL") or self.openai_base_url
        self.anthropic_base_url = (
            e.get("HIVENET_ROUTER_ANTHROPIC_BASE_URL") or self.anthropic_base_url
        )
        limit = env_value(e, "MAX_REQUEST_BYTES", _non_negative, str(DEFAULT_MAX_REQUEST_BYTES))
        self.max_request_bytes = limit or UNLIMITED_REQUEST_BYTES
        self.auth_mode = env_value(e, "AUTH_MODE", _auth_mode, "none")
        if self.auth_mode == "none" and e.get("HIVENET_ROUTER_AUTH_MODE") and self.client_api_keys:
            raise ValueError("HIVENET_ROUTER_AUTH_MODE=none but HIVENET_ROUTER_API_KEYS is set")
        env_value(e, "QUOTA_BACKEND", _quota_backend, "memory")
        self.rpm_burst_seconds = env_value(e, "RPM_BURST_SECONDS", _burst_seconds, "0")
        self.admit_fraction = env_value(e, "ADMIT_FRACTION", parse_fraction, "0.90")
        self.admit_park_timeout = env_value(e, "ADMIT_PARK_TIMEOUT", parse_duration, "250ms")


def parse_on_off(raw: str) -> bool:
    """A switch variable: on/true/yes/1 or off/false/no/0."""
    value = raw.strip().lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise ValueError("must be on or off")


def _non_negative(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be 0 or more")
    return value


def read_admin_keys(path: str) -> list[str]:
    """Admin keys from a file: comma- or line-separated, `#` starts a comment."""
    try:
        text = read_regular(path, MAX_KEYS_FILE_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"HIVENET_ROUTER_ADMIN_API_KEYS_FILE={path}: {exc}") from None
    keys: list[str] = []
    for line in text.splitlines():
        keys += [k.strip() for k in line.split("#", 1)[0].split(",") if k.strip()]
    return keys


def _auth_mode(raw: str) -> str:
    if raw not in AUTH_MODES:
        raise ValueError(f"must be one of {', '.join(AUTH_MODES)}")
    return raw


def _quota_backend(raw: str) -> str:
    if raw == "badger":
        raise ValueError(
            "there is no BadgerDB; tenant counts that outlive a restart and are shared by"
            " several routers live in Redis: --state-url redis://host:port/db"
        )
    if raw != "memory":
        raise ValueError("must be memory (or use --state-url for Redis)")
    return raw


def _burst_seconds(raw: str) -> int:
    value = int(raw)
    if not 0 <= value < 60:
        raise ValueError("must be from 0 to 59")
    return value
