"""Hardware signals of the agent host, in policy units.

GPU values come from NVML: the highest across GPUs, since one hot or full GPU is what
slows a sharded model. Utilization and memory are fractions 0-1; temperature is degrees
Celsius. Without NVML (no driver, no GPU) the GPU fields are None, never zero, and the
failed initialisation is logged once, not retried on every sample.

Beside those policy fields the sample carries what the routing table and /metrics show
and no gate reads: `gpus`, one record per GPU in upstream's shape (index, utilization in
percent, VRAM bytes, temperature, power in watts), and the host memory in bytes. A GPU
query that fails leaves that one value None.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import psutil
import pynvml

from protocol.logs import quote

log = logging.getLogger("agent")


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
        # (NVML index, handle) per GPU reported: the index labels its record, as
        # `nvidia-smi` numbers it, also when `devices` leaves GPUs before it out.
        self._gpus: list[tuple[int, Any]] = []
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            # Said once: the agent goes on with CPU and memory, its GPU fields missing.
            log.warning("hardware_nvml_unavailable error=%s", quote(str(exc)))
            count = 0
        for index in range(count):
            # One GPU NVML cannot reach (fallen off the bus, its UUID unreadable) is
            # left out alone; the others are still reported.
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                if devices is not None and _uuid(handle) not in devices:
                    continue
            except pynvml.NVMLError as exc:
                log.warning("hardware_gpu_unavailable index=%d error=%s", index, quote(str(exc)))
                continue
            self._gpus.append((index, handle))
        self._handles = [handle for _, handle in self._gpus]
        # psutil measures CPU use since the previous call: the first call only primes it,
        # so that `sample` never blocks for an interval.
        psutil.cpu_percent(interval=None)

    def sample(self) -> dict[str, Any]:
        memory = psutil.virtual_memory()
        return {
            "gpu_temperature_c": _highest(self._handles, _temperature),
            "gpu_util_percent": _highest(self._handles, _utilization),
            "gpu_vram_used_percent": _highest(self._handles, _vram_used),
            "memory_used_percent": memory.percent / 100.0,
            "cpu_usage_percent": psutil.cpu_percent(interval=None) / 100.0,
            "memory_used_bytes": memory.used,
            "memory_available_bytes": memory.available,
            "memory_total_bytes": memory.total,
            "gpus": [_gpu(index, handle) for index, handle in self._gpus],
        }

    def gpu_model(self) -> str | None:
        if not self._handles:
            return None
        try:
            name = pynvml.nvmlDeviceGetName(self._handles[0])
        except pynvml.NVMLError:
            return None
        return name.decode() if isinstance(name, bytes) else name


T = TypeVar("T")


def _read(read: Callable[[], T]) -> T | None:
    try:
        return read()
    except pynvml.NVMLError:
        return None


def _gpu(index: int, handle: Any) -> dict[str, float | None]:
    memory = _read(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    utilization = _read(lambda: _utilization(handle))
    return {
        "index": index,
        "util_percent": None if utilization is None else utilization * 100.0,
        "vram_used_bytes": None if memory is None else memory.used,
        "vram_free_bytes": None if memory is None else memory.free,
        "vram_total_bytes": None if memory is None else memory.total,
        "temperature_c": _read(lambda: _temperature(handle)),
        # NVML reports milliwatts.
        "power_watts": _read(lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
    }


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
