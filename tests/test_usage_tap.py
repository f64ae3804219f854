"""The agent's request rewrite for token counts (agent/usage.py)."""

from __future__ import annotations

import json
import random

import pytest

from agent.answers import MalformedAnswer, SSEChecker
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


def _usage_events(rng: random.Random) -> list[bytes]:
    """Event data as engines send it, counts of every shape `normalize` meets, and a
    few that are not JSON objects at all."""
    counts = [b"3", b"0", b"7", b"-1", b"null", b"true", b"2.0", b'"4"', b"123456789012345678901"]
    names = [
        b"prompt_tokens",
        b"completion_tokens",
        b"total_tokens",
        b"input_tokens",
        b"output_tokens",
        b"cache_read_input_tokens",
        b"cache_creation_input_tokens",
        b"other",
    ]

    def usage() -> bytes:
        fields = [
            b'"' + rng.choice(names) + b'":' + rng.choice(counts) for _ in range(rng.randint(0, 4))
        ]
        if rng.random() < 0.2:
            fields.append(b'"prompt_tokens_details":{"cached_tokens":1}')
        if rng.random() < 0.2:
            return rng.choice([b"null", b"[]", b'"x"'])
        return b"{" + b",".join(fields) + b"}"

    content = [b'[{"delta":{"content":"hi"}}]', b'[{"delta":{"content":"\xc3\xa9"}}]']
    choices = [b"[]", b"[ ]", *content]
    broken = [
        lambda: b'{"choices":[],"usage":{"prompt_tokens":1}',  # cut short
        lambda: b'{"a":"\xff","usage":{"prompt_tokens":2}}',  # not UTF-8
        lambda: b"[1]",
    ]
    shapes = [
        lambda: b'{"choices":' + rng.choice(choices) + b',"usage":' + usage() + b"}",
        lambda: b'{"choices":' + rng.choice(choices) + b',"usage":' + usage() + b"}",
        lambda: b'{"id":"c","choices":' + rng.choice(choices) + b"}",
        lambda: b'{"type":"message_start","message":{"usage":' + usage() + b"}}",
        lambda: b'{"type":"message_delta","usage":' + usage() + b"}",
        lambda: b'{"type":"response.completed","response":{"usage":' + usage() + b"}}",
        lambda: b'{"type":"message_stop"}',
        lambda: b'{"usage":' + usage() + b',"usage":' + usage() + b"}",
        lambda: b'{"message":"not an object","usage":null}',
    ]
    return [
        rng.choice(broken if rng.random() < 0.03 else shapes)() for _ in range(rng.randint(1, 6))
    ]


def _relayed(events: list[bytes], strip: bool, fast: bool) -> tuple:
    msg = _msg(stream_tokens=True, body={"stream_options": {"include_usage": not strip}})
    tap = UsageTap(msg, "vllm")
    assert tap.strip is strip
    checker = SSEChecker(tap.of_event, tap.of_data if fast else None)
    out = []
    try:
        for data in events:
            out.append(checker.feed(b"data: " + data + b"\n\n"))
    except MalformedAnswer as exc:
        return ("malformed", str(exc), out, tap.usage)
    return ("ok", out, tap.usage, checker.finished)


def test_an_event_read_without_its_object_gets_the_verdict_of_the_object() -> None:
    """`of_data` reads events without building them; for thousands of streams of
    events with counts of every shape it relays, drops, counts and refuses exactly
    what `of_event` on the parsed object does."""
    rng = random.Random(5)
    dropped = counted = 0
    for _ in range(4000):
        events = _usage_events(rng)
        strip = rng.random() < 0.5
        fast, full = _relayed(events, strip, True), _relayed(events, strip, False)
        assert fast == full, events
        if fast[0] == "ok":
            dropped += sum(not out for out in fast[1])
            counted += fast[2] is not None
    assert dropped > 200 and counted > 1000, (dropped, counted)


def _reference(body: bytes, continuous: bool) -> object:
    """What the request rewrite made of a body by parsing and writing it again."""
    payload = json.loads(body)
    options = payload.get("stream_options")
    options = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    if continuous:
        options["continuous_usage_stats"] = True
    payload["stream_options"] = options
    return payload


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","stream":true}',
        b'  {\n "model" : "m", "messages":[{"content":"caf\xc3\xa9"}] } ',
        b"{}",
        b"{ }",
        b'{"stream_options":null,"model":"m"}',
        b'{"stream_options":{"continuous_usage_stats":true},"n":1e400}',
        b'{"model":"m","stream_opt\\u0069ons":{"include_usage":false}}',
    ],
)
@pytest.mark.parametrize("continuous", [True, False])
def test_the_usage_options_are_added_to_the_body(body: bytes, continuous: bool) -> None:
    """A body without `stream_options` keeps its bytes, the options written in at the
    start of its object; any body reads as the rewrite that parsed it made it."""
    path = CHAT if continuous else COMPLETIONS
    msg = {"path": path, "stream": True, "body": body, "stream_tokens": True}
    tap = UsageTap(msg, "vllm")
    assert json.loads(tap.body) == _reference(body, continuous)
    assert tap.strip
    if b"stream_opt" not in body:
        assert tap.body.endswith(body[body.index(b"{") + 1 :])


@pytest.mark.parametrize("body", [b'{"a":"\xff"}', b"[1]", b'{"a":1', b'{"a":NaN}', b""])
def test_a_body_the_rewrite_cannot_read_goes_as_it_came(body: bytes) -> None:
    msg = {"path": CHAT, "stream": True, "body": body, "stream_tokens": True}
    tap = UsageTap(msg, "vllm")
    if body == b'{"a":NaN}':  # Python's json reads it: rewritten as before
        assert b"continuous_usage_stats" in tap.body
        return
    assert tap.body == body and not tap.strip
