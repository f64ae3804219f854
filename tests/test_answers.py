"""The agent's check of engine answers (agent/answers.py), without the network."""

from __future__ import annotations

import gzip
import json
import random
import zlib

import pytest
import trio
import trio.testing

from agent.answers import MalformedAnswer, SSEChecker, check_json_answer, is_event_stream
from agent.engine_http import EnginePool, EngineTimeouts
from agent.forward import forward
from protocol import messages as m

CHUNK = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
ANTHROPIC = (
    b'event: message_start\ndata: {"type":"message_start"}\n\n'
    b": keep-alive\n\n"
    b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)
OPENAI = CHUNK * 3 + b"data: [DONE]\n\n"


def run(stream: bytes, sizes: int) -> bytes:
    """Feed `stream` in pieces of `sizes` bytes; the bytes returned, after close()."""
    checker = SSEChecker()
    out = b"".join(checker.feed(stream[i : i + sizes]) for i in range(0, len(stream), sizes))
    checker.close()
    return out


@pytest.mark.parametrize("stream", [OPENAI, ANTHROPIC])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 50, 10_000])
def test_a_good_stream_passes_whole_in_any_chunking(stream: bytes, size: int) -> None:
    assert run(stream, size) == stream


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"])
@pytest.mark.parametrize("size", [1, 2, 5, 10_000])
def test_crlf_and_cr_line_ends(newline: bytes, size: int) -> None:
    stream = OPENAI.replace(b"\n", newline)
    assert run(stream, size) == stream


def test_only_whole_events_leave_and_none_before_the_first_data_event() -> None:
    checker = SSEChecker()
    assert checker.feed(b": ping\n\n") == b""  # a comment alone: held
    assert checker.feed(b"event: message_start\ndata: {") == b""
    assert checker.feed(b'"type":"message_start"}\n') == b""
    out = checker.feed(b"\ndata: [DO")
    assert out == b': ping\n\nevent: message_start\ndata: {"type":"message_start"}\n\n'
    assert checker.feed(b"NE]\n\n") == b"data: [DONE]\n\n"
    checker.close()


def test_multi_line_data_is_joined_before_parsing() -> None:
    assert run(b'data: {"a":\ndata: 1}\n\n', 3) == b'data: {"a":\ndata: 1}\n\n'
    with pytest.raises(MalformedAnswer, match="not JSON"):
        run(b'data: {"a":\n\ndata: 1}\n\n', 100)


def test_data_without_a_space_and_a_bare_field_name() -> None:
    assert run(b'data:{"a":1}\nid: 7\nretry: 10\nevent\n\n', 4)
    with pytest.raises(MalformedAnswer, match="not JSON"):
        run(b"data\n\n", 100)  # an empty data value is not a JSON object


@pytest.mark.parametrize(
    ("stream", "problem"),
    [
        (CHUNK + b"data: upstream hiccup\n\n", "not JSON"),
        (b"data: [1, 2]\n\n", "not a JSON object"),
        (b"data: \xff\xfe\n\n", "not JSON"),
        (CHUNK + b'data: {"choices":[{"del', "broke off inside an event"),
        (CHUNK + b"event: message_delta\n", "broke off inside an event"),
        (b"", "without any data event"),
        (b": ping\n\n", "without any data event"),
        (b"<html><body>502 Bad Gateway</body></html>\n\n", "not a server-sent event line"),
    ],
)
@pytest.mark.parametrize("size", [1, 10_000])
def test_broken_streams(stream: bytes, problem: str, size: int) -> None:
    with pytest.raises(MalformedAnswer, match=problem):
        run(stream, size)


def test_a_broken_event_after_good_ones_fails_at_its_chunk() -> None:
    checker = SSEChecker()
    assert checker.feed(CHUNK) == CHUNK
    with pytest.raises(MalformedAnswer):
        checker.feed(b"data: nope\n\n")


def test_whole_answers() -> None:
    check_json_answer(b'{"object":"list","data":[]}')
    check_json_answer(b' {"a": 1}\n')
    for body, problem in [
        (b"", "empty"),
        (b"  \n", "empty"),
        (b"\x00garbage", "not JSON"),
        (b"<html>502</html>", "not JSON"),
        (b'["a"]', "not an object"),
        (b"null", "not an object"),
        (b'{"a": ', "not JSON"),
        (b"[" * 100_000, "nested too deeply|not JSON"),
    ]:
        with pytest.raises(MalformedAnswer, match=problem):
            check_json_answer(body)


