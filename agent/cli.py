"""`hivenet-agent`: run an agent beside an inference engine."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence

from protocol.collector import tune_collector
from protocol.durations import parse_duration
from protocol.logs import FORMATS, setup_logging
from protocol.secrets import load_secret
from protocol.upstream_flags import Ignored, add_ignored, warn_ignored

CAPABILITIES = ("llm", "embedding", "reranker")
# The router's libp2p port when the Go agent's `--router-grpc HOST:PORT` names only its
# gRPC port: the router's default --p2p-port, which upstream's guides leave unchanged.
DEFAULT_ROUTER_P2P_PORT = 9000
# The Go agent's flags with no meaning on a libp2p-only link: accepted, each named in one
# warning line at start (protocol/upstream_flags.py).
IGNORED: tuple[Ignored, ...] = (
    Ignored(
        "--router-grpc",
        None,
        "there is no gRPC step (the agent authenticates in its libp2p hello): without"
        f" --router it dials the router at HOST on the libp2p port {DEFAULT_ROUTER_P2P_PORT},"
        " learning its peer ID at the dial; with --router it is unused",
    ),
    Ignored("--router-p2p", None, "unused, as in the Go agent: --router names the router"),
    Ignored(
        "--p2p-listen-port",
        None,
        "unused: the agent only dials out and listens on no port (NAT-friendly)",
    ),
)
# The Go agent reads these variables directly; flags win over them.
ENV_FLAGS: dict[str, str] = {
    "gpu_model": "HIVENET_ROUTER_GPU_MODEL",
    "deployment_id": "HIVENET_ROUTER_DEPLOYMENT_ID",
    "replica_id": "HIVENET_ROUTER_REPLICA_ID",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hivenet-agent")
    p.add_argument(
        "--router",
        action="append",
        default=None,
        help="router multiaddr (repeat); required unless --router-grpc HOST:PORT names the host",
    )
    p.add_argument("--model", default="", help="public model name; discovered when empty")
    p.add_argument("--capacity", type=int, default=10)
    p.add_argument("--capability", choices=CAPABILITIES, default="llm")
    p.add_argument(
        "--engine",
        choices=("vllm", "sglang", "llamacpp", "ollama", "infinity", "custom", "sim"),
        default="vllm",
    )
    p.add_argument("--backend-url", default=None)
    p.add_argument("--health-url", default=None)
    p.add_argument("--metrics-url", default=None)
    p.add_argument("--region", default="")
    p.add_argument("--organization", default="")
    p.add_argument("--machine", default=socket.gethostname())
    p.add_argument("--gpu-model", default=None, help="default: $HIVENET_ROUTER_GPU_MODEL or NVML")
    # `production`, as the Go agent: its policies match `tags: [production]`.
    p.add_argument("--tags", default="production")
    p.add_argument("--version", default="", help="version reported to the router")
    p.add_argument("--deployment-id", default=None)
    p.add_argument("--replica-id", default=None)
    p.add_argument(
        "--hide-llm", action="store_true", help="leave the model out of /v1/models (still served)"
    )
    p.add_argument("--llm-pretty-name", default="", help="display name in /v1/models")
    p.add_argument("--llm-info", default="", help="short description in /v1/models")
    p.add_argument("--gpu-devices-file", default=None, help="GPU UUIDs to report, or none")
    p.add_argument("--identity-path", default="./agent_identity.key")
    p.add_argument("--heartbeat-interval", type=parse_duration, default=None, help="default 5s")
    p.add_argument(
        "--routing-signal-interval",
        type=parse_duration,
        default=None,
        help="the Go agent's name for --heartbeat-interval (heartbeats carry the signals)",
    )
    p.add_argument("--engine-sample-interval", type=parse_duration, default="500ms")
    p.add_argument("--hardware-sample-interval", type=parse_duration, default="2s")
    p.add_argument("--http-timeout", type=parse_duration, default="120s")
    p.add_argument("--stream-write-timeout", type=parse_duration, default="60s")
    p.add_argument("--drain-timeout", type=parse_duration, default="30s")
    p.add_argument("--jwt-secret-file", default=None)
    p.add_argument(
        "--proxy",
        default=None,
        help="HTTP proxy for /ws and /wss routers (http://host:port); default HTTP(S)_PROXY",
    )
    p.add_argument("--sim-token-latency", type=parse_duration, default="0s")
    p.add_argument("--sim-ttft", type=parse_duration, default="0s")
    p.add_argument("--sim-port", type=int, default=0)
    add_ignored(p, IGNORED)
    p.add_argument(
        "--log-format", choices=FORMATS, default=None, help="text (key=value) or json lines"
    )
    return p


def upstream_values(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, object]:
    """The settings that the Go agent's flags and variables set; ValueError when they
    contradict each other or are invalid."""
    values: dict[str, object] = {
        name: getattr(args, name) if getattr(args, name) is not None else env.get(var, "")
        for name, var in ENV_FLAGS.items()
    }
    heartbeat, signal = args.heartbeat_interval, args.routing_signal_interval
    if heartbeat is not None and signal is not None and heartbeat != signal:
        raise ValueError("--heartbeat-interval and --routing-signal-interval differ: keep one")
    values["heartbeat_interval"] = next((v for v in (heartbeat, signal) if v is not None), 5.0)
    if values["heartbeat_interval"] <= 0:  # type: ignore[operator]
        raise ValueError("--heartbeat-interval must be positive")
    if args.capacity <= 0:
        # The router refuses such an agent's hello; an agent that starts only to be
        # refused on every redial looks alive to systemd and never serves.
        raise ValueError(f"--capacity must be positive, not {args.capacity}")
    for flag in ("engine_sample_interval", "hardware_sample_interval"):
        if getattr(args, flag) <= 0:
            # Zero would sample back to back, a busy loop against the engine or NVML.
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")
    if args.http_timeout <= 0:
        # Zero would fail every engine call at once; a long answer needs a long timeout.
        raise ValueError("--http-timeout must be positive (e.g. 10m for long answers)")
    tags = args.tags.split(",") if args.tags else []
    if any(not t.strip() for t in tags):
        raise ValueError(f"--tags {args.tags!r} has an empty tag")
    # Trimmed: the Go agent keeps `, realtime` as " realtime", which no policy matches.
    values["tags"] = [t.strip() for t in tags]
    if args.gpu_devices_file is not None:
        from agent.hardware import read_devices_file

        try:
            values["gpu_devices"] = read_devices_file(args.gpu_devices_file)
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--gpu-devices-file: {exc}") from None
    return values


def router_from_grpc(hostport: str) -> str:
    """The libp2p address an agent dials for the Go agent's `--router-grpc HOST:PORT`:
    HOST on the router's default libp2p port, without a peer ID (learned at the dial,
    agent/router_identity.py). ValueError when HOST is missing."""
    host = hostport.rsplit(":", 1)[0] if ":" in hostport else hostport
    host = host.strip("[]")
    if not host:
        raise ValueError(f"--router-grpc {hostport!r} names no host")
    try:
        family = "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
    except ValueError:
        family = "dns"
    return f"/{family}/{host}/tcp/{DEFAULT_ROUTER_P2P_PORT}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.router:
        if not args.upstream_router_grpc:
            parser.error("--router is required (or the Go agent's --router-grpc HOST:PORT)")
        try:
            args.router = [router_from_grpc(args.upstream_router_grpc)]
        except ValueError as exc:
            parser.error(str(exc))
    setup_logging(log_format=args.log_format)
    warn_ignored(logging.getLogger("agent"), args, os.environ, IGNORED)
    from agent.link import parse_router_address
    from agent.settings import AgentSettings

    if args.engine == "custom" and not (args.health_url and args.model):
        print("hivenet-agent: --engine custom needs --health-url and --model", file=sys.stderr)
        return 2
    if args.engine == "infinity" and args.capability == "llm":
        # Infinity serves embeddings and reranking only: an `llm` agent would take
        # chat requests its engine refuses.
        print(
            "hivenet-agent: --engine infinity needs --capability embedding or reranker",
            file=sys.stderr,
        )
        return 2
    if args.engine == "sim":
        from sim import missing_extra

        why = missing_extra()
        if why is not None:
            print(f"hivenet-agent: --engine sim: {why}", file=sys.stderr)
            return 2
    try:
        for address in args.router:
            parse_router_address(address)
        if args.backend_url:
            from agent.engine_http import check_engine_url

            check_engine_url(args.backend_url)
        if args.proxy:
            from agent.http_proxy import parse_proxy_url

            parse_proxy_url(args.proxy)
            if not any("/ws" in r for r in args.router):
                raise ValueError("--proxy needs a /ws or /wss --router (it tunnels WebSocket)")
        settings = AgentSettings(
            routers=args.router,
            model=args.model,
            capacity=args.capacity,
            capability=args.capability,
            engine=args.engine,
            backend_url=args.backend_url,
            health_url=args.health_url,
            metrics_url=args.metrics_url,
            region=args.region,
            organization=args.organization,
            machine=args.machine,
            version=args.version,
            hide_llm=args.hide_llm,
            llm_pretty_name=args.llm_pretty_name,
            llm_info=args.llm_info,
            identity_path=args.identity_path,
            engine_sample_interval=args.engine_sample_interval,
            hardware_sample_interval=args.hardware_sample_interval,
            http_timeout=args.http_timeout,
            stream_write_timeout=args.stream_write_timeout,
            drain_timeout=args.drain_timeout,
            jwt_secret=load_secret(args.jwt_secret_file),
            sim_token_latency=args.sim_token_latency,
            sim_ttft=args.sim_ttft,
            sim_port=args.sim_port,
            **upstream_values(args, os.environ),  # type: ignore[arg-type]
            proxy=args.proxy,
        )
        import trio

        from agent.app import AgentDaemon

        daemon = AgentDaemon(settings)
    except Exception as exc:  # every startup problem ends here with its reason
        print(f"hivenet-agent: {exc}", file=sys.stderr)
        return 2
    tune_collector()
    trio.run(daemon.run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
