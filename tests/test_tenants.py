"""Auth file validation, local counts and usage extraction, without processes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from agent.answers import SSEChecker, check_json_answer
from agent.usage import UsageTap
from protocol import messages as m
from protocol.errors import ErrorCode
from protocol.usage import usage_of_body, valid_usage
from router.cli import main
from router.tenants.audit import AuditLog, AuditRecord
from router.tenants.config import AuthError, Tenant, hash_key, load_auth, new_key
from router.tenants.counters import LocalCounters, until_midnight, utc_day

H1, H2 = hash_key("k1"), hash_key("k2")


def errors_of(text: str) -> list[str]:
    with pytest.raises(AuthError) as exc:
        load_auth(text)
    return exc.value.errors


def test_a_valid_file_gives_tenants_with_defaults() -> None:
    config = load_auth(
        f"""
tenants:
  team-a:
    keys: ["{H1}"]
    models: [m1, "meta-llama/*"]
    requests_per_minute: 30
    tokens_per_day: 1000
    priority: 2
  b:
    keys: ["{H2}"]
"""
    )
    a = config.tenants["team-a"]
    assert a.burst == 30  # defaults to the rate
    assert a.priority == 2 and a.limited
    assert a.allows_model("m1") and a.allows_model("meta-llama/Llama-3.1-8B")
    assert not a.allows_model("m2") and not a.allows_model("M1")
    b = config.tenants["b"]
    assert b.priority == 0 and not b.limited and b.allows_model("anything")
    assert config.tenant_for_key("k2") is b and config.tenant_for_key("k3") is None


def test_every_problem_is_reported_with_its_path() -> None:
    errors = errors_of(
        f"""
tenants:
  a:
    keys: [hnr-clear-text, "{H1}", "{H1}"]
    rpm: 3
    burst: 2
    max_concurrent: 0
    priority: high
  "bad name!":
    keys: ["{H2}"]
  c:
    keys: ["{H2}"]
    models: []
"""
    )
    text = "\n".join(errors)
    assert "tenants.a.keys[0]: must be `sha256:`" in text and "a key in clear" in text
    assert "tenants.a.keys[2]: listed twice" in text
    assert "tenants.a.rpm: unknown tenant key" in text
    assert "tenants.a.burst: needs requests_per_minute" in text
    assert "tenants.a.max_concurrent: must be between 1 and 1000000000000, got 0" in text
    assert "tenants.a.priority: must be an integer, got string 'high'" in text
    assert "tenants.bad name!: tenant names are" in text
    assert "tenants.c.models: must be a non-empty list" in text


def test_limits_stop_where_redis_scripts_stay_exact() -> None:
    errors = errors_of(
        f"""
tenants:
  a:
    keys: ["{H1}"]
    requests_per_minute: 1
    burst: 1000000000000000000
    tokens_per_day: 1000000000001
    input_tokens_per_minute: 100000000000000000000
"""
    )
    assert errors == [
        "tenants.a.burst: must be between 1 and 1000000000000, got 1000000000000000000",
        "tenants.a.tokens_per_day: must be between 1 and 1000000000000, got 1000000000001",
        "tenants.a.input_tokens_per_minute: must be between 0 and 1000000000000,"
        " got 100000000000000000000",
    ], errors


def test_shared_keys_duplicate_yaml_keys_and_bad_documents_are_refused() -> None:
    shared = errors_of(f'tenants:\n  a:\n    keys: ["{H1}"]\n  b:\n    keys: ["{H1}"]\n')
    assert any("also a key of tenant 'a'" in e for e in shared)
    dup = errors_of(f'tenants:\n  a:\n    keys: ["{H1}"]\n  a:\n    keys: ["{H2}"]\n')
    assert any("duplicate key" in e for e in dup)
    assert errors_of("tenant: {}\n")[0].startswith("tenant: unknown top-level key")
    assert any("tenants: must be a mapping" in e for e in errors_of("tenants: []\n"))
    assert errors_of("- a\n")[0].startswith("auth: must be a mapping")
    assert "invalid YAML" in errors_of("tenants: [\n")[0]


def test_a_shared_key_is_listed_whatever_else_is_wrong_with_either_tenant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a's unknown key used to hide the key b shares with it, and b's bad priority the
    # one c shares with b: check-auth promises every problem at once.
    text = f"""
