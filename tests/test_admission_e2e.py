"""Admission control, tenants in logs and metrics, and token counting, with real
router and agent processes and the official SDKs.

Tenants come from `HIVENET_ROUTER_API_KEYS` (`key:tenant`); `shed_if` selects the
batch tenant by name. A simulated engine with a time to first token holds the single
slot long enough for the others to queue; nothing here depends on how long.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.fleet import Fleet, Router, free_port, wait_until

WEB_KEY, BATCH_KEY = "web-key", "batch-key"
KEYS = f"{WEB_KEY}:web,{BATCH_KEY}:batch"
SHED_POLICY = """\
routing_policy:
  shed_if:
    tenants: [batch]
    model_queue_depth: {gte: 1}
    retry_after: 3
  strategy: least-loaded
"""


def chat(router: Router, key: str, rid: str, out: dict[str, httpx.Response]) -> None:
    out[rid] = httpx.post(
        router.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}", "X-Request-ID": rid},
        json={"model": "m1", "messages": [{"role": "user", "content": "hello there"}]},
        timeout=60,
    )


def queue_length(router: Router) -> float:
    return router.metric("hivenet_router_queue_depth", model="m1")


def test_a_low_priority_tenant_is_shed_while_the_other_is_served_and_queued(
    fleet: Fleet, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(SHED_POLICY)
    router = fleet.router(
        "--policy-file",
        str(policy),
        env={"HIVENET_ROUTER_API_KEYS": KEYS, "GOLOG_LOG_LEVEL": "policy=debug"},
    )
    agent = fleet.agent(router, "m1", "--capacity", "1")
    # The engine holds the first web request until the batch tenant has been shed.
    agent.sim_state(hold=True)
    answers: dict[str, httpx.Response] = {}
    first, queued = str(uuid.uuid4()), str(uuid.uuid4())
    threads = [threading.Thread(target=chat, args=(router, WEB_KEY, first, answers))]
    threads[0].start()
    wait_until(lambda: router.agent(agent.peer_id)["status"]["active_requests"] == 1)
    threads.append(threading.Thread(target=chat, args=(router, WEB_KEY, queued, answers)))
    threads[1].start()
    wait_until(lambda: queue_length(router) == 1, what="the second web request queued")

    # The batch tenant is refused at once, in both protocols, while web traffic waits.
    shed = str(uuid.uuid4())
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=BATCH_KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(
            model="m1",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Request-ID": shed},
        )
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "3"
    body = caught.value.response.json()
    assert body["error"]["code"] == "load_shed"
    assert body["error"]["type"] == "api_error"
    assert "model_queue_depth(got=1,gte=1)" in body["error"]["message"]

    claude = anthropic.Anthropic(base_url=router.url, api_key=BATCH_KEY, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as refused:
        claude.messages.create(
            model="m1", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "3"
    assert refused.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert refused.value.body["error"]["code"] == "load_shed"  # type: ignore[index]

    agent.sim_state(hold=False)
    for thread in threads:
        thread.join(60)
    assert answers[first].status_code == 200
    assert answers[queued].status_code == 200

    assert router.metric("hivenet_router_policy_shed_total", tenant="batch", model="m1") == 2
    assert router.metric("hivenet_router_policy_shed_total", tenant="web") == 0
    assert router.metric("hivenet_router_routing_requests_routed_total", tenant="web") == 2
    assert router.metric("hivenet_router_routing_requests_routed_total", tenant="batch") == 0
    assert router.metric("hivenet_router_queue_wait_seconds_count", tenant="web") == 1
    # Per model, as the seeds query it, the totals are what they were before tenants.
    assert router.metric("hivenet_router_routing_requests_routed_total", model="m1") == 2
    assert router.metric("hivenet_router_policy_exhausted_total", model="m1") == 0

    log = router.log()
    (line,) = [line for line in log.splitlines() if f"req={shed}" in line and "load_shed" in line]
    assert 'model="m1" capability="llm" tenant=batch priority=0 load_shed' in line
    assert 'step=routing_policy rule="model_queue_depth(got=1,gte=1)" retry_after=3' in line
    assert "chain=[routing_policy] tried=1/1" in line
    # Every line about a request names its tenant.
    for rid, tenant in ((first, "web"), (queued, "web"), (shed, "batch")):
        lines = [line for line in log.splitlines() if f"req={rid}" in line]
        assert len(lines) >= 2, lines
        for line in lines:
            assert f"tenant={tenant}" in line, line
    assert re.search(rf"req={queued} queued step=routing_policy priority=0 tenant=web", log)


def test_count_tokens_through_the_anthropic_sdk(fleet: Fleet) -> None:
    router = fleet.router(env={"HIVENET_ROUTER_API_KEYS": KEYS})
    fleet.agent(router, "m1")
    claude = anthropic.Anthropic(base_url=router.url, api_key=WEB_KEY, max_retries=0)
    system = "You answer in one short sentence."
    messages: list = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Paris, I believe."}]},
        {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]},
    ]
    counted = claude.messages.count_tokens(model="m1", system=system, messages=messages)
    # The sim counts a prompt as its usage does: the same number the answer reports.
    answer = claude.messages.create(model="m1", max_tokens=4, system=system, messages=messages)
    assert counted.input_tokens == answer.usage.input_tokens == 18

    # Blocks the router cannot count are refused, never silently dropped.
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.count_tokens(
            model="m1",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        )
    assert "'image'" in caught.value.message
    assert router.metric("hivenet_router_routing_requests_routed_total", tenant="web") == 2
    assert (
        router.metric(
            "hivenet_router_http_requests_total",
            endpoint="/v1/messages/count_tokens",
            status="200",
            tenant="web",
        )
        == 1
    )


def test_count_tokens_is_refused_when_no_agent_has_a_tokenizer(
    fleet: Fleet, tmp_path: Path
) -> None:
    router = fleet.router(env={"HIVENET_ROUTER_API_KEYS": KEYS})
    # An Ollama agent (no /tokenize), its engine played by the sim.
    port = free_port()
    backend = subprocess.Popen(
        [sys.executable, "-m", "sim", "--model", "m2", "--port", str(port), "--kind", "ollama"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/api/tags").status_code == 200)
        fleet.agent(router, "m2", "--backend-url", f"http://127.0.0.1:{port}", engine="ollama")
        claude = anthropic.Anthropic(base_url=router.url, api_key=WEB_KEY, max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as caught:
            claude.messages.count_tokens(
                model="m2", messages=[{"role": "user", "content": "hello"}]
            )
        body = caught.value.body
        assert body["type"] == "error"  # type: ignore[index]
        assert body["error"]["code"] == "tokenizer_unavailable"  # type: ignore[index]
        assert "served by: ollama" in body["error"]["message"]  # type: ignore[index]
        # The same model still answers messages: only counting needs a tokenizer.
        answer = claude.messages.create(
            model="m2", max_tokens=4, messages=[{"role": "user", "content": "hello"}]
        )
        assert answer.usage.input_tokens == 1
        # An unknown model is the usual 404.
        with pytest.raises(anthropic.NotFoundError) as unknown:
            claude.messages.count_tokens(
                model="nope", messages=[{"role": "user", "content": "hello"}]
            )
        assert unknown.value.body["error"]["code"] == "model_not_found"  # type: ignore[index]
    finally:
        backend.terminate()
        backend.wait(10)
