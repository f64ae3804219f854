"""Engine adapters: one module per engine, named as `--engine` names it."""

from __future__ import annotations

import importlib

from agent.engines.base import (
    FIELDS,
    EngineAdapter,
    EngineEndpoints,
    HealthTracker,
    MetricNames,
    MetricSampler,
)

ENGINES = ("vllm", "sglang", "llamacpp", "ollama", "infinity", "custom", "sim")

__all__ = [
    "ENGINES",
    "FIELDS",
    "EngineAdapter",
    "EngineEndpoints",
    "HealthTracker",
    "MetricNames",
    "MetricSampler",
    "get_adapter",
]


def get_adapter(engine: str) -> EngineAdapter:
    """The adapter for an `--engine` value; ValueError for an unknown one."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    # Imported on demand: `python -m agent.engines.sim` must not find its module
    # already imported by the package.
    adapter: EngineAdapter = importlib.import_module(f"agent.engines.{engine}").ADAPTER
    return adapter