tenants:
  a:
    keys: ["{H1}"]
    rpm: 3
  b:
    keys: ["{H1}", "{H2}"]
    priority: high
  c:
    keys: ["{H2}"]
"""
    errors = errors_of(text)
    shared_a = f"tenants.b.keys: key {H1[:19]}… is also a key of tenant 'a'"
    shared_b = f"tenants.c.keys: key {H2[:19]}… is also a key of tenant 'b'"
    assert errors == [
        "tenants.a.rpm: unknown tenant key (known: keys, models, requests_per_minute, burst,"
        " tokens_per_day, max_concurrent, max_input_bytes, priority, mode, max_occupancy_share,"
        " input_tokens_per_minute, output_tokens_per_minute, max_input_tokens, images_max);"
        " did you mean 'requests_per_minute'?",
        "tenants.b.priority: must be an integer, got string 'high'",
        shared_a,
        shared_b,
    ]
    path = tmp_path / "auth.yaml"
    path.write_text(text)
    assert main(["check-auth", str(path)]) == 1
    printed = capsys.readouterr().err.splitlines()
    assert printed == [f"{path}: invalid auth file", *(f"  - {e}" for e in errors)]


def test_new_keys_hash_to_what_the_file_stores() -> None:
    key = new_key()
    assert key.startswith("hnr-") and len(key) > 40
    assert hash_key(key).startswith("sha256:") and len(hash_key(key)) == 71


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_local_bucket_burst_and_refill() -> None:
    clock = Clock()
    counters = LocalCounters(monotonic=clock, wall=clock)
    tenant = Tenant("t", requests_per_minute=60, burst=2)
    assert counters.admit(tenant, "1").code is None
    assert counters.admit(tenant, "2").code is None
    refused = counters.admit(tenant, "3")
    assert refused.code is ErrorCode.RATE_LIMITED
    assert refused.retry_after == pytest.approx(1.0)
    assert (refused.requests_left, refused.tokens_left) == (0, None)  # the 429's header
    clock.now += 0.5
    assert counters.admit(tenant, "4").retry_after == pytest.approx(0.5)
    clock.now += 0.5
    assert counters.admit(tenant, "5").code is None


def test_local_concurrency_and_daily_tokens() -> None:
    clock = Clock()
    counters = LocalCounters(monotonic=clock, wall=clock)
    tenant = Tenant("t", max_concurrent=1, tokens_per_day=100)
    assert counters.admit(tenant, "a").code is None
    busy = counters.admit(tenant, "b")
    assert busy.code is ErrorCode.TOO_MANY_CONCURRENT
    today = utc_day(clock.now)
    counters.release("t", "a", 60, today)
    assert counters.admit(tenant, "c").code is None
    counters.release("t", "c", 30, today)
    # 90 used: a request that may take 20 does not fit, and the refusal says 10 are left.
    short = counters.admit(tenant, "d", need=20)
    assert (short.code, short.tokens_left) == (ErrorCode.QUOTA_EXCEEDED, 10)
    counters.release("t", "x", 10, today)
    over = counters.admit(tenant, "d")
    assert (over.code, over.tokens_left) == (ErrorCode.QUOTA_EXCEEDED, 0)
    assert over.retry_after == pytest.approx(until_midnight(clock.now))
    clock.now += over.retry_after  # a new UTC day
    assert counters.admit(tenant, "e").code is None


OPENAI_STREAM = (
    b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":null}\n\n'
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,'
    b'"total_tokens":9}}\n\n'
    b"data: [DONE]\n\n"
)
USAGE_EVENT_AT = OPENAI_STREAM.index(b'data: {"choices":[]')
WITHOUT_USAGE = OPENAI_STREAM[:USAGE_EVENT_AT] + b"data: [DONE]\n\n"


def tapped_checker(strip: bool = False) -> tuple[UsageTap, SSEChecker]:
    """The agent's pair for a stream: the check parses, the tap reads what it parsed."""
    tap = UsageTap(request({"model": "m"}, stream=False))
    tap.strip = strip
    return tap, SSEChecker(tap.of_event)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
