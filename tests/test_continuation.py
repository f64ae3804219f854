"""Stream continuation without processes: the sim continuing a final assistant turn, what
a broken stream had sent, and the splice that puts the next engine's stream after it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anthropic
import httpx
import openai
import pytest
import trio

from router import continuation_relay
from router.continuation import (
    Sent,
    Splice,
    closing,
    continuation_body,
    merged_usage,
    read_sent,
    sse_events,
)
from router.continuation_relay import StreamRelay
from router.link import StreamBroken
from router.metrics import RouterMetrics
from router.session import RouteRequest
from sim.__main__ import serve_sim
from sim.app import create_sim_app

MODEL = "sim/test-model"
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


async def _sim(nursery: trio.Nursery) -> str:
    port = await nursery.start(serve_sim, create_sim_app(MODEL), "127.0.0.1", 0)
    return f"http://127.0.0.1:{port}"


async def test_the_sim_continues_a_final_assistant_turn_and_counts_only_new_tokens(
    nursery: trio.Nursery,
) -> None:
    url = await _sim(nursery)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
    turns = [{"role": "user", "content": "a b c d"}]
    prefill = [*turns, {"role": "assistant", "content": "Echo: a b"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    whole = await client.chat.completions.create(model=MODEL, messages=turns)  # type: ignore[arg-type]
    assert whole.choices[0].message.content == "Echo: a b c d"
    rest = await client.chat.completions.create(
        model=MODEL,
        messages=prefill,  # type: ignore[arg-type]
        extra_body=flags,
    )
    assert rest.choices[0].message.content == " c d"
    assert rest.usage is not None
    # The prompt holds the prefill (4 + 3 words); only the 2 new tokens are output.
    assert (rest.usage.prompt_tokens, rest.usage.completion_tokens) == (7, 2)
    chunks = await client.chat.completions.create(
        model=MODEL,
        messages=prefill,  # type: ignore[arg-type]
        stream=True,
        max_tokens=1,
        extra_body=flags,
    )
    text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    assert text == " c"
    # vLLM's rule: continuing needs add_generation_prompt off; without the flag a final
    # assistant message starts a new turn.
    try:
        await client.chat.completions.create(
            model=MODEL,
            messages=prefill,  # type: ignore[arg-type]
            extra_body={"continue_final_message": True},
        )
        raise AssertionError("accepted continue_final_message with a generation prompt")
    except openai.BadRequestError as exc:
        assert "add_generation_prompt" in str(exc)
    fresh = await client.chat.completions.create(model=MODEL, messages=prefill)  # type: ignore[arg-type]
    assert fresh.choices[0].message.content == "Echo: a b c d"

    messages = anthropic.AsyncAnthropic(base_url=url, api_key="x")
    answer = await messages.messages.create(
        model=MODEL,
        max_tokens=10,
        messages=[
            {"role": "user", "content": "a b c d"},
            {"role": "assistant", "content": "Echo:"},
        ],
    )
    assert answer.content[0].text == " a b c d"  # type: ignore[union-attr]
    assert answer.usage.output_tokens == 4


async def test_the_sim_packs_tokens_into_events_and_counts_them_in_each_chunk(
    nursery: trio.Nursery,
) -> None:
    """As vLLM when its reader lags (`tokens_per_event`), with the running usage of
    `continuous_usage_stats` in every chunk; a bad setting is refused."""
    url = await _sim(nursery)
    async with httpx.AsyncClient(base_url=url) as http:
        refused = await http.post("/sim/state", json={"tokens_per_event": 0})
        assert refused.status_code == 400
        assert (await http.post("/sim/state", json={"tokens_per_event": 3})).status_code == 200
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a b c d e f g"}],
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        answer = await http.post("/v1/chat/completions", json=body)
    events = [json.loads(d) for _, d in sse_events(answer.content)[0] if d != "[DONE]"]
    content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    # "Echo: a b c d e f g": 8 tokens in events of 3, 3 and 2.
    assert [e["choices"][0]["delta"]["content"] for e in content] == [
        "Echo: a b",
        " c d e",
        " f g",
    ]
    assert [e["usage"]["completion_tokens"] for e in content] == [3, 6, 8]
    assert {e["usage"]["prompt_tokens"] for e in events} == {7}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8


def _chat_stream(pieces: list[str], *, role: bool = True, cid: str = "chatcmpl-1") -> bytes:
    out = b""
    for i, piece in enumerate(pieces):
        delta: dict = {"content": piece}
        if i == 0 and role:
            out += _data(
                {
                    "id": cid,
                    "created": 7,
                    "model": "m",
                    "choices": [_c({"role": "assistant", "content": ""})],
                }
            )
        out += _data({"id": cid, "created": 7, "model": "m", "choices": [_c(delta)]})
    return out


def _c(delta: dict, finish: str | None = None) -> dict:
    return {"index": 0, "delta": delta, "finish_reason": finish}


def _data(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _event(name: str, event: dict) -> bytes:
    return f"event: {name}\n".encode() + _data(event)


def test_a_broken_chat_stream_is_read_and_the_continuation_spliced_on() -> None:
    sent = read_sent(CHAT, _chat_stream(["Echo:", " a", " b"]))
    assert (sent.text, sent.tokens, sent.problem, sent.finished) == ("Echo: a b", 3, None, False)
    assert (sent.id, sent.created, sent.model) == ("chatcmpl-1", 7, "m")
    payload = {"model": "m", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 5}
    body = continuation_body(CHAT, payload, sent, flagged=True)
    assert body["messages"][-1] == {"role": "assistant", "content": "Echo: a b"}
    assert (body["max_tokens"], body["continue_final_message"], body["add_generation_prompt"]) == (
        2,
        True,
        False,
    )
    assert payload["max_tokens"] == 5 and len(payload["messages"]) == 1  # the client's, untouched
    assert "continue_final_message" not in continuation_body(CHAT, payload, sent, flagged=False)

    splice = Splice(CHAT, sent)
    cont = _chat_stream([" c"], cid="chatcmpl-other")
    usage = {"id": "x", "created": 9, "model": "m", "choices": []}
    usage["usage"] = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
    cont += _data({"id": "x", "created": 9, "model": "m", "choices": [_c({}, "stop")]})
    cont += _data(usage) + b"data: [DONE]\n\n"
    # Fed in pieces that cut events: only whole events go out.
    out = b"".join(splice.feed(cont[i : i + 13]) for i in range(0, len(cont), 13))
    events = [json.loads(d) for _, d in sse_events(out)[0] if d != "[DONE]"]
    assert {(e["id"], e["created"]) for e in events} == {("chatcmpl-1", 7)}
    assert all("role" not in c["delta"] for e in events for c in e["choices"])
    assert "".join(c["delta"].get("content", "") for e in events for c in e["choices"]) == " c"
    assert events[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert out.endswith(b"data: [DONE]\n\n")
    assert merged_usage({"prompt_tokens": 7, "completion_tokens": 1}, sent) == {
        "prompt_tokens": 4,
        "completion_tokens": 4,
    }


def test_the_engines_running_count_says_how_many_tokens_were_sent() -> None:
    """vLLM packs tokens into events; with `continuous_usage_stats` each chunk says how
    many it has generated. Events after the last count add one each; a count that is
    no count (a bool, negative, past 2^32) is ignored."""
    out = b""
    for text, done in (("Echo: a", 3), (" b c d", 7)):
        chunk = {"id": "c", "created": 7, "model": "m", "choices": [_c({"content": text})]}
        chunk["usage"] = {"prompt_tokens": 30, "completion_tokens": done, "total_tokens": 0}
        out += _data(chunk)
    out += _data({"id": "c", "created": 7, "model": "m", "choices": [_c({"content": " e"})]})
    sent = read_sent(CHAT, out)
    assert (sent.text, sent.tokens, sent.prompt_tokens) == ("Echo: a b c d e", 8, 30)
    payload = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 20}
    assert continuation_body(CHAT, payload, sent, flagged=True)["max_tokens"] == 12
    # The continuation's prompt holds the text sent: the client's is the engine's 30.
    assert merged_usage({"prompt_tokens": 39, "completion_tokens": 12}, sent) == {
        "prompt_tokens": 30,
        "completion_tokens": 20,
    }
    for bad in (True, -1, 2**32, "7", None):
        chunk = {"id": "c", "choices": [_c({"content": "a"})]}
        chunk["usage"] = {"prompt_tokens": 30, "completion_tokens": bad}
        assert read_sent(CHAT, _data(chunk)).tokens == 1, bad


def test_llama_cpps_running_timings_say_how_many_tokens_were_sent() -> None:
    """llama.cpp with `timings_per_token`: `predicted_n` generated so far, the prompt
    as processed (`prompt_n`) plus as found in the cache (`cache_n`)."""
    out = b""
    for text, done in (("Echo: a", 2), (" b c", 5)):
        chunk = {"id": "c", "created": 7, "model": "m", "choices": [_c({"content": text})]}
        chunk["timings"] = {"cache_n": 20, "prompt_n": 16, "predicted_n": done}
        out += _data(chunk)
    sent = read_sent(CHAT, out)
    assert (sent.text, sent.tokens, sent.prompt_tokens) == ("Echo: a b c", 5, 36)
    for bad in ({"prompt_n": 3}, {"predicted_n": True, "prompt_n": 3}, {"predicted_n": 1}):
        chunk = {"id": "c", "choices": [_c({"content": "a"})], "timings": bad}
        assert read_sent(CHAT, _data(chunk)).tokens == 1, bad


def test_streams_that_cannot_be_continued_say_why() -> None:
    tool = _data({"id": "c", "choices": [_c({"tool_calls": [{"index": 0, "id": "t"}]})]})
    assert read_sent(CHAT, tool).problem == "tool-call streams are not continued"
    two = _data({"id": "c", "choices": [{"index": 1, "delta": {"content": "x"}}]})
    assert "n > 1" in str(read_sent(CHAT, two).problem)
    half = _chat_stream(["Echo:"]) + b'data: {"id":"c","cho'
    assert read_sent(CHAT, half).problem == "the stream broke inside an event"
    block = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    start = {"type": "content_block_start", "index": 0, "content_block": block}
    assert "tool_use blocks" in str(
        read_sent(MESSAGES, _event("content_block_start", start)).problem
    )
    assert read_sent("/v1/embeddings", b"").problem is not None


def _messages_head() -> bytes:
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": []}
    message["usage"] = {"input_tokens": 4, "output_tokens": 0}
    text = {"type": "text", "text": ""}
    start = {"type": "content_block_start", "index": 0, "content_block": text}
    return _event("message_start", {"type": "message_start", "message": message}) + _event(
        "content_block_start", start
    )


def _delta(text: str, index: int = 0) -> bytes:
    delta = {"type": "text_delta", "text": text}
    return _event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


def test_a_broken_messages_stream_goes_on_in_its_open_text_block() -> None:
    sent = read_sent(MESSAGES, _messages_head() + _delta("Echo:") + _delta(" a"))
    assert (sent.text, sent.tokens, sent.input_tokens, sent.open_block) == ("Echo: a", 2, 4, 0)
    payload = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "a b"}]}
    body = continuation_body(MESSAGES, payload, sent, flagged=True)
    assert body["messages"][-1] == {"role": "assistant", "content": "Echo: a"}
    assert body["max_tokens"] == 8 and "continue_final_message" not in body

    stop = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}
    stop["usage"] = {"output_tokens": 1}
    cont = (
        _messages_head()
        + _delta(" b")
        + _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    )
    cont += _event("message_delta", stop) + _event("message_stop", {"type": "message_stop"})
    out = Splice(MESSAGES, sent).feed(cont)
    events = [(n, json.loads(d)) for n, d in sse_events(out)[0]]
    assert [n for n, _ in events] == [
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["delta"]["text"] == " b"
    assert events[2][1]["usage"] == {"output_tokens": 3}
    # A second block of the continuation takes the next index; after a closed block
    # the first one does.
    text = {"type": "text", "text": ""}
    more = _event(
        "content_block_start", {"type": "content_block_start", "index": 1, "content_block": text}
    )
    splice = Splice(MESSAGES, sent)
    splice.feed(_messages_head())
    assert json.loads(sse_events(splice.feed(more))[0][0][1])["index"] == 1
    stop = _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    closed = read_sent(MESSAGES, _messages_head() + _delta("Echo:") + stop)
    assert (closed.open_block, closed.next_block) == (None, 1)
    reopened = Splice(MESSAGES, closed).feed(_messages_head())
    assert [json.loads(d)["index"] for _, d in sse_events(reopened)[0]] == [1]


def test_a_stream_whole_when_it_broke_gets_its_end_from_the_router() -> None:
    sent = read_sent(CHAT, _chat_stream(["Echo:"]))
    end = closing(CHAT, sent, "length")
    events = sse_events(end)[0]
    assert json.loads(events[0][1])["choices"][0]["finish_reason"] == "length"
    assert events[-1][1] == "[DONE]"
    whole = Sent(finished=True, open_block=0, tokens=3)
    names = [n for n, _ in sse_events(closing(MESSAGES, whole, "stop"))[0]]
    assert names == ["content_block_stop", "message_stop"]


def test_the_policy_turns_continuation_off_and_names_a_misspelt_option() -> None:
    from router.policy.schema import PolicyError, load_policy

    base = "routing_policy:\n  match: {}\n  strategy: least-loaded\n"
    assert load_policy(base).stream_continuation is True
    assert load_policy(base + "stream_continuation: false\n").stream_continuation is False
    for text, message in (
        ("stream_continuaton: false\n", "did you mean 'stream_continuation'?"),
        ("stream_continuation: sometimes\n", "stream_continuation: must be true or false"),
    ):
        try:
            load_policy(base + text)
            raise AssertionError(f"accepted {text!r}")
        except PolicyError as exc:
            assert message in str(exc.errors)


class _Peer:
    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id


class _Session:
    def __init__(self, peer_id: str) -> None:
        self.peer = _Peer(peer_id)


class _Answer:
    """An agent's answer as the relay reads it: chunks, then an end or a break."""

    def __init__(self, peer_id: str, chunks: list[bytes], breaks: bool, usage: dict | None) -> None:
        self.session = _Session(peer_id)
        self._chunks, self._breaks = chunks, breaks
        self.usage = usage
        self.closed = False

    async def parts(self) -> AsyncIterator[tuple[bytes, bool]]:
        for i, chunk in enumerate(self._chunks):
            yield chunk, not self._breaks and i == len(self._chunks) - 1
        if self._breaks:
            raise StreamBroken("agent_disconnected: agent session closed")

    def close(self) -> None:
        self.closed = True


