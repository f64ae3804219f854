"""The simulated engine's prefix cache: what it finds, what it evicts, how it is reported.

Cached tokens are read from the engine's own accounting (`usage.prompt_tokens_details`,
vLLM's prefix-cache counters), never from wall time; the prefill cost is checked on trio's
mock clock, where a sleep lasts exactly what the engine asked for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from sim.__main__ import serve_sim
from sim.app import SimEngine, create_sim_app

MODEL = "sim/cache-model"
# 100 words: six full 16-token blocks (96 tokens) and a partial seventh.
SYSTEM = " ".join(f"rule{i}" for i in range(100))


async def _start(nursery: trio.Nursery, **options: Any) -> tuple[SimEngine, str]:
    app = create_sim_app(MODEL, **options)
    port = await nursery.start(serve_sim, app, "127.0.0.1", 0)
    return app, f"http://127.0.0.1:{port}"


def _chat(system: str, question: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }


async def _cached(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    usage = (await client.post("/v1/chat/completions", json=body)).json()["usage"]
    cached: int = usage["prompt_tokens_details"]["cached_tokens"]
    return cached


async def test_a_second_request_with_the_same_long_prefix_is_served_from_the_cache(
    nursery: trio.Nursery,
) -> None:
    app, url = await _start(nursery)
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    first = await sdk.chat.completions.create(**_chat(SYSTEM, "first question"))
    second = await sdk.chat.completions.create(**_chat(SYSTEM, "second question"))
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 102
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The six full blocks of the shared system prompt; the rest is prefilled again.
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 96
    assert (app.metrics.prefix_cache_queries, app.metrics.prefix_cache_hits) == (204, 96)

    async with httpx.AsyncClient(base_url=url) as client:
        # The prompt as the chat template makes it: the same words from another role, or
        # as a raw completion prompt, are another prompt.
        as_user = {"model": MODEL, "messages": [{"role": "user", "content": SYSTEM}]}
        assert await _cached(client, as_user) == 0
        completion = await client.post("/v1/completions", json={"prompt": SYSTEM})
        assert completion.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Anthropic's top-level system prompt is the same system turn to the engine.
    claude = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    hits = app.metrics.prefix_cache_hits
    message = await claude.messages.create(
        model=MODEL,
        max_tokens=4,
        system=SYSTEM,
        messages=[{"role": "user", "content": "third question"}],
    )
    assert message.usage.input_tokens == 102
    assert app.metrics.prefix_cache_hits == hits + 96


async def test_the_least_recently_used_blocks_are_evicted_first(nursery: trio.Nursery) -> None:
    # Blocks of 4 tokens, room for 4: each 9-word system prompt fills two blocks.
    _, url = await _start(nursery, prefix_block_tokens=4, prefix_cache_blocks=4)
    a, b, c = (" ".join(f"{name}{i}" for i in range(9)) for name in "abc")
    async with httpx.AsyncClient(base_url=url) as client:
        assert await _cached(client, _chat(a, "q")) == 0
        assert await _cached(client, _chat(b, "q")) == 0
        assert await _cached(client, _chat(a, "q")) == 8  # a is now the most recent
        assert await _cached(client, _chat(c, "q")) == 0  # evicts b, not a
        assert await _cached(client, _chat(a, "q")) == 8
        assert await _cached(client, _chat(b, "q")) == 0

        # A prompt exactly two blocks long: vLLM computes its last token again, so only
        # the first block counts as a hit.
        exact = {"model": MODEL, "messages": [{"role": "user", "content": "x " * 8}]}
        assert await _cached(client, exact) == 0
        assert await _cached(client, exact) == 4

        await client.post("/sim/state", json={"prefix_cache_blocks": 0})
        assert await _cached(client, _chat(a, "q")) == 0
        assert await _cached(client, _chat(a, "q")) == 0


async def test_the_prefix_cache_counters_have_vllms_names(nursery: trio.Nursery) -> None:
    _, url = await _start(nursery)
    async with httpx.AsyncClient(base_url=url) as client:
        for question in ("one", "two"):
            await client.post("/v1/chat/completions", json=_chat(SYSTEM, question))
        text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {}
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        assert families[name].type == "counter"
        (sample,) = families[name].samples
        assert sample.name == name + "_total"
        assert sample.labels == {"engine": "0", "model_name": MODEL}
        samples[name] = sample.value
    assert samples == {"vllm:prefix_cache_queries": 202.0, "vllm:prefix_cache_hits": 96.0}


async def test_bad_prefix_cache_settings_are_refused_and_change_nothing(
    nursery: trio.Nursery,
) -> None:
    app, url = await _start(nursery)
    bad = [
        {"prefix_block_tokens": 0},
        {"prefix_block_tokens": 4097},
        {"prefix_block_tokens": True},
        {"prefix_block_tokens": "16"},
        {"prefix_cache_blocks": -1},
        {"prefix_cache_blocks": 2**20 + 1},
        {"prefix_cache_blocks": 1.5},
        {"prefill_token_latency": -0.001},
        {"prefill_token_latency": None},
        {"prefill_shared": 1},
    ]
    async with httpx.AsyncClient(base_url=url) as client:
        before = (await client.get("/sim/state")).json()
        for change in bad:
            answer = await client.post("/sim/state", json={"ttft": 0.5, **change})
            assert answer.status_code == 400
            assert answer.json()["detail"].startswith(next(iter(change)) + ":")
        assert (await client.get("/sim/state")).json() == before
    assert (before["prefix_block_tokens"], before["prefix_cache_blocks"]) == (16, 8192)
    assert before["prefill_token_latency"] == 0.0
    assert before["prefill_shared"] is False
    with pytest.raises(ValueError, match="prefix_block_tokens"):
        create_sim_app(MODEL, prefix_block_tokens=0)
    assert app.state.ttft == 0.0


async def _post(app: SimEngine, path: str, payload: dict[str, Any]) -> dict[str, Any]:
    """One request straight to the ASGI app; the client never leaves."""
    requests = [{"type": "http.request", "body": json.dumps(payload).encode()}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "path": path, "method": "POST"}, receive, send)
    assert sent[0]["status"] == 200
    answer: dict[str, Any] = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    return answer


def test_prefill_takes_time_per_uncached_token_and_decode_per_generated_token() -> None:
    app = create_sim_app(MODEL, ttft=0.05, token_latency=0.02, prefill_token_latency=0.001)

    async def timed(question: str) -> tuple[float, dict[str, Any]]:
        start = trio.current_time()
        answer = await _post(app, "/v1/chat/completions", _chat(SYSTEM, question))
        return trio.current_time() - start, answer

    async def main() -> None:
        cold, answer = await timed("first question")
        assert answer["choices"][0]["message"]["content"] == "Echo: first question"
        # 102 prompt tokens prefilled, then 3 pieces: 2 gaps of decode.
        assert cold == pytest.approx(0.05 + 0.001 * 102 + 0.02 * 2)
        warm, answer = await timed("second question")
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        assert warm == pytest.approx(0.05 + 0.001 * 6 + 0.02 * 2)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_shared_prefill_runs_one_prompt_at_a_time_and_finds_what_the_one_before_cached() -> None:
    async def main(shared: bool) -> list[float]:
        app = create_sim_app(MODEL, prefill_token_latency=0.001, prefill_shared=shared)
        done: list[float] = []

        async def one(question: str) -> None:
            await _post(app, "/v1/chat/completions", _chat(SYSTEM, question))
            done.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for question in ("first question", "second question"):
                nursery.start_soon(one, question)
                await trio.testing.wait_all_tasks_blocked()
        return done

    # Per slot, both prefill their 102 tokens at once; shared, the second waits for the
    # lane and then finds the 96 tokens the first cached, prefilling only 6.
    assert trio.run(main, False, clock=trio.testing.MockClock(autojump_threshold=0)) == [
        pytest.approx(0.102),
        pytest.approx(0.102),
    ]
    assert trio.run(main, True, clock=trio.testing.MockClock(autojump_threshold=0)) == [
        pytest.approx(0.102),
        pytest.approx(0.108),
    ]


def test_python_m_sim_refuses_a_bad_prefix_cache_flag() -> None:
    engine = subprocess.run(
        [sys.executable, "-m", "sim", "--model", "m", "--prefix-cache-blocks", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert engine.returncode == 2
    assert "prefix_cache_blocks: must be in [0, 1048576]" in engine.stderr