@pytest.mark.parametrize("strip", [True, False])
def test_openai_stream_usage_at_every_chunk_boundary(strip: bool, newline: bytes) -> None:
    stream = OPENAI_STREAM.replace(b"\n", newline)
    expected = (WITHOUT_USAGE if strip else OPENAI_STREAM).replace(b"\n", newline)
    for cut in range(1, len(stream)):
        tap, checker = tapped_checker(strip)
        out = checker.feed(stream[:cut]) + checker.feed(stream[cut:])
        checker.close()
        assert out == expected, cut
        assert tap.usage == {"prompt_tokens": 7, "completion_tokens": 2}


def test_anthropic_stream_usage_from_start_and_delta() -> None:
    stream = (
        b"event: message_start\r\n"
        b'data: {"type":"message_start","message":{"usage":{"input_tokens":12,'
        b'"cache_read_input_tokens":3,"output_tokens":1}}}\r\n\r\n'
        b"event: content_block_delta\r\n"
        b'data: {"type":"content_block_delta","delta":{"text":"usage"}}\r\n\r\n'
        b"event: message_delta\r\n"
        b'data: {"type":"message_delta","usage":{"output_tokens":5}}\r\n\r\n'
    )
    tap, checker = tapped_checker()
    assert b"".join(checker.feed(stream[i : i + 10]) for i in range(0, len(stream), 10)) == stream
    checker.close()
    assert tap.usage == {"prompt_tokens": 15, "completion_tokens": 5}


def test_usage_of_whole_answers() -> None:
    openai_body = b'{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}'
    assert usage_of_body(openai_body) == {"prompt_tokens": 3, "completion_tokens": 4}
    claude = b'{"usage":{"input_tokens":5,"output_tokens":6}}'
    assert usage_of_body(claude) == {"prompt_tokens": 5, "completion_tokens": 6}
    assert usage_of_body(b'{"usage":{"total_tokens":8}}') == {
        "prompt_tokens": 8,
        "completion_tokens": 0,
    }
    assert usage_of_body(b'{"data":[]}') is None
    assert usage_of_body(b'{"usage": "lots"}') is None
    assert usage_of_body(b'not json, but mentions "usage"') is None
    assert valid_usage({"prompt_tokens": 1, "completion_tokens": -1}) is None
    assert valid_usage({"prompt_tokens": True, "completion_tokens": 1}) is None


def test_the_agent_reads_whole_answers_as_the_check_parsed_them() -> None:
    tap = UsageTap(request({"model": "m"}, stream=False))
    body = gzip.compress(b'{"usage":{"prompt_tokens":3,"completion_tokens":4}}')
    tap.of_answer(check_json_answer(body, "gzip"), body)
    assert tap.usage == {"prompt_tokens": 3, "completion_tokens": 4}
    error = b'{"error":"busy","usage":{"input_tokens":2,"output_tokens":0}}'
    tap.of_answer(None, error)  # an error answer is not checked: its body is read here
    assert tap.usage == {"prompt_tokens": 2, "completion_tokens": 0}
    tap.of_answer({"object": "list"}, b'{"object":"list"}')
    assert tap.usage is None


def request(body: dict, stream: bool, path: str = "/v1/chat/completions") -> dict:
    return m.request(1, "POST", path, {}, json.dumps(body).encode(), stream, True)


def test_the_agent_asks_openai_engines_for_stream_usage_only_when_needed() -> None:
    tap = UsageTap(request({"model": "m", "stream_options": {"x": 1}}, stream=True))
    assert json.loads(tap.body)["stream_options"] == {"x": 1, "include_usage": True}
    assert tap.strip
    asked = {"model": "m", "stream_options": {"include_usage": True}}
    tap = UsageTap(request(asked, stream=True))
    assert json.loads(tap.body) == asked and not tap.strip
    for msg in (
        request({"model": "m"}, stream=False),
        request({"model": "m"}, stream=True, path="/v1/messages"),
    ):
        tap = UsageTap(msg)
        assert tap.body == msg["body"] and not tap.strip