class _Continuer:
    def __init__(self, answers: list[_Answer]) -> None:
        self.metrics = RouterMetrics()
        self.answers = answers
        self.asked: list[tuple[str, frozenset[str]]] = []

    def enabled(self, req: RouteRequest) -> bool:
        return True

    async def continue_after(self, req: RouteRequest, sent: Sent, exclude: frozenset[str]):
        self.asked.append((sent.text, exclude))
        return self.answers.pop(0) if self.answers else None


def _req(**payload: object) -> RouteRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "a b c"}], **payload}
    return RouteRequest("r1", "m", "llm", "t", "POST", CHAT, {}, b"", True, body)


async def _relay(relay: StreamRelay) -> bytes:
    out: list[bytes] = []

    async def send(message: dict) -> None:
        out.append(message.get("body", b""))

    try:
        await relay.run(send)
    finally:
        relay.response.close()
    return b"".join(out)


async def test_the_relay_continues_each_break_on_another_agent_and_merges_usage() -> None:
    usage = {"prompt_tokens": 6, "completion_tokens": 1}
    end = _data({"id": "z", "choices": [_c({}, "stop")]}) + b"data: [DONE]\n\n"
    second = _Answer("B", [_chat_stream([" b"], cid="y")], True, None)
    third = _Answer("C", [_chat_stream([" c"], cid="z") + end], False, usage)
    continuer = _Continuer([second, third])
    seen: list[object] = []
    first = _Answer("A", [_chat_stream(["Echo:", " a"])], True, None)
    relay = StreamRelay(continuer, _req(), first, seen.append)  # type: ignore[arg-type]
    out = await _relay(relay)
    sent = read_sent(CHAT, out)
    assert (sent.text, sent.id, sent.problem, sent.finished) == (
        "Echo: a b c",
        "chatcmpl-1",
        None,
        True,
    )
    assert continuer.asked == [("Echo: a", frozenset({"A"})), ("Echo: a b", frozenset({"A", "B"}))]
    assert seen == [second, third] and first.closed and second.closed
    assert relay.usage == {"prompt_tokens": 3, "completion_tokens": 4}
    outcome = continuer.metrics.stream_continuations.labels("m", "t", "continued")
    assert outcome._value.get() == 2


