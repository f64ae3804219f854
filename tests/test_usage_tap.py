"""The agent's request rewrite for token counts (agent/usage.py)."""

from __future__ import annotations

import json

from agent.usage import UsageTap, wanted
from protocol.paths import CHAT, COMPLETIONS, EMBEDDINGS


def _msg(path: str = CHAT, stream: bool = True, **fields: object) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    body.update(fields.pop("body", {}))  # type: ignore[arg-type]
    return {"path": path, "stream": stream, "body": json.dumps(body).encode(), **fields}


def _options(tap: UsageTap) -> dict | None:
    return json.loads(tap.body).get("stream_options")


def test_a_continuable_stream_asks_engines_that_can_for_the_running_count() -> None:
    msg = _msg(stream_tokens=True)
    assert wanted(msg, "vllm") and wanted(msg, "sglang") and wanted(msg, "sim")
    assert wanted(msg, "llamacpp")  # its `timings`, below
    # The rest have no running count: no tap unless usage was asked for.
    assert not wanted(msg, "ollama") and not wanted(msg, "custom")
    tap = UsageTap(msg, "vllm")
    assert _options(tap) == {"include_usage": True, "continuous_usage_stats": True}
    assert tap.strip  # the client did not ask for the usage-only chunk: it is left out
    assert tap.of_event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    # Content chunks carry the count and reach the client.
    chunk = {"choices": [{"delta": {"content": "a"}}], "usage": {"prompt_tokens": 3}}
    chunk["usage"]["completion_tokens"] = 1
    assert not tap.of_event(chunk)

    # A client that asked for the usage chunk keeps it; its other options stay.
    asked = _msg(stream_tokens=True, body={"stream_options": {"include_usage": True}})
    tap = UsageTap(asked, "vllm")
    assert _options(tap) == {"include_usage": True, "continuous_usage_stats": True}
    assert not tap.strip
    both = {"include_usage": True, "continuous_usage_stats": True}
    tap = UsageTap(_msg(stream_tokens=True, body={"stream_options": both}), "vllm")
    assert tap.body == _msg(stream_tokens=True, body={"stream_options": both})["body"]


def test_llama_cpp_is_asked_for_its_running_timings() -> None:
    tap = UsageTap(_msg(stream_tokens=True), "llamacpp")
    body = json.loads(tap.body)
    assert body["timings_per_token"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert tap.strip
    # Usage asked for (quotas) on a stream the router will not continue: no timings.
    tap = UsageTap(_msg(report_usage=True), "llamacpp")
    assert "timings_per_token" not in json.loads(tap.body)
    # Asked already: the body goes as it came.
    done = _msg(stream_tokens=True, body={"stream_options": {"include_usage": True}})
    done["body"] = json.dumps({**json.loads(done["body"]), "timings_per_token": True}).encode()
    assert UsageTap(done, "llamacpp").body == done["body"]


def test_only_chat_streams_on_those_engines_get_the_running_count() -> None:
    # Usage asked for (quotas) on llama.cpp's completions: include_usage alone.
    tap = UsageTap(_msg(COMPLETIONS, report_usage=True, stream_tokens=True), "llamacpp")
    assert _options(tap) == {"include_usage": True}
    assert "timings_per_token" not in json.loads(tap.body)
    tap = UsageTap(_msg(COMPLETIONS, report_usage=True, stream_tokens=True), "vllm")
    assert _options(tap) == {"include_usage": True}
    tap = UsageTap(_msg(EMBEDDINGS, stream=False, report_usage=True), "vllm")
    assert _options(tap) is None
    # A body that is not a JSON object goes to the engine as it came.
    bad = {"path": CHAT, "stream": True, "body": b"[1]", "stream_tokens": True}
    assert UsageTap(bad, "vllm").body == b"[1]"
