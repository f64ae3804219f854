"""`python -m sim`: serve the simulated engine on its own, as `vllm serve` would.

`python -m sim --model m --port 8000 [--token-latency 0.01] [--kind sglang]`
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from functools import partial

import trio

from sim import missing_extra
from sim.app import SimEngine, create_sim_app
from sim.metrics import KINDS
from sim.state import DEFAULT_PREFIX_BLOCK_TOKENS, DEFAULT_PREFIX_CACHE_BLOCKS


async def serve_sim(
    app: SimEngine,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` until cancelled; `task_status.started` gets the bound port (port 0 picks one)."""
    # Imported here: Hypercorn is the optional `sim` extra, which `sim.missing_extra` names.
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    # A Logger (not hypercorn's default "-") gets no handler of hypercorn's own: its
    # records reach the host process's logging configuration, once.
    config.errorlog = logging.getLogger("hypercorn.error")
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(partial(serve, app, config, mode="asgi"))
        task_status.started(int(binds[0].rsplit(":", 1)[1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sim", description="Simulated vLLM-like inference engine."
    )
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument(
        "--kind",
        choices=KINDS,
        default="vllm",
        help="the engine whose health, model list and metric names it answers with",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-latency", type=float, default=0.0, help="seconds per token")
    parser.add_argument("--ttft", type=float, default=0.0, help="seconds to the first token")
    parser.add_argument("--max-context", type=int, default=4096, help="context limit in words")
    parser.add_argument("--capacity", type=int, default=64, help="requests run at once")
    parser.add_argument("--embedding-dim", type=int, default=8)
    parser.add_argument(
        "--prefill-token-latency",
        type=float,
        default=0.0,
        help="seconds of prefill per prompt token not in the prefix cache",
    )
    parser.add_argument(
        "--prefill-shared",
        action="store_true",
        help="prefill one prompt at a time, as a GPU shares its compute (default: per slot)",
    )
    parser.add_argument(
        "--prefix-block-tokens",
        type=int,
        default=DEFAULT_PREFIX_BLOCK_TOKENS,
        help="tokens per prefix-cache block",
    )
    parser.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=DEFAULT_PREFIX_CACHE_BLOCKS,
        help="prefix-cache size in blocks (0: none)",
    )
    parser.add_argument(
        "--missing-route",
        action="append",
        default=[],
        metavar="PATH",
        help="answer PATH as an engine without that route does (its 404); repeatable",
    )
    args = parser.parse_args(argv)
    why = missing_extra()
    if why is not None:
        parser.exit(2, f"{parser.prog}: {why}\n")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        app = create_sim_app(
            args.model,
            kind=args.kind,
            token_latency=args.token_latency,
            ttft=args.ttft,
            max_context=args.max_context,
            capacity=args.capacity,
            embedding_dim=args.embedding_dim,
            prefill_token_latency=args.prefill_token_latency,
            prefill_shared=args.prefill_shared,
            prefix_block_tokens=args.prefix_block_tokens,
            prefix_cache_blocks=args.prefix_cache_blocks,
        )
        app.state.update({"missing_routes": args.missing_route})
    except ValueError as exc:
        parser.error(str(exc))
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(serve_sim, app, args.host, args.port)


if __name__ == "__main__":
    main()