async def test_the_relay_ends_with_the_break_when_it_cannot_continue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No agent takes it: the break is raised (the caller sends the error event).
    continuer = _Continuer([])
    first = _Answer("A", [_chat_stream(["Echo:"])], True, None)
    with pytest.raises(StreamBroken):
        await _relay(StreamRelay(continuer, _req(), first, print))  # type: ignore[arg-type]
    assert continuer.asked == [("Echo:", frozenset({"A"}))]
    # Its token limit spent: the router writes the end, no agent is asked.
    continuer = _Continuer([])
    spent = _Answer("A", [_chat_stream(["Echo:", " a"])], True, None)
    out = await _relay(StreamRelay(continuer, _req(max_tokens=2), spent, print))  # type: ignore[arg-type]
    assert continuer.asked == [] and out.endswith(b"data: [DONE]\n\n")
    assert read_sent(CHAT, out).finished
    # A stream past the transcript's bound is not kept, so not continued.
    monkeypatch.setattr(continuation_relay, "MAX_TRANSCRIPT_BYTES", 100)
    continuer = _Continuer([_Answer("B", [], False, None)])
    long = _Answer("A", [_chat_stream(["Echo:", *[" w"] * 10])], True, None)
    with pytest.raises(StreamBroken):
        await _relay(StreamRelay(continuer, _req(), long, print))  # type: ignore[arg-type]
    assert continuer.asked == []


async def test_a_break_after_the_streams_last_event_adds_nothing() -> None:
    """The agent gone after `[DONE]` (or `message_stop`) reached the client, before its
    end frame: the client has the whole stream, and reads its last event once."""
    end = _data({"id": "chatcmpl-1", "choices": [_c({}, "stop")]}) + b"data: [DONE]\n\n"
    first = _Answer("A", [_chat_stream(["Echo:", " a"]) + end], True, None)
    continuer = _Continuer([])
    out = await _relay(StreamRelay(continuer, _req(), first, print))  # type: ignore[arg-type]
    assert continuer.asked == [] and out.count(b"[DONE]") == 1 and out.endswith(end)
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 3}}}
    stop = _event("message_stop", {"type": "message_stop"})
    whole = read_sent(MESSAGES, _event("message_start", start) + stop)
    assert whole.ended and closing(MESSAGES, whole, "stop") == b""
    # Its finish reached the client but not `[DONE]`: only `[DONE]` is added.
    finished = read_sent(CHAT, _chat_stream(["Echo:"]) + end[: -len(b"data: [DONE]\n\n")])
    assert closing(CHAT, finished, "stop") == b"data: [DONE]\n\n"
