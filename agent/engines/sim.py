"""The simulated engine's adapter: the agent starts the engine itself and passes its URL.

The engine is the top-level `sim` package (`python -m sim`), imported only by the agent's
`--engine sim` start-up, so an agent in front of a real engine never loads it or its HTTP
server. Run as `python -m agent.engines.sim`, this module serves the engine as `python -m
sim` does, for the scripts and units written before the package moved.
"""

from __future__ import annotations

from agent.engines.base import EngineAdapter
from agent.engines.vllm import VLLM_METRICS


class SimAdapter(EngineAdapter):
    """The sim answers like vLLM and exposes vLLM's metric names."""

    name = "sim"
    metric_names = VLLM_METRICS


ADAPTER = SimAdapter()

if __name__ == "__main__":
    from sim.__main__ import main

    main()
