"""What a heartbeat carries beside the gate fields: per-GPU records, host memory in
bytes, the engine's preemption count. Shown by the routing table and /metrics, read by
no gate, and trusted only in their exact shape: a heartbeat is the agent's word, so a
value that is not a finite non-negative number is unknown (None), and a GPU list longer
than MAX_GPUS, not a list of maps, or naming one GPU index twice (two /metrics samples
of one series, its sums counted twice) is no GPU list at all.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass

# More GPUs than any one host has (a DGX has 8, an NVL72 rack's host 4).
MAX_GPUS = 64
GPU_FIELDS = (
    "util_percent",
    "vram_used_bytes",
    "vram_free_bytes",
    "vram_total_bytes",
    "temperature_c",
    "power_watts",
)
MEMORY_FIELDS = ("memory_used_bytes", "memory_available_bytes", "memory_total_bytes")


@dataclass(frozen=True)
class Gpu:
    index: int
    values: dict[str, float | None]

    def to_json(self) -> dict:
        return {"index": self.index, **self.values}


_INF = math.inf
# Integers below this convert to a float without overflow (byte counts do, by far).
_FLOAT_SAFE = 2**1000


def amount(value: object) -> float | None:
    """A count or measure from elsewhere as a float: None unless a finite, non-negative
    number (a bool, NaN, an infinity or an integer past a float's range is not)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        # msgpack carries integers up to 2**64, but nothing here may assume the codec.
        with contextlib.suppress(OverflowError):
            number = float(value)
            if math.isfinite(number) and number >= 0:
                return number
    return None


def _amounts(values: dict, fields: tuple[str, ...]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in fields:
        v = values.get(name)
        # msgpack's floats and integers, some sixty values per heartbeat of an eight-GPU
        # host, tested here: a call per value was half of gpus_of. The rest (bools,
        # subclasses, huge integers) goes through amount.
        kind = type(v)
        if kind is float:
            out[name] = v if 0.0 <= v < _INF else None
        elif kind is int and 0 <= v < _FLOAT_SAFE:
            out[name] = float(v)
        else:
            out[name] = amount(v)
    return out


def gpus_of(hardware: dict) -> tuple[Gpu, ...]:
    raw = hardware.get("gpus")
    if not isinstance(raw, list) or len(raw) > MAX_GPUS:
        return ()
    out = []
    seen: set[int] = set()
    for position, item in enumerate(raw):
        if not isinstance(item, dict):
            return ()
        index = item.get("index")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < MAX_GPUS:
            index = position
        if index in seen:
            return ()
        seen.add(index)
        out.append(Gpu(index, _amounts(item, GPU_FIELDS)))
    return tuple(out)


def memory_of(hardware: dict) -> dict[str, float | None]:
    return _amounts(hardware, MEMORY_FIELDS)


def preemptions_of(engine: dict) -> float | None:
    return amount(engine.get("preemptions_total"))


def gpu_total(gpus: tuple[Gpu, ...], field: str) -> float | None:
    """The host's sum over its GPUs (power drawn, VRAM used); None when none reports it."""
    values = [v for g in gpus if (v := g.values.get(field)) is not None]
    return sum(values) if values else None


# `engine.upstream` of a heartbeat (issue 47): what upstream's router re-exports from the
# engines, read by nothing but `--metrics-compat upstream`. Bounded like the GPU list: a
# vLLM histogram has under 30 buckets, its finish reasons are a handful.
UPSTREAM_HISTOGRAMS = (
    "ttft_seconds",
    "itl_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
)
MAX_BUCKETS = 64
MAX_REASONS = 16
_REASON = re.compile(r"^[a-z_]{1,32}$")


def upstream_of(engine: dict) -> dict:
    """The engine's histograms (cumulative buckets ending at +Inf, and their sum), its
    finish reasons and llama.cpp's throughputs, as far as they are well formed; a part
    that is not is left out, never an error."""
    raw = engine.get("upstream")
    if not isinstance(raw, dict):
        return {}
    out: dict = {}
    histograms = {}
    given = raw.get("histograms")
    for name in UPSTREAM_HISTOGRAMS:
        item = given.get(name) if isinstance(given, dict) else None
        parsed = _histogram(item) if isinstance(item, dict) else None
        if parsed is not None:
            histograms[name] = parsed
    if histograms:
        out["histograms"] = histograms
    reasons = raw.get("finish_reasons")
    if isinstance(reasons, dict) and len(reasons) <= MAX_REASONS:
        counts = {
            k: v
            for k, v in ((k, amount(v)) for k, v in reasons.items())
            if isinstance(k, str) and _REASON.match(k) and v is not None
        }
        if counts:
            out["finish_reasons"] = counts
    for name in ("predicted_tps", "prompt_tps"):
        value = amount(raw.get(name))
        if value is not None:
            out[name] = value
    return out


def _histogram(item: dict) -> tuple[tuple[tuple[float, float], ...], float] | None:
    """Finite bounds with cumulative counts, then `count` as the +Inf bucket."""
    buckets, total, count = item.get("buckets"), amount(item.get("sum")), amount(item.get("count"))
    if not isinstance(buckets, list) or len(buckets) >= MAX_BUCKETS or None in (total, count):
        return None
    out: list[tuple[float, float]] = []
    for pair in [*buckets, (_INF, count)]:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            return None
        bound, seen = pair
        if not isinstance(bound, int | float) or isinstance(bound, bool) or bound != bound:
            return None
        seen = amount(seen)
        if seen is None or (out and (bound <= out[-1][0] or seen < out[-1][1])):
            return None
        out.append((float(bound), seen))
    return tuple(out), total  # type: ignore[return-value]
