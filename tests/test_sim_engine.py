"""The simulated engine over real HTTP, met by httpx and the official OpenAI and
Anthropic SDKs as a vLLM server would be."""

from __future__ import annotations

import base64
import json
import math
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import trio
import trio.testing

from agent.engines import get_adapter
from protocol.p2p import load_or_create_identity, peer_id_of
from sim.__main__ import serve_sim
from sim.app import SimEngine, create_sim_app
from sim.faults import MALFORMED
from tests.fleet import free_port, wait_until

MODEL = "sim/test-model"


async def _start(nursery: trio.Nursery, **options: float) -> tuple[SimEngine, str]:
    app = create_sim_app(MODEL, **options)  # type: ignore[arg-type]
    port = await nursery.start(serve_sim, app, "127.0.0.1", 0)
    return app, f"http://127.0.0.1:{port}"


async def _eventually(check: Callable[[], bool]) -> None:
    """Wait for the server side to catch up with what the client already saw."""
    with trio.fail_after(5):
        while True:
            if check():
                return
            await trio.sleep(0.01)


def _chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def test_health_models_and_state_control(nursery: trio.Nursery) -> None:
    _, url = await _start(nursery)
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/health")).status_code == 200
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == [MODEL]

        state = (await client.post("/sim/state", json={"healthy": False})).json()
        assert state["healthy"] is False
        assert (await client.get("/health")).status_code == 503
        await client.post("/sim/state", json={"healthy": True})
        assert (await client.get("/health")).status_code == 200

        # All or nothing: one bad value leaves every setting as it was.
        bad = await client.post("/sim/state", json={"ttft": 0.5, "token_latency": -1})
        assert bad.status_code == 400
        assert "token_latency" in bad.json()["detail"]
        unknown = await client.post("/sim/state", json={"speed": 2})
        assert unknown.status_code == 400
        state = (await client.get("/sim/state")).json()
        assert state["ttft"] == 0.0
        assert {"requests_total", "cancelled_total", "in_flight"} <= set(state)

        assert (await client.get("/nope")).status_code == 404
        assert (await client.get("/v1/chat/completions")).status_code == 405


async def test_hold_keeps_requests_in_the_engine_until_it_is_lifted(
    nursery: trio.Nursery,
) -> None:
    app, url = await _start(nursery)
    async with httpx.AsyncClient(base_url=url) as client:
        await client.post("/sim/state", json={"hold": True})
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await client.post("/v1/chat/completions", json=_chat("hi")))

        async with trio.open_nursery() as asking:
            for _ in range(2):
                asking.start_soon(ask)
            await _eventually(lambda: app.state.in_flight == 2)
            await trio.testing.wait_all_tasks_blocked()
            assert answers == []
            await client.post("/sim/state", json={"hold": False})
        assert [a.status_code for a in answers] == [200, 200]


async def test_chat_with_openai_sdk(nursery: trio.Nursery) -> None:
    _, url = await _start(nursery)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
        ],
    )
    assert answer.choices[0].message.content == "Echo: hello there"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (4, 3)

    cut = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "one two three"}], max_tokens=2
    )
    assert cut.choices[0].message.content == "Echo: one"
    assert cut.choices[0].finish_reason == "length"

    # Content given as parts, and vLLM's ignore_eos for a fixed answer length.
    fixed = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "a b"}]}],
        max_tokens=7,
        extra_body={"ignore_eos": True},
    )
    assert fixed.choices[0].message.content == "Echo: a b Echo: a b Echo:"
    assert fixed.usage is not None and fixed.usage.completion_tokens == 7


