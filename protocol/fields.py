"""The live values a heartbeat carries, named as the policy's `exclude_if` gates name them.

Units are the policy's: fractions 0 to 1, seconds for TTFT/ITL, degrees Celsius, counts.
"""

from __future__ import annotations

ENGINE_FIELDS: tuple[str, ...] = (
    "kv_cache_utilization",
    "running_requests",
    "waiting_requests",
    "avg_ttft_seconds",
    "p90_ttft_seconds",
    "avg_itl_seconds",
    "p90_itl_seconds",
)
HARDWARE_FIELDS: tuple[str, ...] = (
    "gpu_temperature_c",
    "gpu_util_percent",
    "gpu_vram_used_percent",
    "memory_used_percent",
    "cpu_usage_percent",
)
