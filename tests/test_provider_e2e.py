"""Provider fallback through a real router: the last step after the local chain."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import trio

from tests.fleet import Fleet, Router
from tests.provider_fakes import FakeAnthropic, FakeOpenAI

POLICY = """
routing_policy:
  match:
    engine: vllm
  strategy: least-loaded
fallback_chain:
  - name: nowhere
    match:
      region: Nowhere
    strategy: least-loaded
fallback_provider:
  engine: {engine}
  model: {model}
"""


def start_router(fleet: Fleet, tmp_path: Path, engine: str, base_url: str, *flags: str) -> Router:
    policy = tmp_path / f"policy-{engine}.yaml"
    model = "gpt-4o-mini" if engine == "openai" else "claude-3-5-haiku-latest"
    policy.write_text(POLICY.format(engine=engine, model=model))
    env = {
        "HIVENET_ROUTER_OPENAI_API_KEY": "sk-test",
        "HIVENET_ROUTER_OPENAI_BASE_URL": base_url,
        "HIVENET_ROUTER_ANTHROPIC_API_KEY": "ak-test",
        "HIVENET_ROUTER_ANTHROPIC_BASE_URL": base_url,
    }
    return fleet.router("--policy-file", str(policy), *flags, env=env)


def chat(router: Router, stream: bool = False, **extra: object) -> object:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello provider"}]
    if stream:
        parts = []
        for chunk in client.chat.completions.create(
            model="m1", messages=messages, stream=True, **extra
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)
    return client.chat.completions.with_raw_response.create(model="m1", messages=messages)


async def test_openai_provider_serves_after_the_local_chain(fleet: Fleet, tmp_path: Path) -> None:
    fake = FakeOpenAI("sk-test")
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        router = start_router(fleet, tmp_path, "openai", fake.base_url)
        agent = fleet.agent(router, "m1")

        raw = await trio.to_thread.run_sync(lambda: chat(router))
        answer = raw.parse()
        assert raw.headers["x-hivenet-served-by"] == "provider:openai"
        assert answer.choices[0].message.content == "echo: hello provider"
        assert answer.model == "gpt-4o-mini"
        assert fake.requests[-1].body["model"] == "gpt-4o-mini"
        assert fake.requests[-1].headers["authorization"] == "Bearer sk-test"

        streamed = await trio.to_thread.run_sync(lambda: chat(router, stream=True))
        assert streamed == "echo: hello provider"
        assert fake.requests[-1].body.get("stream") is False

        log = router.log()
        assert (
            'reason="routing_policy: gate[4] match [engine(got=\\"sim\\",want=\\"vllm\\")=1]' in log
        )
        assert 'nowhere: gate[4] match [region(got=\\"\\",want=\\"Nowhere\\")=1]' in log
        assert router.metric("hivenet_router_policy_provider_fallback_total", model="m1") == 2
        assert router.metric("hivenet_router_policy_exhausted_total", model="m1") == 0
        assert agent.sim_state()["requests_total"] == 0

        # Embeddings never go to the provider.
        seen = len(fake.requests)
        r = await trio.to_thread.run_sync(
            lambda: httpx.post(
                router.url + "/v1/embeddings", json={"model": "m1", "input": "x"}, timeout=10
            )
        )
        assert r.status_code == 503
        assert len(fake.requests) == seen

        # Provider down or refusing: a backend_error from the backend, counted as exhausted.
        for knob in ({"fail_status": 500}, {"fail_status": 429}, {"close_connection": True}):
            fake.knobs.fail_status = knob.get("fail_status")
            fake.knobs.close_connection = bool(knob.get("close_connection"))
            r = await trio.to_thread.run_sync(
                lambda: httpx.post(
                    router.url + "/v1/chat/completions",
                    json={"model": "m1", "messages": [{"role": "user", "content": "x"}]},
                    timeout=30,
                )
            )
            assert r.status_code == 502, (knob, r.text)
            error = r.json()["error"]
            assert error["code"] == "backend_error"
            assert error["source"] == "backend"
        # The embeddings request and the three failed provider calls.
        assert router.metric("hivenet_router_policy_exhausted_total", model="m1") == 4
        nursery.cancel_scope.cancel()


async def test_provider_slower_than_the_deadline_times_out(fleet: Fleet, tmp_path: Path) -> None:
    fake = FakeOpenAI("sk-test")
    fake.knobs.delay = 5
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        router = start_router(fleet, tmp_path, "openai", fake.base_url, "--request-timeout", "1s")
        fleet.agent(router, "m1")
        r = await trio.to_thread.run_sync(
            lambda: httpx.post(
                router.url + "/v1/chat/completions",
                json={"model": "m1", "messages": [{"role": "user", "content": "x"}]},
                timeout=30,
            )
        )
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "request_timeout"
        nursery.cancel_scope.cancel()


async def test_anthropic_provider_translates_both_ways(fleet: Fleet, tmp_path: Path) -> None:
    fake = FakeAnthropic("ak-test")
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        router = start_router(fleet, tmp_path, "anthropic", fake.base_url)
        fleet.agent(router, "m1")
        raw = await trio.to_thread.run_sync(lambda: chat(router))
        answer = raw.parse()
        assert raw.headers["x-hivenet-served-by"] == "provider:anthropic"
        assert answer.choices[0].message.content == "echo: hello provider"
        assert answer.choices[0].finish_reason == "stop"
        sent = fake.requests[-1]
        assert sent.path == "/v1/messages"
        assert sent.body["model"] == "claude-3-5-haiku-latest"
        assert sent.body["max_tokens"] == 4096
        assert sent.body["messages"] == [
            {"role": "user", "content": [{"type": "text", "text": "hello provider"}]}
        ] or sent.body["messages"] == [{"role": "user", "content": "hello provider"}]
        streamed = await trio.to_thread.run_sync(lambda: chat(router, stream=True))
        assert streamed == "echo: hello provider"
        nursery.cancel_scope.cancel()


def test_a_provider_without_its_key_is_skipped_with_a_warning(fleet: Fleet, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(engine="anthropic", model="claude-3-5-haiku-latest"))
    router = fleet.router("--policy-file", str(policy))
    fleet.agent(router, "m1")
    assert "provider_fallback_disabled engine=anthropic" in router.log()
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "x"}]},
        timeout=10,
    )
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_agents_available"