async def test_chat_stream_is_spaced_by_token_latency(nursery: trio.Nursery) -> None:
    latency = 0.05
    _, url = await _start(nursery, token_latency=latency)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
    words = "w1 w2 w3 w4 w5 w6 w7"
    started = trio.current_time()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": words}],
        stream=True,
        stream_options={"include_usage": True},
    )
    arrivals: list[float] = []
    pieces: list[str] = []
    finish: list[str | None] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        if chunk.choices[0].delta.content:
            arrivals.append(trio.current_time())
            pieces.append(chunk.choices[0].delta.content)
        finish.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == "Echo: " + words
    assert len(pieces) == 8  # one chunk per token
    assert finish[-1] == "stop"
    assert usage is not None and usage.completion_tokens == 8
    generation = 7 * latency
    # The first token reached the client before the last one was even generated...
    assert arrivals[0] - started < generation
    # ...and the tokens came spaced by the latency, not in one burst.
    assert arrivals[-1] - arrivals[0] >= 0.8 * generation


async def test_completions_endpoint(nursery: trio.Nursery) -> None:
    _, url = await _start(nursery)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
    prompt = " ".join(f"t{i}" for i in range(30))
    answer = await client.completions.create(model=MODEL, prompt=prompt)
    # The legacy API's default of 16 tokens.
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 16
    stream = await client.completions.create(model=MODEL, prompt="x y", stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream])
    assert text == "Echo: x y"


async def test_messages_with_anthropic_sdk(nursery: trio.Nursery) -> None:
    _, url = await _start(nursery, token_latency=0.001)
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused")
    message = await client.messages.create(
        model=MODEL,
        max_tokens=64,
        system="be brief",
        messages=[{"role": "user", "content": "hi sim"}],
    )
    assert message.content[0].type == "text"
    assert message.content[0].text == "Echo: hi sim"
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (4, 3)

    events = await client.messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "a b c"}], stream=True
    )
    kinds = [event.type async for event in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]

    async with client.messages.stream(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "stream me"}]
    ) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert texts == ["Echo:", " stream", " me"]
    assert final.content[0].type == "text" and final.content[0].text == "Echo: stream me"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 3


async def test_embeddings(nursery: trio.Nursery) -> None:
    _, url = await _start(nursery)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
    # The SDK asks for base64 unless told otherwise, and decodes it.
    result = await client.embeddings.create(model=MODEL, input=["alpha", "beta"])
    first, second = (item.embedding for item in result.data)
    assert len(first) == 8
    assert first != second
    assert math.fsum(v * v for v in first) == pytest.approx(1.0, abs=1e-6)
    assert result.usage.prompt_tokens == 2

    async with httpx.AsyncClient(base_url=url) as http:
        floats = (
            await http.post(
                "/v1/embeddings",
                json={"model": MODEL, "input": "alpha", "encoding_format": "float"},
            )
        ).json()
        again = (await http.post("/v1/embeddings", json={"input": "alpha"})).json()
        wide = (await http.post("/v1/embeddings", json={"input": "alpha", "dimensions": 32})).json()
        packed = (
            await http.post("/v1/embeddings", json={"input": "alpha", "encoding_format": "base64"})
        ).json()
    vector = floats["data"][0]["embedding"]
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    assert vector == again["data"][0]["embedding"]  # deterministic
    assert vector == pytest.approx(first, abs=1e-6)  # float32 round trip of the same vector
    assert len(wide["data"][0]["embedding"]) == 32
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert list(struct.unpack("<8f", raw)) == pytest.approx(vector, abs=1e-6)


async def test_rerank(nursery: trio.Nursery) -> None:
    _, url = await _start(nursery)
    documents = [
        "Berlin is in Germany",
        "Paris is the capital of France",
        {"text": "The capital of Italy is Rome"},
    ]
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post(
            "/v1/rerank",
            json={"model": MODEL, "query": "capital of France", "documents": documents, "top_n": 2},
        )
    body = response.json()
    assert response.status_code == 200
    assert body["model"] == MODEL and body["id"]
    assert [r["index"] for r in body["results"]] == [1, 2]
    assert body["results"][0]["document"] == {"text": "Paris is the capital of France"}
    assert body["results"][0]["relevance_score"] == pytest.approx(1.0)
    assert body["results"][1]["relevance_score"] == pytest.approx(2 / 3)
    assert body["usage"]["total_tokens"] == 3 * 3 + 4 + 6 + 6


