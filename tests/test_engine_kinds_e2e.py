"""Real router and agent processes in front of the sim as SGLang, llama.cpp and Ollama.

What the router shows of each engine kind: the fields its metrics carry (the others
null in the routing table and without a sample on /metrics, never zero), and its
engine's health going away when the engine says it is not serving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest

from tests.fleet import Agent, Fleet, Router, sim_process, wait_until

KINDS = ("sglang", "llamacpp", "ollama")
# The engine fields each kind gives the router with no request run yet.
REPORTED = {
    "sglang": {"kv_cache_utilization", "running_requests", "waiting_requests"},
    "llamacpp": {"running_requests", "waiting_requests"},
    "ollama": set(),
}


@pytest.fixture
def engines() -> Iterator[dict[str, str]]:
    """One sim per kind, as `python -m sim --kind K` runs it; kind -> URL."""
    with contextlib.ExitStack() as stack:
        yield {
            kind: stack.enter_context(sim_process("--kind", kind, "--model", "m1"))
            for kind in KINDS
        }


def _view(router: Router, agent: Agent) -> dict:
    view = router.agent(agent.peer_id)
    assert view is not None
    return view


def _engine(router: Router, agent: Agent) -> dict:
    return _view(router, agent)["engine"]


def test_the_router_sees_each_engine_kind_as_its_metrics_allow(
    fleet: Fleet, engines: dict[str, str]
) -> None:
    router = fleet.router()
    agents = {
        kind: fleet.agent(router, "m1", "--backend-url", url, engine=kind, wait=False)
        for kind, url in engines.items()
    }
    fleet.join(*agents.values())

    for kind, agent in agents.items():
        wait_until(
            lambda agent=agent, kind=kind: (
                {f for f, v in _engine(router, agent).items() if v is not None} - {"age_seconds"}
                == REPORTED[kind]
            ),
            15,
            f"{kind} engine fields",
        )
        engine = _engine(router, agent)
        assert all(engine[f] == 0.0 for f in REPORTED[kind]), (kind, engine)
        view = _view(router, agent)
        assert view["metadata"]["engine"] == kind
        assert view["status"]["backend_healthy"] is True

    metrics = router.metrics()
    for kind in agents:
        for field in ("kv_cache_utilization", "running_requests", "waiting_requests"):
            sampled = f'hivenet_router_agent_{field}{{engine="{kind}"' in metrics
            assert sampled == (field in REPORTED[kind]), (kind, field)

    # Each engine stops serving its model (Ollama: the model is no longer listed):
    # three failed checks in a row take the agent out at gate 2.
    for url in engines.values():
        assert httpx.post(f"{url}/sim/state", json={"healthy": False}, timeout=5).is_success
    for kind, agent in agents.items():
        wait_until(
            lambda agent=agent: _view(router, agent)["status"]["backend_healthy"] is False,
            20,
            f"{kind} backend unhealthy",
        )
        assert router.metric("hivenet_router_agent_backend_healthy", engine=kind) == 0.0
    health = router.admin("/admin/health")
    assert (health["status"], health["healthy_agents"], health["total_agents"]) == (
        "degraded",
        0,
        3,
    )
