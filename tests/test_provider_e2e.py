"""Provider fallback through a real router: the last step after the local chain."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import trio

from router.tenants.config import hash_key
from tests.fleet import ADMIN_KEY, Fleet, Router, wait_until
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
        assert fake.requests[-1].body.get("stream") is True

        log = router.log()
        assert (
            'reason="routing_policy: gate[4] match [engine(got=\\"sim\\",want=\\"vllm\\")=1]' in log
        )
        assert 'nowhere: gate[4] match [region(got=\\"\\",want=\\"Nowhere\\")=1]' in log
        # The outcome is logged on success too (upstream: provider, model, request ID
        # and outcome), after the exhaustion warning, at info.
        rid = raw.headers["x-request-id"]
        exhausted = log.index(f"req={rid} model=")
        served = log.index(
            f"level=info subsystem=provider req={rid} provider=openai model=gpt-4o-mini"
            " provider_served stream=false tenant=default\n"
        )
        assert exhausted < served
        assert " provider_served stream=true tenant=default\n" in log
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

        # Provider down or refusing: a backend error, counted as exhausted; a busy
        # provider (429) is backend_unavailable, as INTERFACE.md has a backend's 429.
        for knob, status, code in (
            ({"fail_status": 500}, 502, "backend_error"),
            ({"fail_status": 429}, 503, "backend_unavailable"),
            ({"close_connection": True}, 502, "backend_error"),
        ):
            fake.knobs.fail_status = knob.get("fail_status")
            fake.knobs.close_connection = bool(knob.get("close_connection"))
            r = await trio.to_thread.run_sync(
                lambda: httpx.post(
                    router.url + "/v1/chat/completions",
                    json={"model": "m1", "messages": [{"role": "user", "content": "x"}]},
                    timeout=30,
                )
            )
            assert r.status_code == status, (knob, r.text)
            error = r.json()["error"]
            assert error["code"] == code
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


async def test_provider_streams_reach_the_sdks_as_they_arrive(fleet: Fleet, tmp_path: Path) -> None:
    fake = FakeOpenAI("sk-test")
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        router = start_router(fleet, tmp_path, "openai", fake.base_url)
        fleet.agent(router, "m1")
        token = trio.lowlevel.current_trio_token()

        def release() -> None:
            gate = fake.knobs.gate
            assert gate is not None
            trio.from_thread.run_sync(gate.set, trio_token=token)

        # An Anthropic client, an OpenAI provider: the provider holds its answer until
        # the client has seen the first event, so that event came before the end.
        fake.knobs.gate = trio.Event()

        def claude_stream() -> tuple[str, list[str], object]:
            client = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
            kinds: list[str] = []
            with client.messages.stream(
                model="m1", max_tokens=50, messages=[{"role": "user", "content": "hello there"}]
            ) as stream:
                for event in stream:
                    if not kinds:
                        release()
                    kinds.append(event.type)
                final = stream.get_final_message()
            return final.content[0].text, kinds, final.usage

        text, kinds, usage = await trio.to_thread.run_sync(claude_stream)
        assert text == "echo: hello there"
        assert kinds[0] == "message_start" and "content_block_delta" in kinds
        assert getattr(usage, "output_tokens", 0) > 0
        assert fake.requests[-1].path == "/v1/chat/completions"

        # The Responses API, same format both sides, streamed the same way.
        fake.knobs.gate = trio.Event()

        def responses_stream() -> str:
            client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
            text = ""
            for event in client.responses.create(model="m1", input="hello there", stream=True):
                if event.type == "response.created":
                    release()
                elif event.type == "response.output_text.delta":
                    text += event.delta
            return text

        assert await trio.to_thread.run_sync(responses_stream) == "echo: hello there"
        assert fake.requests[-1].path == "/v1/responses"

        # The provider breaks off after its first event: the client's stream ends with
        # an error event the SDK raises, not with a silent cut.
        fake.knobs.gate = None
        fake.knobs.break_stream = True

        def broken_chat() -> None:
            client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
            for _ in client.chat.completions.create(
                model="m1", messages=[{"role": "user", "content": "x"}], stream=True
            ):
                pass

        with pytest.raises(openai.APIError) as broken:
            await trio.to_thread.run_sync(broken_chat)
        assert "backend_error" in str(broken.value.body) or "stream" in str(broken.value)
        assert "provider_stream_broken provider=openai" in router.log()

        # The provider's own error event after its first: the router's error event in
        # the client's protocol (code and source), which each SDK raises, and a log line.
        fake.knobs.break_stream = False
        fake.knobs.error_event = 1
        with pytest.raises(openai.APIError) as failed:
            await trio.to_thread.run_sync(broken_chat)
        assert failed.value.code == "backend_error"
        assert failed.value.body["source"] == "backend"  # type: ignore[index]
        assert failed.value.message.startswith("openai provider stream failed: server_error")

        def claude_failed() -> None:
            client = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
            with client.messages.stream(
                model="m1", max_tokens=50, messages=[{"role": "user", "content": "x"}]
            ) as stream:
                stream.get_final_message()

        with pytest.raises(anthropic.APIStatusError) as claude_error:
            await trio.to_thread.run_sync(claude_failed)
        body = claude_error.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["code"] == "backend_error"
        assert body["error"]["source"] == "backend"
        assert router.log().count("provider_stream_broken provider=openai") == 3
        # In place of the first event: a whole error answer the SDK raises by its status.
        fake.knobs.error_event = 0
        with pytest.raises(openai.InternalServerError) as before:
            await trio.to_thread.run_sync(broken_chat)
        assert before.value.status_code == 502 and before.value.code == "backend_error"
        nursery.cancel_scope.cancel()


async def test_a_client_leaving_a_provider_stream_frees_everything(
    fleet: Fleet, tmp_path: Path
) -> None:
    """The tenant's one concurrent slot comes back and the provider's connection is
    closed while the provider is still answering, when the client leaves."""
    key = "hnr-test-provider-stream-key"
    auth = tmp_path / "auth.yaml"
    auth.write_text(f'tenants:\n  one:\n    keys: ["{hash_key(key)}"]\n    max_concurrent: 1\n')
    fake = FakeOpenAI("sk-test")
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        router = start_router(fleet, tmp_path, "openai", fake.base_url, "--auth-file", str(auth))
        fleet.agent(router, "m1")
        headers = {"authorization": f"Bearer {key}"}
        body = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "stream": True}

        # A whole stream first: its usage (asked of the provider by the router, left out
        # of what the client sees) is charged to the tenant.
        def whole() -> bytes:
            url = router.url + "/v1/chat/completions"
            return httpx.post(url, json=body, headers=headers, timeout=30).content

        assert b'"usage"' not in await trio.to_thread.run_sync(whole)
        expected = fake.reply(fake.requests[-1])["usage"]["total_tokens"]

        def charged() -> bool:
            return router.metric("hivenet_router_tenant_tokens_total", tenant="one") == expected

        # The charge follows the answer's last byte (the ticket closes after it).
        await trio.to_thread.run_sync(lambda: wait_until(charged, 10, "stream usage charged"))
        fake.knobs.gate = trio.Event()

        def leave_after_the_first_event() -> bytes:
            with (
                httpx.Client(timeout=30) as client,
                client.stream(
                    "POST", router.url + "/v1/chat/completions", json=body, headers=headers
                ) as answer,
            ):
                return next(answer.iter_raw())

        first = await trio.to_thread.run_sync(leave_after_the_first_event)
        assert b"assistant" in first
        with trio.fail_after(20):
            await fake.stream_abandoned.wait()
        assert not fake.knobs.gate.is_set()  # the provider had not finished

        def second() -> int:
            plain = {**body, "stream": False}
            r = httpx.post(router.url + "/v1/chat/completions", json=plain, headers=headers)
            return r.status_code

        # The slot's release is the router's, after it noticed the client leave.
        status = 0
        with trio.fail_after(20):
            while status != 200:
                status = await trio.to_thread.run_sync(second)
                assert status in (200, 429)
        nursery.cancel_scope.cancel()


def test_a_per_model_policy_without_its_providers_key_is_named_in_the_warning(
    fleet: Fleet, tmp_path: Path
) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    named = "models: [m1]\n" + POLICY.format(engine="anthropic", model="claude-3-5-haiku-latest")
    (policies / "chat.yaml").write_text(named)
    router = fleet.router("--policy-model-dir", str(policies))
    router.wait_log("provider_fallback_disabled name=chat engine=anthropic")
    # A named policy put at run time is warned about as well.
    put = httpx.put(
        router.url + "/admin/policy/models/late",
        content=named.replace("[m1]", "[m2]").replace("anthropic", "openai"),
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    )
    assert put.status_code == 200, put.text
    router.wait_log("provider_fallback_disabled name=late engine=openai")
