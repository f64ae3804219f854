"""The simulated engine as each engine kind, met by that engine's own adapter.

`python -m sim --kind K` answers health, model listing and metrics as engine K does
(/work/shared/notes/engine-metrics.md), so the agent's SGLang, llama.cpp and Ollama
adapters are exercised over HTTP as its vLLM adapter is, not only on hand-written pages.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from agent.engine_http import MetricsPage
from agent.engines import EngineAdapter, get_adapter
from protocol.paths import API_PATHS
from sim.__main__ import serve_sim
from sim.app import SimEngine, create_sim_app
from sim.metrics import KINDS

MODEL = "llama3.1"
# What each engine's metrics give the policy, once requests have run.
REPORTED = {
    "vllm": {"kv_cache_utilization", "running_requests", "waiting_requests", "ttft", "itl"},
    "sglang": {"kv_cache_utilization", "running_requests", "waiting_requests", "ttft", "itl"},
    # No KV ratio in current releases, no TTFT, no P90s: only an average ITL, from its
    # decode counters.
    "llamacpp": {"running_requests", "waiting_requests", "avg_itl"},
    "ollama": set(),
}


async def _start(nursery: trio.Nursery, kind: str) -> tuple[SimEngine, str]:
    app = create_sim_app(MODEL, kind=kind, token_latency=0.001)
    port = await nursery.start(serve_sim, app, "127.0.0.1", 0)
    return app, f"http://127.0.0.1:{port}"


async def _stream_chat(client: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "one two three four five"}],
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for _ in response.aiter_bytes():
            pass


async def _let_go(app: SimEngine) -> None:
    with trio.fail_after(5):
        while True:
            if not app.state.in_flight:
                return
            await trio.sleep(0.01)


def _reported(values: dict[str, float | None]) -> set[str]:
    present = {name for name, value in values.items() if value is not None}
    for kind in ("ttft", "itl"):
        fields = {f"avg_{kind}_seconds", f"p90_{kind}_seconds"}
        if fields <= present:
            present = (present - fields) | {kind}
        elif f"avg_{kind}_seconds" in present:
            present = (present - fields) | {f"avg_{kind}"}
    # `upstream` (the engine's own histograms) is for --metrics-compat upstream only.
    return present - {"preemptions_total", "upstream"}


@pytest.mark.parametrize("kind", KINDS)
async def test_each_kind_is_read_by_its_engine_s_adapter(nursery: trio.Nursery, kind: str) -> None:
    app, url = await _start(nursery, kind)
    adapter: EngineAdapter = get_adapter(kind)
    ep = adapter.endpoints(url, None, None)
    async with httpx.AsyncClient(base_url=url) as client:
        # Ollama's public name drops the implicit `:latest` it lists the model under.
        assert await adapter.discover_model(client, ep) == MODEL
        assert await adapter.check_health(client, ep, MODEL)
        if kind == "ollama":
            assert ep.metrics_url is None
            assert (await client.get("/metrics")).text == "404 page not found"
            return
        assert ep.metrics_url is not None
        sampler = adapter.new_sampler(MODEL)
        page = MetricsPage(ep.metrics_url)
        try:
            before = sampler.update(await page.text(), 0.0)
            for _ in range(3):
                await _stream_chat(client)
            # The client may have the whole stream before the engine has let it go.
            await _let_go(app)
            after = sampler.update(await page.text(), 1.0)
        finally:
            page.close()
    # Counts and gauges from the first scrape; latencies need a second one.
    assert _reported(before) == REPORTED[kind] - {"ttft", "itl", "avg_itl"}
    assert _reported(after) == REPORTED[kind]
    assert after["running_requests"] == 0.0 and after["waiting_requests"] == 0.0
    if kind != "llamacpp":
        assert after["kv_cache_utilization"] == 0.0
        assert after["avg_ttft_seconds"] is not None and 0 < after["avg_ttft_seconds"] < 5
    assert after["avg_itl_seconds"] is not None and 0 < after["avg_itl_seconds"] < 5
    assert app.state.requests_total == 3


@pytest.mark.parametrize("kind", KINDS)
async def test_an_unhealthy_sim_fails_its_engine_s_health_check(
    nursery: trio.Nursery, kind: str
) -> None:
    app, url = await _start(nursery, kind)
    adapter = get_adapter(kind)
    ep = adapter.endpoints(url, None, None)
    app.update_state({"healthy": False})
    async with httpx.AsyncClient() as client:
        assert not await adapter.check_health(client, ep, MODEL)
        if kind == "llamacpp":
            answer = await client.get(f"{url}/health")
            assert answer.json()["error"]["message"] == "Loading model"


@pytest.mark.parametrize("kind", KINDS)
async def test_each_kind_serves_the_endpoints_its_adapter_says_it_does(
    nursery: trio.Nursery, kind: str
) -> None:
    """agent/engines/endpoints.py and the look-alike agree on every client path."""
    _, url = await _start(nursery, kind)
    adapter = get_adapter(kind)
    async with httpx.AsyncClient(base_url=url) as client:
        for path in sorted(API_PATHS):
            answer = await client.post(path, json={})
            # A path it serves answers the empty body with a client error of its API.
            assert (answer.status_code != 404) == adapter.serves(path), (kind, path)
        tokenize = await client.post("/tokenize", json={"model": MODEL, "prompt": "a b"})
        assert (tokenize.status_code == 200) == (kind in ("vllm", "sglang"))


async def test_ollama_lists_the_model_under_its_tag_and_takes_either_name(
    nursery: trio.Nursery,
) -> None:
    app, url = await _start(nursery, "ollama")
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/")).text == "Ollama is running"
        tags = (await client.get("/api/tags")).json()
        assert [m["name"] for m in tags["models"]] == ["llama3.1:latest"]
        assert (await client.get("/api/version")).json()["version"]
        for name in ("llama3.1", "llama3.1:latest"):
            body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        app.update_state({"healthy": False})
        assert (await client.get("/api/tags")).json() == {"models": []}


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        create_sim_app(MODEL, kind="tgi")