async def test_context_length_error(nursery: trio.Nursery) -> None:
    _, url = await _start(nursery, max_context=16)
    long_prompt = " ".join(["word"] * 20)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_prompt}]
        )
    assert caught.value.status_code == 400
    async with httpx.AsyncClient(base_url=url) as http:
        too_long = await http.post("/v1/chat/completions", json=_chat(long_prompt))
        with_completion = await http.post("/v1/chat/completions", json=_chat("a b", max_tokens=15))
        anthropic_style = await http.post(
            "/v1/messages",
            json={
                "model": MODEL,
                "max_tokens": 4,
                **{"messages": [{"role": "user", "content": long_prompt}]},
            },
        )
        embedding = await http.post("/v1/embeddings", json={"input": long_prompt})
    assert too_long.status_code == 400
    assert too_long.json() == {
        "object": "error",
        "message": "This model's maximum context length is 16 tokens. However, you requested "
        "20 tokens in the messages, Please reduce the length of the messages.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert with_completion.json()["message"].startswith(
        "This model's maximum context length is 16 tokens. However, you requested 17 tokens "
        "(2 in the messages, 15 in the completion)."
    )
    error = anthropic_style.json()
    assert anthropic_style.status_code == 400
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "maximum context length is 16 tokens" in error["error"]["message"]
    assert embedding.status_code == 400
    assert "maximum context length is 16 tokens" in embedding.json()["message"]


