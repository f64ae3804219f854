"""The simulator's run-time settings (`GET`/`POST /sim/state`), their checks and counters."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sim.faults import MALFORMED

# vLLM's block size on GPUs.
DEFAULT_PREFIX_BLOCK_TOKENS = 16
# 8,192 blocks of 16 tokens: 131,072 cached tokens, 16 GiB of KV for an 8B model (128 KiB
# per token), what an 80 GB GPU keeps beside other requests; 1.3 MB of keys here (about 155
# bytes each, measured).
DEFAULT_PREFIX_CACHE_BLOCKS = 8192
# Bounds the memory the keys may take: 160 MB at most.
MAX_PREFIX_CACHE_BLOCKS = 1 << 20
# A block longer than the default context (4,096 tokens) could never fill.
MAX_PREFIX_BLOCK_TOKENS = 4096


@dataclass
class SimState:
    """Run-time knobs (settable through `POST /sim/state`) and counters."""

    token_latency: float  # decode: seconds per generated token after the first
    ttft: float  # seconds to the first token, whatever the prompt
    # Prefill: seconds per prompt token not found in the prefix cache, on top of `ttft`.
    prefill_token_latency: float = 0.0
    # True: one prompt prefills at a time (FIFO), as a GPU's compute is shared by the
    # prefills it schedules, so uncached tokens delay the requests queued behind them.
    # False: every slot prefills on its own, however many run at once.
    prefill_shared: bool = False
    prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS
    prefix_cache_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS  # 0: no prefix cache
    kv_cache_utilization: float | None = None  # None: follows the load
    healthy: bool = True
    # Anything but 200 makes `/metrics` fail with that status (an engine restarting).
    metrics_status: int = 200
    fail_status: int = 500
    fail_body: Any = None  # JSON value; a str is sent verbatim as text/plain
    fail_count: int = 0
    # When set, the failures are a 200 with a broken body of this shape (MALFORMED).
    malformed: str | None = None
    # A stream stops after this many tokens and hangs; a non-streamed answer never comes.
    stall_after_tokens: int | None = None
    # Tokens per stream event: vLLM sends every token its reader finds decoded since the
    # last event, several at once when the reader lags (a loaded server, a slow client).
    tokens_per_event: int = 1
    # Requests wait before their prefill while this is true: a test holds them in the
    # engine for as long as it needs, not for a guessed time.
    hold: bool = False
    # Paths answered as the engine answers one it has no route for (an engine build
    # without `/v1/responses`, say): its kind's own 404.
    missing_routes: tuple[str, ...] = ()
    requests_total: int = 0
    cancelled_total: int = 0
    in_flight: int = 0
    # The most requests the engine has held at once since it started.
    max_in_flight: int = 0
    # The headers of the last inference request (names lowercase).
    last_headers: dict[str, str] = field(default_factory=dict)

    def update(self, changes: Any) -> None:
        """Apply `/sim/state` changes all or nothing; ValueError names the bad key."""
        if not isinstance(changes, dict):
            raise ValueError("expected a JSON object")
        checked: dict[str, Any] = {}
        for key, value in changes.items():
            setter = SETTERS.get(key)
            if setter is None:
                raise ValueError(f"unknown setting {key!r}; settable: {', '.join(SETTERS)}")
            try:
                checked[key] = setter(value)
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
        for key, value in checked.items():
            setattr(self, key, value)


def _number(low: float, high: float = math.inf) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("must be a number")
        if not low <= value <= high:
            raise ValueError(f"must be in [{low}, {high}]")
        return float(value)

    return check


def _integer(low: int, high: int | None = None) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("must be an integer")
        if value < low or (high is not None and value > high):
            raise ValueError(f"must be in [{low}, {high if high is not None else 'inf'}]")
        return value

    return check


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _paths(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(
        isinstance(p, str) and p.startswith("/") for p in value
    ):
        raise ValueError("must be a list of paths, each starting with /")
    return tuple(value)


def _malformed_shape(value: Any) -> str | None:
    if value is not None and value not in MALFORMED:
        raise ValueError(f"must be null or one of {', '.join(MALFORMED)}")
    return value


# The settable fields and the check of each; the counters are not settable.
SETTERS: dict[str, Callable[[Any], Any]] = {
    "kv_cache_utilization": _optional(_number(0.0, 1.0)),
    "healthy": _boolean,
    "metrics_status": _integer(100, 599),
    "fail_status": _integer(100, 599),
    "fail_body": lambda value: value,
    "fail_count": _integer(0),
    "malformed": _malformed_shape,
    "token_latency": _number(0.0),
    "ttft": _number(0.0),
    "prefill_token_latency": _number(0.0),
    "prefill_shared": _boolean,
    "prefix_block_tokens": _integer(1, MAX_PREFIX_BLOCK_TOKENS),
    "prefix_cache_blocks": _integer(0, MAX_PREFIX_CACHE_BLOCKS),
    "stall_after_tokens": _optional(_integer(0)),
    "tokens_per_event": _integer(1, 4096),
    "hold": _boolean,
    "missing_routes": _paths,
}
