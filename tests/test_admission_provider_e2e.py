"""A serverless key's output on the fallback provider (issue 20): charged to the key's
output bucket of the model it asked for, streamed or not, from either provider."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import trio

from tests.fleet import Fleet
from tests.provider_fakes import FakeAnthropic, FakeOpenAI, FakeProvider

KEY_PLAIN, KEY_STREAM = (f"sk-hivenet-{n * 64}" for n in ("p", "s"))
CHAT = "/v1/chat/completions"


def _auth() -> str:
    # One output token per minute: any answer empties the bucket, and it takes a
    # minute to hold one token again, so the next request is refused b4_otpm.
    keys = "".join(
        f"""
    - key_hash: "{hashlib.sha256(key.encode()).hexdigest()}"
      metadata: {{name: {name}, owner: {name}}}
      mode: serverless
      quota: {{output_tokens_per_minute: 1}}"""
        for key, name in ((KEY_PLAIN, "plain"), (KEY_STREAM, "stream"))
    )
    return f"api:\n  mode: api-key\n  keys:{keys}\n"


def _post(url: str, key: str, stream: bool) -> httpx.Response:
    payload = {
        "model": "m1",
        "max_tokens": 64,
        "stream": stream,
        "messages": [{"role": "user", "content": "hello"}],
    }
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(url + CHAT, json=payload, headers=headers, timeout=30)


@pytest.mark.parametrize("engine", ["openai", "anthropic"])
async def test_provider_output_drains_the_keys_output_bucket(
    fleet: Fleet, tmp_path: Path, engine: str
) -> None:
    fake: FakeProvider = FakeOpenAI("sk-test") if engine == "openai" else FakeAnthropic("sk-test")
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        policy = tmp_path / "policy.yaml"
        # The only agent does not match: every request goes to the provider.
        policy.write_text(
            "routing_policy:\n  match:\n    engine: vllm\n  strategy: least-loaded\n"
            f"fallback_provider:\n  engine: {engine}\n  model: provider-model\n"
        )
        auth = tmp_path / "auth.yaml"
        auth.write_text(_auth())
        upper = engine.upper()
        env = {
            f"HIVENET_ROUTER_{upper}_API_KEY": "sk-test",
            f"HIVENET_ROUTER_{upper}_BASE_URL": fake.base_url,
        }
        router = fleet.router(
            "--policy-file", str(policy), "--auth-config-file", str(auth), env=env
        )
        fleet.agent(router, "m1")

        for key, stream in ((KEY_PLAIN, False), (KEY_STREAM, True)):
            first = await trio.to_thread.run_sync(_post, router.url, key, stream)
            assert first.status_code == 200, first.text
            second = await trio.to_thread.run_sync(_post, router.url, key, stream)
            assert second.status_code == 429, second.text
            assert "output tokens per minute" in second.json()["error"]["message"]
        assert len(fake.requests) == 2
        rejections = "hivenet_router_admission_rejections_total"
        assert router.metric(rejections, reason="b4_otpm", model="m1") == 2
        nursery.cancel_scope.cancel()


RPM_KEY = "sk-hivenet-" + "r" * 64
PER_REPLICA_AUTH = f"""
api:
  mode: api-key
  keys:
    - key_hash: "{hashlib.sha256(RPM_KEY.encode()).hexdigest()}"
      metadata: {{name: r, owner: acme}}
      quota:
        per_model:
          m1: {{requests_per_minute_per_replica: 1, tokens_per_day: 0}}
"""


async def test_no_healthy_replica_skips_the_per_replica_rate_unless_a_provider_answers(
    fleet: Fleet, tmp_path: Path
) -> None:
    fake = FakeOpenAI("sk-test")
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        auth = tmp_path / "auth.yaml"
        auth.write_text(PER_REPLICA_AUTH)
        policy = tmp_path / "policy.yaml"
        policy.write_text(
            "routing_policy:\n  strategy: least-loaded\n"
            "fallback_provider:\n  engine: openai\n  model: provider-model\n"
        )
        env = {
            "HIVENET_ROUTER_OPENAI_API_KEY": "sk-test",
            "HIVENET_ROUTER_OPENAI_BASE_URL": fake.base_url,
        }
        # No agent at all. Without a provider, routing's own error answers every
        # request: the rate (1 a minute per replica) is not what refuses the second.
        alone = fleet.router("--auth-config-file", str(auth))
        for _ in range(2):
            answer = await trio.to_thread.run_sync(_post, alone.url, RPM_KEY, False)
            assert answer.status_code != 429, answer.text
        # The provider serves the model: it counts as one replica, so the second
        # request in the minute is over the rate.
        served = fleet.router(
            "--auth-config-file", str(auth), "--policy-file", str(policy), env=env
        )
        first = await trio.to_thread.run_sync(_post, served.url, RPM_KEY, False)
        assert first.status_code == 200, first.text
        second = await trio.to_thread.run_sync(_post, served.url, RPM_KEY, False)
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "rate_limit_exceeded"
        nursery.cancel_scope.cancel()