async def test_bad_requests(nursery: trio.Nursery) -> None:
    _, url = await _start(nursery)
    async with httpx.AsyncClient(base_url=url) as client:
        other_model = await client.post("/v1/chat/completions", json={**_chat("x"), "model": "gpt"})
        not_json = await client.post("/v1/chat/completions", content=b"{nope")
        no_messages = await client.post("/v1/chat/completions", json={"model": MODEL})
        no_max_tokens = await client.post(
            "/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
    assert other_model.status_code == 404
    assert other_model.json()["message"] == "The model `gpt` does not exist."
    assert not_json.status_code == 400 and not_json.json()["type"] == "BadRequestError"
    assert no_messages.status_code == 400
    assert no_max_tokens.status_code == 400
    assert no_max_tokens.json()["type"] == "error"


async def test_fail_injection(nursery: trio.Nursery) -> None:
    app, url = await _start(nursery)
    async with httpx.AsyncClient(base_url=url) as client:
        await client.post(
            "/sim/state",
            json={"fail_status": 503, "fail_body": {"error": "overloaded"}, "fail_count": 2},
        )
        statuses = []
        for _ in range(3):
            response = await client.post("/v1/chat/completions", json=_chat("hi"))
            statuses.append(response.status_code)
            if response.status_code == 503:
                assert response.json() == {"error": "overloaded"}
        assert statuses == [503, 503, 200]

        await client.post(
            "/sim/state", json={"fail_status": 503, "fail_body": "server busy", "fail_count": 1}
        )
        busy = await client.post("/v1/embeddings", json={"input": "x"})
        assert (busy.status_code, busy.text) == (503, "server busy")
        assert busy.headers["content-type"].startswith("text/plain")

        await client.post(
            "/sim/state", json={"fail_status": 500, "fail_body": None, "fail_count": 1}
        )
        default = await client.post("/v1/messages", json={"max_tokens": 1, "messages": []})
        assert default.status_code == 500 and default.json()["code"] == 500

        state = (await client.get("/sim/state")).json()
    assert state["requests_total"] == 5
    assert state["fail_count"] == 0
    assert app.state.cancelled_total == 0


async def test_malformed_answers(nursery: trio.Nursery) -> None:
    _, url = await _start(nursery)
    async with httpx.AsyncClient(base_url=url) as client:
        bad = await client.post("/sim/state", json={"malformed": "nonsense"})
        assert bad.status_code == 400 and "sse_cut" in bad.text
        answers = {}
        for shape in MALFORMED:
            await client.post("/sim/state", json={"malformed": shape, "fail_count": 1})
            r = await client.post("/v1/chat/completions", json=_chat("hi"))
            answers[shape] = (r.status_code, r.headers["content-type"].split(";")[0], r.content)
        ok = await client.post("/v1/chat/completions", json=_chat("hi"))
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Echo: hi"
    assert answers["garbage"][:2] == (200, "application/json")
    assert answers["empty"] == (200, "application/json", b"")
    assert answers["html"][1] == "text/html" and answers["html"][2].startswith(b"<html>")
    assert json.loads(answers["not_object"][2]) == ["not", "an", "object"]
    assert answers["sse_cut"][1] == "text/event-stream"
    assert not answers["sse_cut"][2].endswith(b"\n")
    assert answers["sse_bad_data"][2].startswith(b"data: upstream hiccup")
    first, second, _ = answers["sse_bad_later"][2].split(b"\n\n")
    assert json.loads(first[len(b"data: ") :])["object"] == "chat.completion.chunk"
    assert second == b"data: upstream hiccup, not json"


async def test_disconnect_mid_stream_is_counted(nursery: trio.Nursery) -> None:
    app, url = await _start(nursery, token_latency=0.02)
    async with httpx.AsyncClient(base_url=url) as client:
        # Finished requests, streamed or not, are never counted as cancelled.
        await client.post("/v1/chat/completions", json=_chat("a b"))
        async with client.stream(
            "POST", "/v1/chat/completions", json=_chat("a b", stream=True)
        ) as r:
            await r.aread()
        async with client.stream(
            "POST", "/v1/chat/completions", json=_chat(" ".join(["w"] * 200), stream=True)
        ) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if '"content":"Echo:"' in line:
                    break
            # Leaving the block closes the connection mid-answer.
    await _eventually(lambda: app.state.in_flight == 0)
    assert app.state.cancelled_total == 1
    assert app.state.requests_total == 3


async def test_metrics_follow_load(nursery: trio.Nursery) -> None:
    app, url = await _start(nursery, capacity=2)
    sampler = get_adapter("sim").new_sampler(MODEL)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:

        async def scrape() -> dict[str, float | None]:
            response = await client.get("/metrics")
            assert response.headers["content-type"].startswith("text/plain")
            return sampler.update(response.text, trio.current_time())

        idle = await scrape()
        assert (idle["running_requests"], idle["waiting_requests"]) == (0.0, 0.0)
        assert idle["kv_cache_utilization"] == 0.0
        assert idle["avg_ttft_seconds"] is None

        # Three requests that stall after one token on an engine that runs two at a time.
        await client.post("/sim/state", json={"stall_after_tokens": 1})
        async with trio.open_nursery() as requests:
            for _ in range(3):
                post = partial(client.post, json=_chat("a b c", stream=True))
                requests.start_soon(post, "/v1/chat/completions")
            await _eventually(lambda: app.state.in_flight == 3)
            busy = await scrape()
            assert (busy["running_requests"], busy["waiting_requests"]) == (2.0, 1.0)
            assert busy["kv_cache_utilization"] == 1.0
            await client.post("/sim/state", json={"kv_cache_utilization": 0.3})
            assert (await scrape())["kv_cache_utilization"] == pytest.approx(0.3)
            requests.cancel_scope.cancel()
        await _eventually(lambda: app.state.in_flight == 0)
        assert app.state.cancelled_total == 3
        await client.post(
            "/sim/state",
            json={
                "stall_after_tokens": None,
                "kv_cache_utilization": None,
                "token_latency": 0.02,
                "ttft": 0.03,
            },
        )
        # A new sampler: its window holds only the two requests below, not the three
        # cancelled ones, whose first token came at once.
        sampler = get_adapter("sim").new_sampler(MODEL)
        after = await scrape()
        assert (after["running_requests"], after["kv_cache_utilization"]) == (0.0, 0.0)

        for _ in range(2):
            await client.post("/v1/chat/completions", json=_chat("a b c d", stream=True))
        served = await scrape()
    # The histograms observed what the two requests lived through: TTFT about 0.03 s,
    # tokens 0.02 s apart (scheduling adds a little, never subtracts).
    assert served["avg_ttft_seconds"] is not None and 0.03 <= served["avg_ttft_seconds"] < 0.3
    assert served["p90_ttft_seconds"] is not None and 0.025 <= served["p90_ttft_seconds"] <= 0.25
    assert served["avg_itl_seconds"] is not None and 0.02 <= served["avg_itl_seconds"] < 0.1
    assert served["p90_itl_seconds"] is not None and 0.01 <= served["p90_itl_seconds"] <= 0.1


async def test_metrics_text_is_vllm_shaped(nursery: trio.Nursery) -> None:
    _, url = await _start(nursery)
    async with httpx.AsyncClient(base_url=url) as client:
        await client.post("/v1/chat/completions", json=_chat("one two"))
        text = (await client.get("/metrics")).text
    labels = f'engine="0",model_name="{MODEL}"'
    assert f"vllm:num_requests_running{{{labels}}} 0.0" in text
    assert f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} 1.0' in text
    assert f"vllm:inter_token_latency_seconds_count{{{labels}}} 2.0" in text
    assert f"vllm:generation_tokens_total{{{labels}}} 3.0" in text
    assert f"vllm:prompt_tokens_total{{{labels}}} 2.0" in text