def test_link_messages_carry_usage_in_its_shape() -> None:
    m.validate(m.request(1, "POST", "/v1/x", {}, b"{}", False, True))
    m.validate(m.response_end(1, {"prompt_tokens": 1, "completion_tokens": 2}))
    assert "report_usage" not in m.request(1, "POST", "/v1/x", {}, b"{}", False)
    assert m.response_end(1) == {"type": "response_end", "id": 1}
    with pytest.raises(m.ProtocolError):
        m.validate({**m.response_end(1), "usage": "many"})
    with pytest.raises(m.ProtocolError):
        m.validate({**m.request(1, "POST", "/v1/x", {}, b"{}", False), "report_usage": 1})


def test_audit_log_rotates_by_size(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path), max_bytes=1024, backups=2)
    record = AuditRecord("rid", "team", "/v1/chat/completions", "m", "s", "peer", 200, 1, 2, 0.01)
    for _ in range(40):
        audit.write(record)
    audit.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    for name in files:
        text = (tmp_path / name).read_text()
        assert len(text.encode()) <= 1024
        lines = [json.loads(line) for line in text.splitlines()]
        assert lines and all(x["total_tokens"] == 3 and x["tenant"] == "team" for x in lines)


def test_the_usage_rewrite_keeps_every_value_as_it_came() -> None:
    # orjson would read this integer as a float (1.2345678901234568e+20).
    tap = UsageTap(request({"model": "m", "seed": 123456789012345678901}, stream=True))
    assert json.loads(tap.body)["seed"] == 123456789012345678901
    assert b"123456789012345678901" in tap.body
    tap = UsageTap({**request({"model": "m"}, stream=True), "body": b'{"t": NaN}'})
    assert tap.body == b'{"t":NaN,"stream_options":{"include_usage":true}}'


def test_workers_sharing_an_audit_log_rotate_it_once(tmp_path: Path) -> None:
    """`serve --workers N` share `--audit-log`: lines written in turn by four writers
    are all kept, newest first, within the files the rotation keeps."""
    path = tmp_path / "audit.jsonl"
    workers = [AuditLog(str(path), max_bytes=1024, backups=3) for _ in range(4)]
    for i in range(100):
        record = AuditRecord(str(i), "team", "/v1/chat/completions", "m", "s", "peer", 200, 1, 2, 0)
        workers[i % 4].write(record)
    for audit in workers:
        audit.close()
    kept = sorted(
        int(json.loads(line)["request_id"])
        for p in tmp_path.iterdir()
        for line in p.read_text().splitlines()
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "audit.jsonl",
        *(f"audit.jsonl.{n}" for n in (1, 2, 3)),
    ]
    assert kept == list(range(kept[0], 100)) and len(kept) > 3 * 1024 // 400


def test_an_audit_log_that_cannot_be_written_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its directory gone (as a full disk, every write fails): one error line instead of
    a traceback per request, and the log resumes by itself once the path is writable."""
    folder = tmp_path / "audit"
    folder.mkdir()
    path = folder / "audit.jsonl"
    audit = AuditLog(str(path), max_bytes=1024 * 1024, backups=1)
    record = AuditRecord("rid", "team", "/v1/chat/completions", "m", "s", "peer", 200, 1, 2, 0)
    audit.write(record)
    path.unlink()
    folder.rmdir()
    with caplog.at_level("INFO", logger="tenant"):
        for _ in range(3):
            audit.write(record)
        folder.mkdir()
        audit.write(record)
        audit.write(record)
    audit.close()
    said = [r.getMessage().split(" ")[0] for r in caplog.records]
    assert said == ["audit_log_write_failed", "audit_log_writable"]
    assert "FileNotFoundError" in caplog.records[0].getMessage()
    # Not logging's traceback per line, which quotes the line itself.
    assert '"request_id":"rid"' not in capsys.readouterr().err
    assert len(path.read_text().splitlines()) == 2