def test_compressed_answers_are_decoded_for_the_check() -> None:
    good = json.dumps({"a": 1}).encode()
    check_json_answer(gzip.compress(good), "gzip")
    check_json_answer(zlib.compress(good), "deflate")
    with pytest.raises(MalformedAnswer, match="not JSON"):
        check_json_answer(gzip.compress(b"<html>"), "gzip")
    with pytest.raises(MalformedAnswer, match="does not decode"):
        check_json_answer(b"not gzip", "gzip")
    check_json_answer(b"opaque", "br")  # cannot be looked into: relayed as is
    with pytest.raises(MalformedAnswer, match="truncated"):
        check_json_answer(gzip.compress(good)[:-6], "gzip")


def test_a_compressed_answer_that_decodes_past_the_limit_is_malformed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gzip bomb: 64 KiB that decodes to 64 MiB stops at the limit, unread past it."""
    bomb = gzip.compress(b"0" * (64 << 20))
    assert len(bomb) < 128 << 10
    monkeypatch.setattr("agent.answers.MAX_DECODED_BYTES", 1 << 20)
    with pytest.raises(MalformedAnswer, match="decodes past 1048576 bytes"):
        check_json_answer(bomb, "gzip")
    assert check_json_answer(gzip.compress(b'{"a": 1}'), "gzip") == {"a": 1}


def test_event_stream_content_type() -> None:
    assert is_event_stream("text/event-stream")
    assert is_event_stream("Text/Event-Stream; charset=utf-8")
    assert not is_event_stream("application/json")
    assert not is_event_stream("")


def test_an_event_that_never_ends_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.answers.MAX_EVENT_BYTES", 100)
    checker = SSEChecker()
    checker.feed(b"data: " + b"x" * 90)
    with pytest.raises(MalformedAnswer, match="larger than 100 bytes"):
        checker.feed(b"x" * 20)


@pytest.mark.parametrize("stream", [OPENAI, ANTHROPIC])
def test_finished_at_the_last_event_only(stream: bytes) -> None:
    checker = SSEChecker()
    last = stream.rindex(b"data:")
    checker.feed(stream[:last])
    assert not checker.finished
    checker.feed(stream[last:])
    assert checker.finished


class _Stalling:
    """An engine connection that sends a whole stream, then keeps its connection open."""

    def __init__(self, body: bytes) -> None:
        self.unread = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(body), body)
        )

    async def send_all(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self.unread:
            await trio.sleep_forever()
        data, self.unread = self.unread, b""
        return data

    def close(self) -> None:
        self.unread = b""


@pytest.mark.parametrize("stream", [OPENAI, ANTHROPIC])
def test_the_end_leaves_with_the_last_event(stream: bytes) -> None:
    """The agent ends the answer at `[DONE]` / `message_stop`, in the same moment as that
    event, without waiting for the engine to close: a client leaves as soon as it has
    the last event, and the router must have the end (with the usage) by then."""
    sent: list[tuple[float, str]] = []

    async def engine() -> _Stalling:
        return _Stalling(stream)

    async def main() -> None:
        msg = {
            "id": 1,
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": {"content-type": "application/json"},
            "body": b"{}",
            "stream": True,
        }
        timeouts = EngineTimeouts(5.0, 120.0)
        async with EnginePool("http://engine", timeouts, 1, engine) as pool:
            with trio.fail_after(10):
                await forward(pool, msg, lambda f: sent.append((trio.current_time(), f)))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    kinds = [frame["type"] for _, frame in sent]
    assert kinds == [m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END]
    assert b"".join(f["data"] for _, f in sent if f["type"] == m.RESPONSE_CHUNK) == stream
    assert sent[-1][0] == sent[1][0], "the end waited for the engine"


def test_json_only_pythons_parser_reads_still_passes_the_check() -> None:
    """orjson refuses NaN, Infinity and integers past 64 bits; Python's json, which the
    check used before, reads them, so an answer holding them is still relayed."""
    for body in (b'{"logprob": NaN}', b'{"a": -Infinity}', b'{"seed": 123456789012345678901}'):
        assert isinstance(check_json_answer(body), dict)
        checker = SSEChecker()
        assert checker.feed(b"data: " + body + b"\n\n")
    with pytest.raises(MalformedAnswer, match="not JSON"):
        check_json_answer(b'{"a": nan}')
    with pytest.raises(MalformedAnswer, match="nested too deeply"):
        check_json_answer(b"[" * 100_000)


def _events(rng: random.Random) -> bytes:
    """A stream of events of the shapes engines send, and a few they should not."""
    shapes = [
        b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n',
        b'data: {"drop":true}\n\n',
        b'data:{"a":1}\n\n',
        b"data: [DONE]\n\n",
        b": keep-alive\n\n",
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
        b'data: {"a":\ndata: 1}\n\n',
        b'data: {"a":1}\r\n\r\n',
        b"\n\n",
        b"data: nope\n\n",
        b"data: \n\n",
    ]
    return b"".join(rng.choice(shapes) for _ in range(rng.randint(1, 8)))


def _outcome(feed_name: str, stream: bytes, cuts: list[int]) -> tuple:
    seen: list[dict] = []

    def observe(value: dict) -> bool:
        seen.append(value)
        return bool(value.get("drop"))

    checker = SSEChecker(observe)
    feed = getattr(checker, feed_name)
    out = []
    try:
        for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            out.append(feed(stream[start:end]))
        checker.close()
    except MalformedAnswer as exc:
        return ("malformed", str(exc), out, seen)
    return ("ok", out, seen, checker.finished, checker.data_events)


def test_whole_events_are_checked_as_the_line_scan_checks_them() -> None:
    """`feed` takes a shortcut for chunks of whole `data: ` events; for any stream in
    any chunking it returns, drops, observes and refuses exactly what the line scan
    (`_feed`) alone does, chunk by chunk."""
    rng = random.Random(7)
    shortcuts = 0
    for _ in range(3000):
        stream = _events(rng)
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randint(0, 3))))
        if rng.random() < 0.5:  # cut on event boundaries, as engines' reads mostly fall
            ends = [i + 2 for i in range(len(stream) - 1) if stream[i : i + 2] == b"\n\n"]
            cuts = sorted(set(rng.sample(ends, min(len(ends), 2))) - {len(stream)})
            shortcuts += 1
        assert _outcome("feed", stream, cuts) == _outcome("_feed", stream, cuts), (stream, cuts)
    assert shortcuts > 1000


def _json_like(rng: random.Random) -> bytes:
    """Event data near JSON: an engine's chunk with a few bytes changed, dropped or
    repeated, or a hostile value (deep nesting, NaN, big integers, escapes, UTF-8)."""
    shapes = [
        b'{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
        b'{"content":" hi"},"logprobs":null,"finish_reason":null}]}',
        b'{"type":"message_stop"}',
        b'{"type":["message_stop"],"a":{"b":[1,2.5e3,-0,true,false,null]}}',
        b'{"a":"\\u00e9\\ud800\\n\\"","b":123456789012345678901234567890}',
        b'{"a":NaN,"b":-Infinity}',
        '{"a":"é","type":"response.completed"}'.encode(),
        b'[1,{"a":2}]',
        b'"text"',
    ]
    depth = rng.choice([1, 100, 500, 1000, 1023, 1024, 1025, 1500])
    shapes.append(b'{"a":' + b"[" * depth + b"]" * depth + b"}")
    data = bytearray(rng.choice(shapes))
    alphabet = b'{}[]":,.-+eE0123456789 \t\n\\ntrufalsNI\x00\x01\x7f\xc3\xa9\xff'
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        at = rng.randrange(len(data) + 1)
        action = rng.randrange(3)
        if action == 0:
            data[at:at] = bytes([rng.choice(alphabet)])
        elif action == 1 and data:
            del data[min(at, len(data) - 1)]
        elif data:
            data[at:at] = data[at : at + rng.randint(1, 4)]
    return bytes(data)


def _verdict(observe: bool, data: bytes) -> tuple:
    checker = SSEChecker((lambda value: False) if observe else None)
    try:
        out = checker.feed(b"data: " + data + b"\n\n")
    except MalformedAnswer as exc:
        return ("malformed", str(exc))
    return ("ok", out, checker.finished)


def test_an_event_nobody_observes_gets_the_verdict_of_the_full_parse() -> None:
    """An event without `observe` is read by msgspec, which builds nothing; over
    thousands of near-JSON data it passes, refuses (with the same message) and ends
    the stream exactly where the full parse (taken whenever `observe` is set) does."""
    rng = random.Random(11)
    both = {"ok": 0, "malformed": 0}
    for _ in range(6000):
        data = _json_like(rng)
        if b"\n" in data or b"\r" in data:
            continue  # one data line per event here; line ends are the scan's to test
        fast, full = _verdict(False, data), _verdict(True, data)
        assert fast == full, data
        both[fast[0]] += 1
    assert min(both.values()) > 1000, both
