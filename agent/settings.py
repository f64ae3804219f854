"""Agent settings from its flags."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AgentSettings:
    routers: list[str]
    model: str = ""
    capacity: int = 10
    capability: str = "llm"
    engine: str = "vllm"
    backend_url: str | None = None
    health_url: str | None = None
    metrics_url: str | None = None
    region: str = ""
    organization: str = ""
    machine: str = ""
    gpu_model: str = ""
    tags: list[str] = field(default_factory=list)
    identity_path: str = "./agent_identity.key"
    heartbeat_interval: float = 5.0
    engine_sample_interval: float = 0.5
    hardware_sample_interval: float = 2.0
    http_timeout: float = 120.0
    stream_write_timeout: float = 60.0
    drain_timeout: float = 30.0
    jwt_secret: bytes = b""
    # Metadata the Go router's agents register: the version reported (empty: this
    # build's), deployment and replica ids, and the model's display fields.
    version: str = ""
    deployment_id: str = ""
    replica_id: str = ""
    hide_llm: bool = False
    llm_pretty_name: str = ""
    llm_info: str = ""
    # --gpu-devices-file: the GPU UUIDs to report (None: every visible GPU).
    gpu_devices: frozenset[str] | None = None
    # HTTP proxy for WebSocket routers; None: HTTPS_PROXY/HTTP_PROXY from the environment.
    proxy: str | None = None
    # Simulated engine (--engine sim) knobs.
    sim_token_latency: float = 0.0
    sim_ttft: float = 0.0
    sim_port: int = 0