def test_state_is_json_serialisable() -> None:
    app = create_sim_app(MODEL)
    app.update_state({"fail_body": {"a": [1, 2]}, "stall_after_tokens": 3})
    with pytest.raises(ValueError, match="fail_count"):
        app.update_state({"fail_count": True})
    assert json.loads(json.dumps(app.state.__dict__))["stall_after_tokens"] == 3


# Runs in a fresh interpreter as if the `sim` extra were not installed: a None entry in
# sys.modules makes `import hypercorn` raise ImportError, as a missing package does.
_WITHOUT_HYPERCORN = "import sys; sys.modules['hypercorn'] = None; "


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        cwd=Path(__file__).parent.parent,
    )


def test_the_daemons_and_the_sim_adapter_load_neither_the_sim_nor_hypercorn() -> None:
    loaded = _python(
        "import sys, agent.app, agent.engines, router.app; "
        "agent.engines.get_adapter('sim'); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sim', 'hypercorn'}))"
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"


def test_the_sim_imports_neither_daemon() -> None:
    loaded = _python(
        "import sys, sim.__main__, sim.app; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'agent', 'router'}))"
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"


def test_an_agent_with_engine_sim_but_no_sim_extra_exits_naming_the_extra(
    tmp_path: Path,
) -> None:
    router = peer_id_of(load_or_create_identity(tmp_path / "router.key"))
    argv = [
        "--router",
        f"/ip4/127.0.0.1/tcp/9/p2p/{router}",
        "--engine",
        "sim",
        "--identity-path",
        str(tmp_path / "agent.key"),
    ]
    agent = _python(
        _WITHOUT_HYPERCORN + f"from agent.cli import main; sys.exit(main({argv!r}))",
        HIVENET_ROUTER_JWT_SECRET="x" * 32,
    )
    assert agent.returncode == 2, agent.stderr
    assert agent.stderr.strip() == (
        "hivenet-agent: --engine sim: the simulated engine needs the `sim` extra (its HTTP "
        "server, Hypercorn): pip install 'hivenet-router[sim]'"
    )


def test_python_m_sim_without_the_sim_extra_exits_naming_the_extra() -> None:
    for module in ("sim", "agent.engines.sim"):
        engine = _python(
            _WITHOUT_HYPERCORN + "import runpy; sys.argv = ['x', '--model', 'm']; "
            f"runpy.run_module({module!r}, run_name='__main__')"
        )
        assert engine.returncode == 2, engine.stderr
        assert engine.stderr.strip().endswith("pip install 'hivenet-router[sim]'")


@pytest.mark.parametrize("module", ["sim", "agent.engines.sim"])
def test_both_commands_serve_the_engine(module: str) -> None:
    port = free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", module, "--model", MODEL, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/health").is_success, 30, f"python -m {module}")
        answer = httpx.post(url + "/v1/chat/completions", json=_chat("hello"))
        assert answer.json()["choices"][0]["message"]["content"] == "Echo: hello"
    finally:
        engine.terminate()
        engine.wait(10)
