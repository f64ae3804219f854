"""Hardware signals of the agent host, in policy units.

GPU values come from NVML: the highest across GPUs, since one hot or full GPU is what
slows a sharded model. Utilization and memory are fractions 0-1; temperature is degrees
Celsius. Without NVML (no driver, no GPU) the GPU fields are None, never zero, and the
failed initialisation is not retried on every sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import psutil
import pynvml


def read_devices_file(path: str) -> frozenset[str]:
    """`--gpu-devices-file`: GPU UUIDs separated by commas or lines; empty or `none`
    reports no GPU. A file that cannot be read is a startup error (OSError)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    uuids = frozenset(u for u in (p.strip() for p in text.replace(",", "\n").splitlines()) if u)
    return frozenset() if uuids <= {"none"} else uuids


class HardwareSampler:
    def __init__(self, devices: frozenset[str] | None = None) -> None:
        """`devices`: the GPU UUIDs this agent owns (None: every visible GPU)."""
        self._handles: list[Any] = []
        try:
            pynvml.nvmlInit()
            self._handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
            if devices is not None:
                self._handles = [h for h in self._handles if _uuid(h) in devices]
        except pynvml.NVMLError:
            self._handles = []
        # psutil measures CPU use since the previous call: the first call only primes it,
        # so that `sample` never blocks for an interval.
        psutil.cpu_percent(interval=None)

    def sample(self) -> dict[str, float | None]:
        return {
            "gpu_temperature_c": _highest(self._handles, _temperature),
            "gpu_util_percent": _highest(self._handles, _utilization),
            "gpu_vram_used_percent": _highest(self._handles, _vram_used),
            "memory_used_percent": psutil.virtual_memory().percent / 100.0,
            "cpu_usage_percent": psutil.cpu_percent(interval=None) / 100.0,
        }

    def gpu_model(self) -> str | None:
        if not self._handles:
            return None
        try:
            name = pynvml.nvmlDeviceGetName(self._handles[0])
        except pynvml.NVMLError:
            return None
        return name.decode() if isinstance(name, bytes) else name


def _uuid(handle: Any) -> str:
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    return uuid.decode() if isinstance(uuid, bytes) else uuid


def _temperature(handle: Any) -> float:
    return float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))


def _utilization(handle: Any) -> float:
    return pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0


def _vram_used(handle: Any) -> float | None:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return memory.used / memory.total if memory.total else None


def _highest(handles: Iterable[Any], read: Callable[[Any], float | None]) -> float | None:
    """Highest reading across GPUs; a GPU whose query fails is left out, not read as 0."""
    values = []
    for handle in handles:
        try:
            value = read(handle)
        except pynvml.NVMLError:
            continue
        if value is not None:
            values.append(value)
    return max(values, default=None)
