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
