"""Router settings: flags and environment folded into one object."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from router.peers import DEFAULT_FAILURE_COOLDOWN

DEFAULT_MAX_REQUEST_BYTES = 10 * 1024 * 1024


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
    max_tries_per_step: int = 3
    queue_depth: int = 30
    request_timeout: float = 60.0
    http_write_timeout: float = 30.0
    heartbeat_interval: float = 5.0
    unhealthy_after: float = 15.0
    remove_after: float = 30.0
    # Agent sessions from one address (IPv6: one /64) not yet past their hello.
    max_unjoined_per_ip: int = 64
    drain_timeout: float = 30.0
    failure_cooldown: float = DEFAULT_FAILURE_COOLDOWN
    stream_slot_release: str = "head"
    jwt_secret: bytes = b""
    admin_api_keys: list[str] = field(default_factory=list)
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
    # `--workers`: this process's place among the host's router processes, and the
    # others as worker 0's welcome names them ({"tcp_port", "peer_id"}).
    worker_index: int = 0
    worker_count: int = 1
    workers: list[dict] = field(default_factory=list)

    def apply_environment(self, env: dict[str, str] | None = None) -> None:
        """Environment-only settings (keys, provider endpoints, limits)."""
        e = os.environ if env is None else env
        self.admin_api_keys = [
            k.strip() for k in e.get("HIVENET_ROUTER_ADMIN_API_KEYS", "").split(",") if k.strip()
        ]
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
        if e.get("HIVENET_ROUTER_MAX_REQUEST_BYTES"):
            self.max_request_bytes = int(e["HIVENET_ROUTER_MAX_REQUEST_BYTES"])
