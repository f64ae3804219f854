"""Admission control through a real router and simulated engines (issue 20): B1 caps,
B2 occupancy, and the occupancy given back on every way a request ends."""

from __future__ import annotations

import signal
import threading
from functools import partial
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import trio

from tests.fleet import Fleet, Router, wait_until
from tests.provider_fakes import FakeOpenAI

POLICY = """
max_input_tokens: 2000
images_max: 1
admit_budget_tokens: 100000
max_inflight: 2
routing_policy:
  strategy: least-loaded
"""
ENV = {"HIVENET_ROUTER_ADMIT_FRACTION": "1", "HIVENET_ROUTER_ADMIT_PARK_TIMEOUT": "300ms"}
CHAT = "/v1/chat/completions"


def inflight(router: Router) -> float:
    return router.metric("hivenet_router_admission_inflight_requests", model="m1")


def occupancy(router: Router) -> float:
    return router.metric("hivenet_router_admission_occupancy_tokens", model="m1")


def drained(router: Router) -> None:
    """The leak check: nothing held once every request has ended."""
    wait_until(lambda: inflight(router) == 0 and occupancy(router) == 0, 15, "occupancy 0")


def body(content: str = "hello", **extra: object) -> dict:
    return {"model": "m1", "messages": [{"role": "user", "content": content}], **extra}


def hold(router: Router, client_timeout: float | None, content: str = "hello") -> threading.Thread:
    """A request in a thread that ends however the router or `client_timeout` ends it."""

    def run() -> None:
        try:
            with httpx.stream(
                "POST", router.url + CHAT, json=body(content, stream=True), timeout=client_timeout
            ) as r:
                for _ in r.iter_bytes():
                    pass
        except httpx.HTTPError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


async def test_caps_occupancy_and_every_release_path(fleet: Fleet, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    router = fleet.router("--policy-file", str(policy), env=ENV)
    # The same agent behind a router whose deadline ends what the engine holds.
    short = fleet.router("--policy-file", str(policy), "--request-timeout", "1s", env=ENV)
    agent = fleet.agent([router, short], "m1")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)

    # B1, in each caller's protocol: 8,000 characters are about 2,500 tokens.
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "x" * 8000}], max_tokens=5
        )
    assert too_long.value.code == "input_too_long"
    assert "over the model limit of 2000" in str(too_long.value)
    claude = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    with pytest.raises(anthropic.BadRequestError) as images:
        claude.messages.create(
            model="m1",
            max_tokens=5,
            messages=[{"role": "user", "content": [image, image, {"type": "text", "text": "hi"}]}],
        )
    assert "2 images, over the model limit of 1" in str(images.value)
    assert router.metric("hivenet_router_admission_rejections_total", reason="b1") == 2
    assert agent.sim_state()["requests_total"] == 0

    # Success.
    answer = client.chat.completions.create(model="m1", messages=body()["messages"])
    assert answer.choices[0].message.content
    drained(router)

    # B2: two requests hold the pool (max_inflight 2, one replica) until the test lets
    # their clients go (the engine would take 30 s); the third parks 300 ms, then hears
    # 429 with Retry-After. The two clients leaving give their occupancy back.
    agent.sim_state(ttft=30.0)
    async with httpx.AsyncClient(timeout=None) as client, trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(partial(client.post, router.url + CHAT, json=body()))
        await trio.to_thread.run_sync(
            lambda: wait_until(lambda: inflight(router) == 2, 10, "two requests in flight")
        )
        assert occupancy(router) > 0
        refused = await trio.to_thread.run_sync(
            lambda: httpx.post(router.url + CHAT, json=body(), timeout=10)
        )
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert refused.headers["retry-after"] == "1"
        assert router.metric("hivenet_router_admission_rejections_total", reason="b2") == 1
        nursery.cancel_scope.cancel()
    router.wait_log("client_disconnected")
    drained(router)
    # The router's deadline (--request-timeout 1s) ends one the engine still holds.
    hold(short, client_timeout=None).join(15)
    short.wait_log("request_timeout")
    drained(short)

    # An engine error.
    agent.sim_state(ttft=0.0, fail_status=500, fail_count=1)
    failed = await trio.to_thread.run_sync(
        lambda: httpx.post(router.url + CHAT, json=body(), timeout=10)
    )
    assert failed.status_code >= 500
    drained(router)

    # An undeclared output grows the footprint as it streams; then the agent dies.
    # 0.2 s a token: the stream outlives the test's wait for it by far.
    agent.sim_state(token_latency=0.2)
    stream = hold(router, client_timeout=None, content="word " * 200)
    wait_until(lambda: inflight(router) == 1, 10, "one stream in flight")
    start = occupancy(router)
    wait_until(lambda: occupancy(router) >= start + 3, 10, "the footprint grows")
    agent.stop(signal.SIGKILL)
    stream.join(10)
    drained(router)


async def test_provider_fallback_gives_the_local_occupancy_back(
    fleet: Fleet, tmp_path: Path
) -> None:
    fake = FakeOpenAI("sk-test")
    fake.knobs.hold = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        policy = tmp_path / "policy.yaml"
        policy.write_text(
            "max_inflight: 1\nrouting_policy:\n  match:\n    engine: vllm\n"
            "  strategy: least-loaded\nfallback_provider:\n  engine: openai\n"
            "  model: gpt-4o-mini\n"
        )
        env = {
            **ENV,
            "HIVENET_ROUTER_OPENAI_API_KEY": "sk-test",
            "HIVENET_ROUTER_OPENAI_BASE_URL": fake.base_url,
        }
        router = fleet.router("--policy-file", str(policy), env=env)
        fleet.agent(router, "m1")

        def post() -> httpx.Response:
            return httpx.post(router.url + CHAT, json=body(), timeout=30)

        answers: list[httpx.Response] = []

        async def one() -> None:
            answers.append(await trio.to_thread.run_sync(post))

        async with trio.open_nursery() as calls:
            calls.start_soon(one)
            # While the provider holds the first answer, no local occupancy is held: a
            # second request fits under max_inflight 1 and reaches the provider too.
            await trio.to_thread.run_sync(lambda: wait_until(lambda: fake.requests, 10, "call"))
            assert inflight(router) == 0
            calls.start_soon(one)
            await trio.to_thread.run_sync(
                lambda: wait_until(lambda: len(fake.requests) == 2, 10, "the second call")
            )
            assert not answers
            fake.knobs.hold.set()
        assert [a.status_code for a in answers] == [200, 200]
        assert router.metric("hivenet_router_admission_rejections_total", reason="b2") == 0
        drained(router)
        nursery.cancel_scope.cancel()
