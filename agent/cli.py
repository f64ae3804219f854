"""`hivenet-agent`: run an agent beside an inference engine."""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence

from protocol.durations import parse_duration
from protocol.logs import FORMATS, setup_logging
from protocol.secrets import load_secret

CAPABILITIES = ("llm", "embedding", "reranker")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hivenet-agent")
    p.add_argument("--router", action="append", required=True, help="router multiaddr (repeat)")
    p.add_argument("--model", default="", help="public model name; discovered when empty")
    p.add_argument("--capacity", type=int, default=10)
    p.add_argument("--capability", choices=CAPABILITIES, default="llm")
    p.add_argument(
        "--engine",
        choices=("vllm", "sglang", "llamacpp", "ollama", "custom", "sim"),
        default="vllm",
    )
    p.add_argument("--backend-url", default=None)
    p.add_argument("--health-url", default=None)
    p.add_argument("--metrics-url", default=None)
    p.add_argument("--region", default="")
    p.add_argument("--organization", default="")
    p.add_argument("--machine", default=socket.gethostname())
    p.add_argument("--gpu-model", default="")
    p.add_argument("--tags", default="")
    p.add_argument("--identity-path", default="./agent_identity.key")
    p.add_argument("--heartbeat-interval", type=parse_duration, default="5s")
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
    p.add_argument(
        "--log-format", choices=FORMATS, default=None, help="text (key=value) or json lines"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(log_format=args.log_format)
    from agent.link import parse_router_address
    from agent.settings import AgentSettings

    if args.engine == "custom" and not (args.health_url and args.model):
        print("hivenet-agent: --engine custom needs --health-url and --model", file=sys.stderr)
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
            gpu_model=args.gpu_model,
            tags=[t.strip() for t in args.tags.split(",") if t.strip()],
            identity_path=args.identity_path,
            heartbeat_interval=args.heartbeat_interval,
            engine_sample_interval=args.engine_sample_interval,
            hardware_sample_interval=args.hardware_sample_interval,
            http_timeout=args.http_timeout,
            stream_write_timeout=args.stream_write_timeout,
            drain_timeout=args.drain_timeout,
            jwt_secret=load_secret(args.jwt_secret_file),
            sim_token_latency=args.sim_token_latency,
            sim_ttft=args.sim_ttft,
            sim_port=args.sim_port,
            proxy=args.proxy,
        )
        import trio

        from agent.app import AgentDaemon

        daemon = AgentDaemon(settings)
    except Exception as exc:  # every startup problem ends here with its reason
        print(f"hivenet-agent: {exc}", file=sys.stderr)
        return 2
    trio.run(daemon.run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
